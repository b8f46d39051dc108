"""The Pallas paged-attention kernel against the pure-jnp reference, in interpret mode on CPU.

Every case shuffles the page table and fills every slot the sequences do not own with NaN (unused
pages, the tail of each last partial page, the other layer), so a leak shows up as NaN or as a
difference from the run on a zero-filled cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import attention, kernel, reference, tuning

TOL = 1e-5
HEAD_DIM, PAGE_SIZE, LAYER = 16, 4, 1


@dataclasses.dataclass(frozen=True)
class Case:
    q: jax.Array  # [num_seqs, q_len, num_heads, head_dim]
    k_cache: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    positions: jax.Array  # [num_seqs, q_len] int32
    page_indices: jax.Array  # [num_seqs, pages_per_seq] int32
    kv_lens: jax.Array  # [num_seqs] int32

    def args(self, layer=LAYER, k_cache=None, v_cache=None) -> tuple:
        return (
            self.q,
            self.k_cache if k_cache is None else k_cache,
            self.v_cache if v_cache is None else v_cache,
            jnp.int32(layer),
            self.positions,
            self.page_indices,
            self.kv_lens,
        )

    def seen(self, window: int | None = None) -> np.ndarray:  # [num_seqs, q_len] bool
        """Rows that see at least one key; the others are padding, defined only to be finite."""
        t = np.arange(self.page_indices.shape[1] * self.k_cache.shape[2])
        pos = np.asarray(self.positions)[:, :, None]
        visible = (t < np.asarray(self.kv_lens)[:, None, None]) & (t <= pos)
        if window is not None:
            visible &= t > pos - window
        return visible.any(-1)


def make_case(
    q_lens: list[int],
    kv_lens: list[int],
    q_len: int,
    num_heads: int,
    num_kv_heads: int,
    *,
    page_size: int = PAGE_SIZE,
    head_dim: int = HEAD_DIM,
    layers: tuple[int, ...] = (LAYER,),
    dtype=jnp.float32,
    seed: int = 0,
) -> Case:
    """Random sequences written through a shuffled page table into a NaN-filled cache."""
    rng = np.random.default_rng(seed)
    num_seqs = len(kv_lens)
    pages_per_seq = -(-max(*kv_lens, 1) // page_size) + 1  # one spare, never-used page each
    num_pages = num_seqs * pages_per_seq + 3
    page_indices = rng.permutation(num_pages)[: num_seqs * pages_per_seq]
    page_indices = page_indices.reshape(num_seqs, pages_per_seq).astype(np.int32)
    shape = (2, num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    for layer in layers:
        for s, n in enumerate(kv_lens):
            t = np.arange(n)
            page, offset = page_indices[s, t // page_size], t % page_size
            k_cache[layer, page, offset] = rng.standard_normal((n, num_kv_heads, head_dim))
            v_cache[layer, page, offset] = rng.standard_normal((n, num_kv_heads, head_dim))
    # Padding query rows sit past each sequence's real tokens, as the runtime lays them out.
    positions = np.stack(
        [kv - ql + np.arange(q_len) for kv, ql in zip(kv_lens, q_lens, strict=True)]
    )
    q = rng.standard_normal((num_seqs, q_len, num_heads, head_dim))
    return Case(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype),
        positions=jnp.asarray(positions, jnp.int32),
        page_indices=jnp.asarray(page_indices),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
    )


def run_kernel(case: Case, **kwargs) -> jax.Array:
    """The kernel, jitted, in interpret mode (this is the CPU suite)."""
    return jax.jit(lambda *a: kernel.paged_attention(*a, interpret=True, **kwargs))(*case.args())


def assert_matches(out, ref, seen) -> None:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "NaN-filled pages or padding rows leaked into the output"
    np.testing.assert_allclose(out[seen], ref[seen], rtol=TOL, atol=TOL)
    assert not out[~seen].any(), "a row that sees no key must return zeros"


# (q_lens, kv_lens, q_len): decode, and prefill chunks of 7 and 16 with a padding sequence (0, 0).
DECODE = ([1, 1, 1], [9, 1, 14], 1)
CHUNK_7 = ([7, 3, 0, 5], [7, 9, 0, 13], 7)
CHUNK_16 = ([16, 0, 11], [21, 0, 11], 16)


@pytest.mark.parametrize(
    "shape,num_heads,num_kv_heads,window,soft_cap",
    [
        (DECODE, 2, 2, None, None),
        (DECODE, 8, 2, 5, None),
        (CHUNK_7, 4, 2, None, None),
        (CHUNK_7, 8, 2, 4, 3.0),
        (CHUNK_16, 4, 1, None, 3.0),
        (CHUNK_16, 2, 1, 6, None),
    ],
)
def test_matches_reference(shape, num_heads, num_kv_heads, window, soft_cap):
    q_lens, kv_lens, q_len = shape
    case = make_case(q_lens, kv_lens, q_len, num_heads, num_kv_heads)
    kwargs = dict(scale=HEAD_DIM**-0.5, sliding_window=window, soft_cap=soft_cap)
    # block_k=16 keeps several key blocks per sequence: the online softmax and the skipping run.
    f = jax.jit(lambda *a: kernel.paged_attention(*a, block_k=16, interpret=True, **kwargs))
    out = f(*case.args())
    ref = reference.paged_attention(*case.args(), **kwargs)
    assert_matches(out, ref, case.seen(window))
    # NaN in unused slots must change nothing, bit for bit.
    zeroed = f(
        *case.args(k_cache=jnp.nan_to_num(case.k_cache), v_cache=jnp.nan_to_num(case.v_cache))
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(zeroed))


def test_window_skips_whole_blocks_at_the_boundary():
    # Decode at every residue of the window start modulo block_k: one lands exactly on a block edge.
    kv_lens = list(range(14, 22))
    case = make_case([1] * len(kv_lens), kv_lens, 1, 2, 1)
    out = run_kernel(case, scale=0.25, sliding_window=5, block_k=16)
    ref = reference.paged_attention(*case.args(), scale=0.25, sliding_window=5)
    assert_matches(out, ref, case.seen(5))


def test_kv_lens_past_the_page_table_see_only_the_table():
    case = make_case(*DECODE, 4, 2)
    # Every slot of the table now counts as written, so the NaN filler must go.
    case = dataclasses.replace(
        case,
        k_cache=jnp.nan_to_num(case.k_cache),
        v_cache=jnp.nan_to_num(case.v_cache),
        kv_lens=jnp.full_like(case.kv_lens, 1000),
        positions=jnp.full_like(case.positions, 999),
    )
    out = run_kernel(case, scale=0.25)
    assert_matches(out, reference.paged_attention(*case.args(), scale=0.25), case.seen())


def test_page_size_8_and_head_dim_32():
    case = make_case(*CHUNK_7[:2], 7, 4, 2, page_size=8, head_dim=32)
    out = run_kernel(case, scale=0.2)
    assert_matches(out, reference.paged_attention(*case.args(), scale=0.2), case.seen())


def test_traced_sliding_window():
    case = make_case(*CHUNK_7, 4, 2)
    f = jax.jit(
        lambda window, *a: kernel.paged_attention(
            *a, scale=0.25, sliding_window=window, interpret=True
        )
    )
    for window in (2, 5):
        out = f(jnp.int32(window), *case.args())
        ref = reference.paged_attention(*case.args(), scale=0.25, sliding_window=window)
        assert_matches(out, ref, case.seen(window))


@pytest.mark.parametrize("window", [None, 5])
def test_split_k_equals_no_split(window):
    case = make_case([1, 3], [37, 30], 3, 4, 2)
    kwargs = dict(scale=0.25, sliding_window=window)
    single = run_kernel(case, **kwargs)
    split = run_kernel(case, num_splits=3, block_k=16, **kwargs)
    seen = case.seen(window)
    np.testing.assert_allclose(np.asarray(split)[seen], np.asarray(single)[seen], TOL, TOL)
    assert_matches(split, reference.paged_attention(*case.args(), **kwargs), seen)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_cache_matches_reference_on_dequantized_cache(dtype):
    case = make_case(*CHUNK_7, 4, 2)
    case = dataclasses.replace(
        case, k_cache=case.k_cache.astype(dtype), v_cache=case.v_cache.astype(dtype)
    )
    k_scale, v_scale = 0.5, 2.0
    out = run_kernel(case, scale=0.25, k_scale=k_scale, v_scale=v_scale)
    k = case.k_cache.astype(jnp.float32) * k_scale
    v = case.v_cache.astype(jnp.float32) * v_scale
    ref = reference.paged_attention(*case.args(k_cache=k, v_cache=v), scale=0.25)
    assert_matches(out, ref, case.seen())


def test_traced_layer_inside_scan():
    case = make_case(*CHUNK_7, 4, 2, layers=(0, 1))

    @jax.jit
    def run(q, k_cache, v_cache, positions, page_indices, kv_lens):
        def body(x, layer):
            out = kernel.paged_attention(
                x, k_cache, v_cache, layer, positions, page_indices, kv_lens,
                scale=0.25, interpret=True,
            )  # fmt: skip
            return x, out

        return jax.lax.scan(body, q, jnp.arange(2, dtype=jnp.int32))[1]

    outs = run(case.q, case.k_cache, case.v_cache, case.positions, case.page_indices, case.kv_lens)
    for layer in range(2):
        ref = reference.paged_attention(*case.args(layer=layer), scale=0.25)
        assert_matches(outs[layer], ref, case.seen())


def test_attention_entry_point_on_cpu():
    case = make_case(*DECODE, 4, 2)
    ref = reference.paged_attention(*case.args(), scale=0.25)
    np.testing.assert_array_equal(np.asarray(attention(*case.args(), scale=0.25)), ref)
    np.testing.assert_array_equal(
        np.asarray(attention(*case.args(), scale=0.25, impl="reference")), ref
    )
    assert_matches(attention(*case.args(), scale=0.25, impl="pallas"), ref, case.seen())
    scaled = attention(*case.args(), scale=0.25, k_scale=0.5, v_scale=2.0)
    np.testing.assert_allclose(
        scaled, 2.0 * reference.paged_attention(*case.args(), scale=0.125), TOL, TOL
    )
    with pytest.raises(ValueError, match="impl must be one of"):
        attention(*case.args(), scale=0.25, impl="triton")


def test_rejects_bad_arguments():
    case = make_case(*DECODE, 4, 2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernel.paged_attention(case.q[:, :, :3], *case.args()[1:], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        kernel.paged_attention(*case.args(), scale=1.0, sliding_window=0, interpret=True)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        kernel.paged_attention(*case.args(), scale=1.0, num_splits=0, interpret=True)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        kernel.paged_attention(*case.args(), scale=1.0, block_k=24, interpret=True)
    odd = make_case(*DECODE, 4, 2, head_dim=24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        kernel.paged_attention(*odd.args(), scale=1.0, interpret=False)
    with pytest.raises(ValueError, match="k_cache and v_cache must share"):
        kernel.paged_attention(
            *case.args(v_cache=case.v_cache.astype(jnp.bfloat16)), scale=1.0, interpret=True
        )


def test_tuning_table_lookup():
    assert tuning.lookup(128, 16, 1) == tuning.TUNING[(128, 16, 1)]
    assert tuning.lookup(128, 16, 7) == tuning.TUNING[(128, 16, 16)]
    assert tuning.lookup(128, 16, 4096) == tuning.TUNING[(128, 16, 128)]
    assert tuning.lookup(48, 3, 1) == tuning.DEFAULT
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        tuning.BlockConfig(block_rows=8, block_k=16)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU to compile the kernel")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernel_on_gpu(dtype):
    case = make_case(*CHUNK_16, 8, 2, head_dim=64, page_size=16, dtype=dtype)
    for window, num_splits in ((None, 1), (9, 2)):
        kwargs = dict(scale=0.125, sliding_window=window, soft_cap=30.0)
        out = jax.jit(
            lambda *a, kw=kwargs, n=num_splits: kernel.paged_attention(*a, num_splits=n, **kw)
        )(*case.args())
        # The kernel multiplies float32 in IEEE precision; XLA's GPU dots default to TF32.
        with jax.default_matmul_precision("highest"):
            ref = reference.paged_attention(*case.args(), **kwargs)
        tol = TOL if dtype == jnp.float32 else 2e-2
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert np.isfinite(out).all()
        seen = case.seen(window)
        np.testing.assert_allclose(out[seen], ref[seen], rtol=tol, atol=tol)


def test_auto_splits_fill_the_grid_for_few_sequences_and_none_for_many():
    # Llama-3-8B's heads (32 over 8 KV heads of 128), 1,024 positions in 16-token pages.
    cache = (1, 4096, 16, 8, 128)
    assert kernel.auto_splits((1, 1, 32, 128), cache, 64) == 16  # every 64-key block its own
    assert kernel.auto_splits((16, 1, 32, 128), cache, 64) == 4
    assert kernel.auto_splits((64, 1, 32, 128), cache, 64) == 1
    assert kernel.auto_splits((1, 1, 32, 128), cache, 2) == 1  # a 32-key context: one block


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_auto_splits_and_16_bit_dots_match_the_reference(dtype):
    # A decode of two sequences, the splits the compiled kernel would take, interpreted; the
    # bfloat16 case multiplies at 16 bits with float32 accumulation.
    case = make_case([1, 1], [40, 77], 1, 8, 2, head_dim=64, page_size=16, dtype=dtype)
    pages = case.page_indices.shape[1]
    splits = kernel.auto_splits(case.q.shape, case.k_cache.shape, pages, block_k=16)
    assert splits == pages  # 96 keys in blocks of 16
    kwargs = dict(scale=0.125, soft_cap=30.0)
    out = run_kernel(case, num_splits=splits, block_k=16, **kwargs)
    ref = reference.paged_attention(*case.args(), **kwargs)
    tol = TOL if dtype == jnp.float32 else 2e-2
    seen = case.seen(None)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(out[seen], ref[seen], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_for_cuda(monkeypatch, dtype):
    # Lowering for CUDA runs the Pallas Triton lowering here, without a GPU: every primitive of
    # the kernel (the 16-bit dots and the split outputs included) needs a Triton rule. A decode
    # of Llama-3-8B's heads over 1,024 positions, with the splits a compiled call takes.
    from jax import export
    from jax.experimental.pallas import triton as pltriton

    monkeypatch.setattr(
        kernel, "_compiler_params", lambda config, interpret: pltriton.CompilerParams()
    )
    shapes = (
        jax.ShapeDtypeStruct((1, 1, 32, 128), dtype),
        jax.ShapeDtypeStruct((2, 128, 16, 8, 128), dtype),
        jax.ShapeDtypeStruct((2, 128, 16, 8, 128), dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((1, 1), jnp.int32),
        jax.ShapeDtypeStruct((1, 64), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    exported = export.export(
        jax.jit(lambda *a: kernel.paged_attention(*a, scale=0.088)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*shapes)
    assert "xla.gpu.triton" in exported.mlir_module()
