"""The runtime as a Python library with no HTTP in between: ``InferenceEngine`` and its fluent
builder, the event-loop thread that lets synchronous code drive it, and llama.cpp-style
perplexity.
"""
