"""The engine core: the loop thread that steps the scheduler and the model runner, the paged
KV cache's page allocator, the padding buckets and their ahead-of-time compiled executables, the
on-device sampler and grammar masks, the request vocabulary, the cache-free embedder, and the
mock engine that ``--mock-engine`` serves for testing clients without a model.
"""
