"""Block sizes for the dequant-matmul kernel, keyed by ``(num_tokens bucket, bits)``.

The entries are starting points chosen from the kernel's shape constraints (Triton wants every
block a power of two and every matmul dimension at least 16; a tile along ``in`` must hold whole
32-code runs), not measurements: no GPU has timed them yet. Replace an entry only with a number
produced by a ``tools/`` benchmark on the target GPU.
"""

from __future__ import annotations

import dataclasses

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import PLANES, RUN

_TOKEN_BUCKETS = (16, 64, 256)  # decode and small batches, short prefill chunks, long ones


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One kernel launch configuration.

    Each program owns a ``[block_m, block_n]`` output tile (token rows by output features) and
    walks the input features ``block_k`` at a time; ``num_warps`` and ``num_stages`` go to the
    Triton compiler. The kernel may shrink ``block_m``, ``block_n`` and ``block_k`` to fit a
    shape (see ``kernel``), never grow them.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not is_power_of_two(value) or value < 16:
                raise ValueError(
                    f"{name} must be a power of two >= 16 (Triton block and matmul limits), "
                    f"got {value}"
                )
        if not is_power_of_two(self.block_k) or self.block_k < RUN:
            raise ValueError(
                f"block_k must be a power of two >= {RUN} (whole packed runs), got {self.block_k}"
            )
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(
                f"num_warps and num_stages must be >= 1, got {self.num_warps}, {self.num_stages}"
            )


DEFAULT = BlockConfig(block_m=16, block_n=64, block_k=128)


def _table() -> dict[tuple[int, int], BlockConfig]:
    # Decode reads each weight byte once per step, so it wants many programs over ``out`` (small
    # block_n, long block_k); prefill reuses each dequantized tile over more token rows.
    # Wider codes make a bigger tile per step, so block_k halves at 8 bits.
    table = {}
    for bits in PLANES:
        deep = 128 if bits == 8 else 256
        table[(16, bits)] = BlockConfig(block_m=16, block_n=32, block_k=deep, num_stages=3)
        table[(64, bits)] = BlockConfig(block_m=64, block_n=64, block_k=64, num_stages=3)
        table[(256, bits)] = BlockConfig(block_m=128, block_n=64, block_k=64, num_warps=8)
    return table


TUNING: dict[tuple[int, int], BlockConfig] = _table()


def token_bucket(num_tokens: int) -> int:
    """The smallest bucket holding ``num_tokens`` rows (the largest bucket past the end)."""
    for bucket in _TOKEN_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    return _TOKEN_BUCKETS[-1]


def lookup(num_tokens: int, bits: int) -> BlockConfig:
    """The tuned config for this shape, or ``DEFAULT`` when the table has no entry."""
    return TUNING.get((token_bucket(num_tokens), bits), DEFAULT)
