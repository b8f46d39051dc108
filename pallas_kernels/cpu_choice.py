"""Which implementation each native kernel's call class runs on this CPU: the native kernel or
XLA's formulation, whichever ``pallas_kernels.native.calibration`` measured faster here.

A native kernel is only a speed-up where it beats XLA on the CPU at hand, and CPUs differ (a
kernel that wins on AVX-512 lost 3.6x on an AVX2-only machine). The call classes:

- dequant-matmul: ``one_row`` (single-stream decode: one row of x through a projection),
  ``rows`` (2 to ``NATIVE_MAX_TOKENS`` rows: batched decode), ``large`` (up to
  ``NATIVE_MAX_TOKENS_LARGE`` rows through a matrix too large to stay in cache: the LM head,
  timed against a float32 head's dot, since a head the kernel loses is loaded as float32; a
  large packed projection follows the same verdict, against a dequantizing reference that is
  slower still), and ``large_int8`` (the same head call with int8 activations: under
  ``--matmul-dtype int8`` the head takes one path for every row count, chosen by this one);
- paged attention: ``decode`` (one query token per sequence) and ``prefill`` (a chunk of them).

``("dequant_matmul", "int8")`` is not measured (int8 activations have no faster XLA path); it is
False only where ``--matmul-backend reference`` turns the kernel off.

``native_wins(kernel, call_class)`` is what the ops ask. Until verdicts are set (a library user
who calls the ops without building an engine) it answers True, and the ops' static rules apply
alone.
"""

from __future__ import annotations

import threading

KERNELS = {
    "dequant_matmul": ("one_row", "rows", "large", "large_int8"),
    "paged_attention": ("decode", "prefill"),
}
_verdicts: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def native_wins(kernel: str, call_class: str) -> bool:
    """Whether the native kernel takes ``call_class`` of ``kernel`` on this CPU (True until
    verdicts are set; the ops' own rules still apply)."""
    return _verdicts.get((kernel, call_class), True)


def set_verdicts(verdicts: dict[tuple[str, str], bool]) -> None:
    """Record measured verdicts, ``{(kernel, call_class): native is faster}``."""
    with _lock:
        _verdicts.update(verdicts)


def dequant_class(rows: int, large: bool) -> str:
    """The call class of a dequant-matmul call with ``rows`` rows of x."""
    return "one_row" if rows == 1 else ("large" if large else "rows")


def attention_class(q_len: int) -> str:
    """The call class of a paged-attention call with ``q_len`` query tokens per sequence."""
    return "decode" if q_len == 1 else "prefill"
