import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.runtime.engine import sampler
from jax_llm_runtime.runtime.engine.sampler import empty_sampling_metadata
from jax_llm_runtime.runtime.engine.sampler import sample as sample_output


def meta(n, temperature=0.0, top_k=0, top_p=1.0, seeds=None, index=0):
    m = empty_sampling_metadata(n)
    m.temperature[:], m.top_k[:], m.top_p[:], m.output_index[:] = temperature, top_k, top_p, index
    m.seeds[:] = seeds if seeds is not None else np.arange(n)
    return m


def sample(logits, m):
    return sample_output(logits, m).token_ids


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
    assert np.array_equal(np.asarray(sample(logits, meta(4))), np.argmax(logits, -1))


@pytest.mark.parametrize("vocab", [50, 384, 1000])
def test_greedy_takes_the_first_largest_whatever_else_the_batch_asks(vocab):
    # Ties at the row's largest value (across and within blocks of 128 columns) and a row of
    # -inf (every token banned); the same tokens come from the lone argmax pass (a plain
    # greedy batch) and from the full processing (a row asking for logprobs).
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1, [vocab // 3, vocab - 1]] = 9.0
    x[2, [vocab - 2, vocab - 1]] = 9.0
    x[3] = -np.inf
    x[4, : vocab // 2] = -np.inf
    expected = np.argmax(x, -1)
    plain = meta(6)
    asking = meta(6)
    asking.wants_logprobs[0] = True
    for m in (plain, asking):
        assert np.array_equal(np.asarray(sample(jnp.asarray(x), m)), expected)


def test_top_k_1_is_greedy_and_top_k_restricts_support():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((64, 30)), jnp.float32)
    out = np.asarray(sample(logits, meta(64, temperature=5.0, top_k=1)))
    assert np.array_equal(out, np.argmax(logits, -1))
    out = np.asarray(sample(logits, meta(64, temperature=5.0, top_k=3)))
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    assert all(o in t for o, t in zip(out, top3, strict=True))


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2: top_p 0.6 keeps the first two, never the third.
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 256, jnp.float32))
    out = np.asarray(sample(logits, meta(256, temperature=1.0, top_p=0.6, seeds=np.arange(256))))
    assert set(out) == {0, 1}


def test_sampling_follows_the_distribution_and_depends_on_seed_and_index_only():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1]] * 4000, jnp.float32))
    out = np.asarray(sample(logits, meta(4000, temperature=1.0, seeds=np.arange(4000))))
    freq = np.bincount(out, minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.03)
    # Same seed and index: same token, whatever the batch neighbours are.
    a = sample(logits[:3], meta(3, temperature=1.0, seeds=[5, 6, 7], index=3))
    b = sample(logits[:2], meta(2, temperature=1.0, seeds=[9, 5], index=3))
    assert int(a[0]) == int(b[1])


def test_mixed_batch_greedy_rows_stay_greedy():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((8, 40)), jnp.float32)
    m = meta(8, temperature=1.0)
    m = m.replace(temperature=jnp.asarray([0, 1, 0, 1, 0, 1, 0, 1], jnp.float32))
    out = np.asarray(sample(logits, m))
    assert np.array_equal(out[::2], np.argmax(logits, -1)[::2])


def filtered_distribution(logits, temperature, top_k, top_p, min_p):
    """The distribution a sort-based sampler draws from (numpy, one row): top-k, then top-p
    over the renormalized top-k, then min-p relative to the most likely token."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    keep = np.ones(len(order), bool)
    if top_k > 0:
        keep &= np.arange(len(order)) < top_k
    kept = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()  # top-p after top-k
    keep &= np.cumsum(kept) - kept < top_p
    keep &= probs >= min_p * probs[0]
    out = np.zeros(len(order))
    out[order[keep]] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 0.8, 0.0),
        (1.3, 4, 1.0, 0.0),
        (1.0, 5, 0.7, 0.0),
        (1.0, 0, 1.0, 0.1),
        (2.0, 6, 0.9, 0.05),
    ],
)
def test_filtered_sampling_matches_the_sorted_reference(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(7)
    row = rng.standard_normal(12).astype(np.float32) * 2
    n = 6000
    m = meta(n, temperature, top_k, top_p, seeds=np.arange(n))
    m.min_p[:] = min_p
    out = np.asarray(sample(jnp.asarray(np.tile(row, (n, 1))), m))
    expected = filtered_distribution(row, temperature, top_k, top_p, min_p)
    assert set(out) <= set(np.flatnonzero(expected))
    np.testing.assert_allclose(np.bincount(out, minlength=12) / n, expected, atol=0.025)


def test_tokens_with_equal_logits_share_their_mass():
    logits = jnp.asarray([[1.0, 2.0, 2.0, 2.0, 0.0]] * 3000, jnp.float32)
    out = np.asarray(sample(logits, meta(3000, temperature=1.0, seeds=np.arange(3000))))
    expected = np.exp([1.0, 2.0, 2.0, 2.0, 0.0])
    expected /= expected.sum()
    np.testing.assert_allclose(np.bincount(out, minlength=5) / 3000, expected, atol=0.03)
    # top_k 2 keeps the three tied top tokens (a threshold keeps ties together).
    out = np.asarray(sample(logits, meta(3000, temperature=1.0, top_k=2, seeds=np.arange(3000))))
    assert set(out) == {1, 2, 3}


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (40, 1.0), (0, 0.9), (0, 0.5), (20, 0.8)])
def test_cuts_read_from_the_largest_weights_equal_the_bisected_cuts(top_k, top_p):
    # Rows of every shape of distribution: peaked ones, whose cut lies among the 64 largest
    # weights, flat ones, where it does not, and rows with runs of equal weights.
    rng = np.random.default_rng(11)
    rows = [rng.standard_normal(4096) * scale for scale in (0.3, 1.0, 3.0, 8.0)]
    rows.append(np.round(rng.standard_normal(4096) * 4) / 2)  # many ties
    logits = jnp.asarray(np.stack(rows), jnp.float32)
    w = jnp.exp(logits - logits.max(-1, keepdims=True))
    n = len(rows)
    k = jnp.full(n, top_k if top_k else 4096, jnp.int32)
    p = jnp.full(n, top_p, jnp.float32)
    zeros = jnp.zeros(n)
    k_cut = sampler._largest(w, zeros, lambda count, mass: count >= k) if top_k else zeros
    target = p * jnp.sum(jnp.where(w >= k_cut[:, None], w, 0.0), -1)
    bisected = sampler._largest(w, k_cut, lambda count, mass: mass >= target)
    for candidates in (64, 1024, 4096):
        cut, found = sampler._cut_from_largest(w, k, p, candidates)
        found = np.asarray(found)
        # The cut is read wherever the candidates hold it, and then is the bisected one.
        kept = np.sum(np.asarray(w) >= np.asarray(bisected)[:, None], -1)
        np.testing.assert_array_equal(found, kept <= candidates)
        np.testing.assert_array_equal(np.asarray(cut)[found], np.asarray(bisected)[found])
    # The whole sampler's cut is the bisected one on every row, read or bisected.
    np.testing.assert_array_equal(np.asarray(sampler._cuts(w, k, p)), np.asarray(bisected))


def test_the_draw_lands_on_kept_tokens_in_proportion_to_their_weight():
    # 300 columns: blocks of 128 and a padded last block; zero weights are never drawn, even
    # when the uniform sits at the very end of the mass.
    kept = np.zeros(300, np.float32)
    kept[[0, 127, 128, 250, 299]] = [1.0, 2.0, 0.5, 0.25, 0.25]
    n = 8000
    r = (np.arange(n) + 0.5) / n
    r[-1] = np.nextafter(np.float32(1.0), np.float32(0.0))
    out = np.asarray(sampler._draw(jnp.asarray(np.tile(kept, (n, 1))), jnp.asarray(r, jnp.float32)))
    assert set(out) <= {0, 127, 128, 250, 299}
    np.testing.assert_allclose(
        np.bincount(out, minlength=300)[kept > 0] / n, kept[kept > 0] / 4, atol=2e-3
    )
