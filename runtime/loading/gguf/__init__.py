"""GGUF files: the bounds-checked container reader, each architecture's metadata keys and tensor
names, the translation to an HF config and HF-named tensors, and the re-quantizing writer behind
``--isq``.
"""
