"""A read-only snapshot of the engine's load, for ``/metrics`` and monitoring."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """Counts at one moment; pages are KV cache pages (``num_pages_total - num_pages_free`` used)."""

    num_running: int
    num_waiting: int
    num_pages_total: int
    num_pages_free: int
    num_preemptions: int  # since start, monotonic
    # Prefix cache, since start: prompt tokens looked up, and found cached; free cached pages now.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_pages_cached: int = 0
    # 1 while step shapes still compile in the background after start (requests are served
    # meanwhile, on CPU sharing its cores); replicas are summed.
    num_compiling: int = 0
    # Models with linear-attention layers: state slots held by running sequences, and in all
    # (0 and 0 for other models).
    num_state_slots_used: int = 0
    num_state_slots_total: int = 0

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "num_pages_total", "num_pages_free"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_pages_free > self.num_pages_total:
            raise ValueError(
                f"num_pages_free ({self.num_pages_free}) exceeds num_pages_total "
                f"({self.num_pages_total})"
            )

    @property
    def num_pages_used(self) -> int:
        return self.num_pages_total - self.num_pages_free
