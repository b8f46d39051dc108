"""Dequant-matmul: packed quantized weights (GGUF block types, GPTQ/AWQ 4-bit) and the matmul
that reads them without a float copy of the weight in memory.

``formats`` defines ``PackedWeight`` (one pytree for every format) and ``PackedLayer`` (one layer
of a stack of them), ``gguf_blocks`` re-lays GGUF block bytes into it, ``quantize`` writes GGUF
block bytes from float weights (in-situ quantization), ``reference`` dequantizes in pure jnp,
``kernel`` is the Pallas kernel, ``native`` the C++ CPU kernel, and ``dequant_matmul`` picks one.
"""

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import (
    HostPacked,
    PackedLayer,
    PackedWeight,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul.ops import (
    dequant_matmul,
    dequant_matmul_group,
    packed_head,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul.reference import dequantize

__all__ = [
    "HostPacked",
    "PackedLayer",
    "PackedWeight",
    "dequant_matmul",
    "dequant_matmul_group",
    "dequantize",
    "packed_head",
]
