"""What every route sits behind: the server's settings, API keys, request header caps,
``X-Request-Id``, Prometheus metrics, the served models by name, dependency injection, graceful
draining and the handling of clients that go away.
"""
