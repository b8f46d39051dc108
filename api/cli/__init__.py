"""The command lines: ``runtime-serve`` (flags to an ``EngineConfig``, the engines built, uvicorn
started and drained) and ``runtime-chat`` (a terminal chat client); ``.env`` files and the
``--models-config`` YAML file of named models.
"""
