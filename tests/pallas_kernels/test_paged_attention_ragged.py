"""Ragged paged attention: a flat run of query rows mixing decode tokens and prefill chunks.

The ragged reference is checked against the padded reference run on each sequence alone, and
the native kernel against the ragged reference (its numerics tests skip without a C++
compiler). The sequences come from ``make_case``: a
shuffled page table, a NaN-filled cache (unused pages, the tail of each last partial page, the
other layer), so a leak shows up as NaN or as a difference from the run on a zero-filled cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.paged_attention import (
    native,
    ops,
    ragged_attention,
    reference,
    to_stored,
)
from tests.pallas_kernels.test_paged_attention_fp8 import fp8_case
from tests.pallas_kernels.test_paged_attention_kernel import (
    HEAD_DIM,
    LAYER,
    Case,
    assert_matches,
    make_case,
)

# (q_len, kv_len) per sequence: decode rows, a first chunk of 7, a sequence with no rows this
# step, and a chunk of 5 at positions 8..12, after two cached pages of 4.
MIXED = ((1, 9), (7, 7), (1, 1), (0, 0), (1, 14), (5, 13), (1, 6))
PADDING = 3  # rows past the last sequence's


@dataclasses.dataclass(frozen=True)
class RaggedCase:
    padded: Case  # the same sequences padded: sequence s's rows are padded.q[s, :q_lens[s]]
    q: jax.Array  # [num_tokens, num_heads, head_dim]
    positions: jax.Array  # [num_tokens] int32
    q_starts: jax.Array  # [num_seqs + 1] int32

    def args(self, layer=LAYER, k_cache=None, v_cache=None) -> tuple:
        c = self.padded
        return (
            self.q,
            c.k_cache if k_cache is None else k_cache,
            c.v_cache if v_cache is None else v_cache,
            jnp.int32(layer),
            self.positions,
            self.q_starts,
            c.page_indices,
            c.kv_lens,
        )

    def seen(self, window: int | None = None) -> np.ndarray:  # [num_tokens] bool
        """Rows that see at least one key (padding rows see none)."""
        padded, starts = self.padded.seen(window), np.asarray(self.q_starts)
        rows = [padded[s, : starts[s + 1] - starts[s]] for s in range(len(starts) - 1)]
        out = np.zeros(self.q.shape[0], bool)
        out[: starts[-1]] = np.concatenate(rows)
        return out


def ragged(case: Case, q_lens: list[int], padding: int = PADDING) -> RaggedCase:
    """``case``'s first ``q_lens[s]`` rows of each sequence in one flat run, then ``padding``
    rows of random queries at an absurd position (they must still return zeros)."""
    q = np.asarray(case.q.astype(jnp.float32))
    rows = [q[s, :n] for s, n in enumerate(q_lens)]
    pad_q = np.random.default_rng(7).standard_normal((padding, *q.shape[2:]))
    positions = [np.asarray(case.positions)[s, :n] for s, n in enumerate(q_lens)]
    return RaggedCase(
        padded=case,
        q=jnp.asarray(np.concatenate([*rows, pad_q]), case.q.dtype),
        positions=jnp.asarray(np.concatenate([*positions, np.full(padding, 10**6)]), jnp.int32),
        q_starts=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )


def mixed_case(num_heads: int, num_kv_heads: int, seqs=MIXED, **kwargs) -> RaggedCase:
    q_lens, kv_lens = (list(x) for x in zip(*seqs, strict=True))
    return ragged(
        make_case(q_lens, kv_lens, max(q_lens), num_heads, num_kv_heads, **kwargs), q_lens
    )


def per_sequence(args: tuple, **kwargs) -> np.ndarray:  # [num_tokens, num_heads, head_dim]
    """The padded reference run on each sequence's rows alone (zeros on padding rows)."""
    q, k, v, layer, positions, q_starts, pages, lens = args
    starts = np.asarray(q_starts)
    out = np.zeros(q.shape, np.float32)
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        if a < b:
            one = reference.paged_attention(
                q[None, a:b], k, v, layer, positions[None, a:b], pages[s : s + 1],
                lens[s : s + 1], **kwargs,
            )  # fmt: skip
            out[a:b] = np.asarray(one[0], np.float32)
    return out


def zeroed(args: tuple) -> tuple:
    """``args`` with every NaN of the caches (unused slots) replaced by zero."""
    return (args[0], jnp.nan_to_num(args[1]), jnp.nan_to_num(args[2]), *args[3:])


run_reference = jax.jit(
    reference.ragged_paged_attention, static_argnames=("scale", "sliding_window", "soft_cap")
)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,window,soft_cap",
    [(2, 2, None, None), (8, 2, 5, None), (9, 3, None, 30.0), (8, 2, 4, 3.0), (4, 1, 6, None)],
)
def test_reference_matches_the_padded_reference_per_sequence(
    num_heads, num_kv_heads, window, soft_cap
):
    rc = mixed_case(num_heads, num_kv_heads)
    kwargs = dict(scale=HEAD_DIM**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = run_reference(*rc.args(), **kwargs)
    assert out.shape == rc.q.shape
    seen = rc.seen(window)
    assert not seen[-PADDING:].any() and seen[:-PADDING].all()
    assert_matches(out, per_sequence(rc.args(), **kwargs), seen)
    # NaN in unused slots must change nothing, bit for bit.
    same = run_reference(*zeroed(rc.args()), **kwargs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_traced_window_matches_the_static_one():
    rc = mixed_case(8, 2)
    f = jax.jit(
        lambda window, *a: reference.ragged_paged_attention(*a, scale=0.25, sliding_window=window)
    )
    for window in (3, 1 << 30):
        out = f(jnp.int32(window), *rc.args())
        expected = run_reference(*rc.args(), scale=0.25, sliding_window=window)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    assert_matches(out, per_sequence(rc.args(), scale=0.25), rc.seen())


def test_fp8_cache_with_row_scales():
    q_lens, kv_lens = (list(x) for x in zip(*MIXED, strict=True))
    fc = fp8_case(q_lens, kv_lens, max(q_lens), 8, 2)
    rc = ragged(fc.case, q_lens)
    kwargs = dict(scale=0.25, sliding_window=5, soft_cap=3.0)
    out = run_reference(*rc.args(), **kwargs, **fc.scales())
    assert_matches(out, per_sequence(rc.args(), **kwargs, **fc.scales()), rc.seen(5))
    zero_scales = {k: jnp.nan_to_num(v) for k, v in fc.scales().items()}
    same = run_reference(*zeroed(rc.args()), **kwargs, **zero_scales)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_bfloat16_cache_in_integer_storage():
    rc = mixed_case(8, 2)
    k, v = (to_stored(c, jnp.uint16) for c in (rc.padded.k_cache, rc.padded.v_cache))
    kwargs = dict(scale=0.25, sliding_window=6)
    out = run_reference(*rc.args(k_cache=k, v_cache=v), **kwargs)
    bf16 = rc.args(k_cache=k.view(jnp.bfloat16), v_cache=v.view(jnp.bfloat16))
    assert_matches(out, per_sequence(bf16, **kwargs), rc.seen(6))


def test_one_compiled_shape_serves_every_layout():
    """Decode-only, mixed, and one long chunk: same num_tokens and num_seqs, one trace."""
    traces = []

    def attend(*args):
        traces.append(1)
        return reference.ragged_paged_attention(*args, scale=0.25, sliding_window=4)

    f = jax.jit(attend)
    case = make_case([1, 7, 1, 0, 1, 5, 1], [9, 7, 1, 0, 14, 13, 6], 14, 4, 2)
    num_tokens = 16 + PADDING
    for q_lens in ([1, 7, 1, 0, 1, 5, 1], [1, 1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 14, 0, 0]):
        rc = ragged(case, q_lens, padding=num_tokens - sum(q_lens))
        out = f(*rc.args())
        assert_matches(out, per_sequence(rc.args(), scale=0.25, sliding_window=4), rc.seen(4))
    assert len(traces) == 1


def test_rejects_bad_shapes():
    rc = mixed_case(4, 2)
    args = rc.args()
    with pytest.raises(ValueError, match=r"q must be \[num_tokens"):
        reference.ragged_paged_attention(args[0][None], *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        reference.ragged_paged_attention(args[0][:, :3], *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="positions must be"):
        reference.ragged_paged_attention(*args[:4], args[4][:-1], *args[5:], scale=1.0)
    with pytest.raises(ValueError, match=r"q_starts \[num_seqs \+ 1\]"):
        reference.ragged_paged_attention(*args[:5], args[5][:-1], *args[6:], scale=1.0)


# The native kernel against the ragged reference.

needs_kernel = pytest.mark.skipif(
    not native.available(), reason="the native kernel could not be built here (no C++ compiler?)"
)
KERNEL_CASES = [
    (2, 2, None, None),
    (8, 2, 5, None),
    (9, 3, None, 30.0),
    (8, 2, 4, 3.0),
    (4, 1, 6, None),
]


def run_native(args: tuple, **kwargs) -> jax.Array:
    return jax.jit(lambda *a: native.ragged_paged_attention(*a, **kwargs))(*args)


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,window,soft_cap", KERNEL_CASES)
def test_native_matches_the_reference(num_heads, num_kv_heads, window, soft_cap):
    rc = mixed_case(num_heads, num_kv_heads)
    kwargs = dict(scale=HEAD_DIM**-0.5, sliding_window=window, soft_cap=soft_cap)
    # query_block=3 cuts the chunks into blocks whose tokens see different key ranges.
    out = run_native(rc.args(), query_block=3, **kwargs)
    assert_matches(out, run_reference(*rc.args(), **kwargs), rc.seen(window))
    # NaN in unused slots must change nothing, bit for bit.
    same = run_native(zeroed(rc.args()), query_block=3, **kwargs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


@needs_kernel
@pytest.mark.parametrize(
    "head_dim,page_size,dtype,tol",
    [
        (64, 16, jnp.float32, 1e-5),  # the unrolled head sizes
        (128, 8, jnp.float32, 1e-5),
        (24, 3, jnp.float32, 1e-5),  # rows padded to whole vectors, pages of 3
        (64, 16, jnp.uint16, 2e-2),  # bfloat16 in integer storage
        (32, 4, jnp.float16, 2e-3),
    ],
)
def test_native_head_sizes_page_sizes_and_dtypes(head_dim, page_size, dtype, tol):
    # 40 keys span several key blocks: the online softmax rescales across them.
    seqs = ((1, 40), (5, 19), (1, 3), (9, 30))
    rc = mixed_case(8, 2, seqs, head_dim=head_dim, page_size=page_size)
    k, v = rc.padded.k_cache, rc.padded.v_cache
    k, v = (to_stored(c, dtype) if dtype == jnp.uint16 else c.astype(dtype) for c in (k, v))
    kwargs = dict(scale=head_dim**-0.5, sliding_window=23)
    out = np.asarray(run_native(rc.args(k_cache=k, v_cache=v), **kwargs), np.float32)
    ref = np.asarray(run_reference(*rc.args(k_cache=k, v_cache=v), **kwargs), np.float32)
    seen = rc.seen(23)
    assert np.isfinite(out).all() and not out[~seen].any()
    np.testing.assert_allclose(out[seen], ref[seen], rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("stored", [False, True], ids=["float8", "uint8-storage"])
def test_native_fp8_cache_with_row_scales(stored):
    q_lens, kv_lens = (list(x) for x in zip(*MIXED, strict=True))
    fc = fp8_case(q_lens, kv_lens, max(q_lens), 8, 2)
    rc = ragged(fc.case, q_lens)
    k, v = rc.padded.k_cache, rc.padded.v_cache
    if stored:
        k, v = k.view(jnp.uint8), v.view(jnp.uint8)
    kwargs = dict(scale=0.25, sliding_window=5, soft_cap=3.0)
    out = run_native(rc.args(k_cache=k, v_cache=v), **kwargs, **fc.scales())
    assert_matches(out, run_reference(*rc.args(), **kwargs, **fc.scales()), rc.seen(5))
    zero_scales = {k: jnp.nan_to_num(v) for k, v in fc.scales().items()}
    zero_args = rc.args(
        k_cache=jnp.nan_to_num(rc.padded.k_cache), v_cache=jnp.nan_to_num(rc.padded.v_cache)
    )
    same = run_native(zero_args, **kwargs, **zero_scales)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


@needs_kernel
def test_native_traced_window_and_one_compiled_shape():
    traces = []

    def attend(window, *args):
        traces.append(1)
        return native.ragged_paged_attention(*args, scale=0.25, sliding_window=window)

    f = jax.jit(attend)
    case = make_case([1, 7, 1, 0, 1, 5, 1], [9, 7, 1, 0, 14, 13, 6], 14, 4, 2)
    num_tokens = 16 + PADDING
    for q_lens in ([1, 7, 1, 0, 1, 5, 1], [1, 1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 14, 0, 0]):
        rc = ragged(case, q_lens, padding=num_tokens - sum(q_lens))
        for window in (3, 1 << 30):
            out = f(jnp.int32(window), *rc.args())
            expected = run_reference(*rc.args(), scale=0.25, sliding_window=window)
            assert_matches(out, expected, rc.seen(window))
    assert len(traces) == 1


@needs_kernel
def test_native_on_the_thread_pool_with_a_long_chunk():
    # 24 decoding sequences and a chunk of 120 rows: far past the size a call runs on its calling
    # thread alone, and a chunk many query blocks long beside single rows.
    rng = np.random.default_rng(3)
    seqs = [(1, int(n)) for n in rng.integers(1, 200, 24)] + [(120, 150), (1, 64)]
    rc = mixed_case(8, 2, seqs, page_size=16, head_dim=32)
    kwargs = dict(scale=32**-0.5, soft_cap=20.0, sliding_window=100)
    out = run_native(rc.args(), **kwargs)
    assert_matches(out, run_reference(*rc.args(), **kwargs), rc.seen(100))


@needs_kernel
def test_native_keeps_q_starts_inside_the_rows():
    # Offsets past the rows or decreasing: clamped, so nothing is read or written out of bounds.
    rc = mixed_case(4, 2)
    num_tokens = rc.q.shape[0]
    bad = jnp.asarray([2, 1, 9, 9, 5, 40, 41, 50], jnp.int32)
    clamped = jnp.asarray([2, 2, 9, 9, 9, num_tokens, num_tokens, num_tokens], jnp.int32)
    args, fixed = list(rc.args()), list(rc.args())
    args[5], fixed[5] = bad, clamped
    out = np.asarray(run_native(tuple(args), scale=0.25))
    assert np.isfinite(out).all() and not out[:2].any()
    np.testing.assert_array_equal(out, np.asarray(run_native(tuple(fixed), scale=0.25)))
    assert_matches(out, run_reference(*fixed, scale=0.25), np.abs(out).sum((1, 2)) > 0)


@needs_kernel
def test_entry_point_runs_the_native_kernel():
    rc = mixed_case(8, 2)
    out = ragged_attention(*rc.args(), scale=0.25, k_scale=0.5, v_scale=2.0, impl="native")
    expected = native.ragged_paged_attention(*rc.args(), scale=0.125) * 2.0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    lowered = jax.jit(lambda *a: ragged_attention(*a, scale=0.25, impl="native")).lower(*rc.args())
    assert "runtime_ragged_paged_attention_" in lowered.as_text()


def test_entry_point_choice(monkeypatch):
    rc = mixed_case(8, 2)
    q, k, v = rc.args()[:3]
    # The Pallas kernel of the ragged layout is TPU's (interpreted here): test_paged_attention_tpu.
    assert ops.ragged_implementation("pallas", q, k, v, 7) == "pallas"
    assert ops.ragged_implementation("reference", q, k, v, 7) == "reference"
    # The measured rule: at most one row per sequence is "decode", more is "prefill".
    verdicts = {("paged_attention", "decode"): True, ("paged_attention", "prefill"): False}
    monkeypatch.setattr(cpu_choice, "_verdicts", verdicts)
    expected = "native" if native.available() else "reference"
    assert ops.ragged_implementation("auto", q[:7], k, v, 7, native_ok=True) == expected
    assert ops.ragged_implementation("auto", q, k, v, 7, native_ok=True) == "reference"
    assert ops.ragged_implementation("auto", q[:7], k, v, 7) == "reference"


def test_entry_point_falls_back_to_the_reference(monkeypatch):
    rc = mixed_case(4, 2)
    ref = np.asarray(reference.ragged_paged_attention(*rc.args(), scale=0.25))
    monkeypatch.setattr(native, "_target", lambda: None)
    monkeypatch.setattr(native, "_ragged_target", lambda: None)
    assert not native.available()
    out = ragged_attention(*rc.args(), scale=0.25, impl="native")
    np.testing.assert_array_equal(np.asarray(out), ref)
    with pytest.raises(RuntimeError, match="unavailable"):
        native.ragged_paged_attention(*rc.args(), scale=0.25)


def test_native_rejects_bad_arguments():
    args = mixed_case(4, 2).args()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        native.ragged_paged_attention(args[0][:, :3], *args[1:], scale=1.0)
    with pytest.raises(ValueError, match=r"q_starts \[num_seqs \+ 1\]"):
        native.ragged_paged_attention(*args[:5], args[5][:-1], *args[6:], scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        native.ragged_paged_attention(*args, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap must be > 0"):
        native.ragged_paged_attention(*args, scale=1.0, soft_cap=0.0)
    with pytest.raises(ValueError, match="native kernel reads caches of"):
        native.ragged_paged_attention(*args[:2], args[2].astype(jnp.bfloat16), *args[3:], scale=1.0)
