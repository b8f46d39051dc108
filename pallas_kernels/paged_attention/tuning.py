"""Block sizes for the paged-attention kernel, keyed by ``(head_dim, page_size, q_len bucket)``.

The entries are starting points chosen from the kernel's shape constraints (Triton wants every
block a power of two and every matmul dimension at least 16), not measurements: no GPU has timed
them yet. Replace an entry only with a number produced by a ``tools/`` benchmark on the target GPU.
"""

from __future__ import annotations

import dataclasses

_Q_LEN_BUCKETS = (1, 16, 128)  # decode, short prefill chunk, long prefill chunk


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One kernel launch configuration.

    ``block_rows`` query rows (query tokens times the query heads of one KV head) share each K/V
    block of ``block_k`` key positions; ``num_warps`` and ``num_stages`` go to the Triton compiler.
    """

    block_rows: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_rows", "block_k"):
            value = getattr(self, name)
            if not is_power_of_two(value) or value < 16:
                raise ValueError(
                    f"{name} must be a power of two >= 16 (Triton block and matmul limits), "
                    f"got {value}"
                )
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(
                f"num_warps and num_stages must be >= 1, got {self.num_warps}, {self.num_stages}"
            )


DEFAULT = BlockConfig(block_rows=16, block_k=64)

# (head_dim, page_size, q_len bucket) -> BlockConfig. Decode keeps the row block small (one token's
# query heads) and streams long key blocks; prefill chunks trade key length for row reuse.
TUNING: dict[tuple[int, int, int], BlockConfig] = {
    (64, 16, 1): BlockConfig(block_rows=16, block_k=128, num_warps=4, num_stages=2),
    (64, 16, 16): BlockConfig(block_rows=64, block_k=64, num_warps=4, num_stages=2),
    (64, 16, 128): BlockConfig(block_rows=128, block_k=64, num_warps=8, num_stages=2),
    (128, 16, 1): BlockConfig(block_rows=16, block_k=64, num_warps=4, num_stages=2),
    (128, 16, 16): BlockConfig(block_rows=64, block_k=64, num_warps=4, num_stages=2),
    (128, 16, 128): BlockConfig(block_rows=128, block_k=32, num_warps=8, num_stages=2),
    (128, 32, 1): BlockConfig(block_rows=16, block_k=64, num_warps=4, num_stages=2),
    (128, 32, 16): BlockConfig(block_rows=64, block_k=64, num_warps=4, num_stages=2),
    (128, 32, 128): BlockConfig(block_rows=128, block_k=32, num_warps=8, num_stages=2),
    (256, 16, 1): BlockConfig(block_rows=16, block_k=32, num_warps=4, num_stages=2),
    (256, 16, 16): BlockConfig(block_rows=32, block_k=32, num_warps=8, num_stages=2),
    (256, 16, 128): BlockConfig(block_rows=64, block_k=32, num_warps=8, num_stages=2),
}


def q_len_bucket(q_len: int) -> int:
    """The smallest bucket holding ``q_len`` query tokens (the largest bucket past the end)."""
    for bucket in _Q_LEN_BUCKETS:
        if q_len <= bucket:
            return bucket
    return _Q_LEN_BUCKETS[-1]


def lookup(head_dim: int, page_size: int, q_len: int) -> BlockConfig:
    """The tuned config for this shape, or ``DEFAULT`` when the table has no entry."""
    return TUNING.get((head_dim, page_size, q_len_bucket(q_len)), DEFAULT)
