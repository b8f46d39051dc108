"""Penalties, logit bias, min-p and logprobs in the on-device sampler, against numpy references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.request import PENALTY_WINDOW, SamplingParams
from jax_llm_runtime.runtime.engine.sampler import BIAS_SLOTS, empty_sampling_metadata, sample

VOCAB = 64


def logits_for(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, VOCAB)).astype(np.float32) * 3


def reference_penalties(logits, history, num_output, presence, frequency, repetition):
    """numpy: repetition over all of ``history``, presence/frequency over its last num_output."""
    out = logits.astype(np.float64).copy()
    seen = set(history)
    counts = np.bincount(history[len(history) - num_output :], minlength=VOCAB)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    return out - frequency * counts - presence * (counts > 0)


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_penalties_and_logprobs_match_numpy_per_row():
    logits = logits_for(4)
    m = empty_sampling_metadata(4)
    histories = [[3, 5, 5, 7], [1, 2, 3], [9, 9, 9, 9, 10], []]
    settings = [(0.5, 0.3, 1.3, 2), (0.0, 0.0, 1.0, 0), (-1.0, 1.5, 0.8, 5), (0.7, 0.7, 2.0, 0)]
    for row, (hist, (pres, freq, rep, n_out)) in enumerate(zip(histories, settings, strict=True)):
        if hist:
            m.history[row, PENALTY_WINDOW - len(hist) :] = hist
        m.num_output_in_history[row] = n_out
        m.presence_penalty[row], m.frequency_penalty[row], m.repetition_penalty[row] = (
            pres,
            freq,
            rep,
        )
    m.wants_logprobs[:] = True
    out = sample(jnp.asarray(logits), m)
    top_ids, top_values = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    for row, (hist, (pres, freq, rep, n_out)) in enumerate(zip(histories, settings, strict=True)):
        processed = reference_penalties(logits[row], np.asarray(hist, int), n_out, pres, freq, rep)
        assert int(out.token_ids[row]) == int(np.argmax(processed))  # greedy on processed logits
        ref = log_softmax(processed)
        np.testing.assert_allclose(float(out.logprobs[row]), ref.max(), atol=1e-4)
        order = np.argsort(-ref)[: top_ids.shape[1]]
        np.testing.assert_array_equal(top_ids[row], order)
        np.testing.assert_allclose(top_values[row], ref[order], atol=1e-4)


def test_logit_bias_bans_and_boosts_per_row():
    logits = logits_for(3, seed=1)
    m = empty_sampling_metadata(3)
    best = np.argmax(logits, -1)
    m.bias_ids[0, 0], m.bias_values[0, 0] = best[0], -np.inf  # the -100 ban
    m.bias_ids[1, 0], m.bias_values[1, 0] = 7, 100.0
    out = np.asarray(sample(jnp.asarray(logits), m).token_ids)
    assert out[0] != best[0] and out[0] == np.argsort(-logits[0])[1]
    assert out[1] == 7
    assert out[2] == best[2]  # no bias: untouched
    assert m.bias_ids.shape == (3, BIAS_SLOTS)


def test_banned_token_is_never_sampled_at_any_temperature():
    logits = np.zeros((512, VOCAB), np.float32)
    m = empty_sampling_metadata(512)
    m.temperature[:], m.seeds[:] = 1.0, np.arange(512)
    m.bias_ids[:, : VOCAB - 2] = np.arange(VOCAB - 2)
    m.bias_values[:, : VOCAB - 2] = -np.inf
    out = np.asarray(sample(jnp.asarray(logits), m).token_ids)
    assert set(out) == {VOCAB - 2, VOCAB - 1}


def test_min_p_drops_unlikely_tokens():
    # probabilities 0.5, 0.3, 0.2: min_p 0.5 keeps tokens with p >= 0.25.
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 512, jnp.float32))
    m = empty_sampling_metadata(512)
    m.temperature[:], m.seeds[:], m.min_p[:] = 1.0, np.arange(512), 0.5
    out = np.asarray(sample(logits, m).token_ids)
    assert set(out) == {0, 1}


def test_a_row_does_not_depend_on_its_neighbours():
    logits = logits_for(4, seed=3)
    alone = empty_sampling_metadata(1)
    alone.temperature[0], alone.seeds[0], alone.presence_penalty[0] = 0.9, 11, 1.0
    alone.history[0, -3:] = [4, 5, 6]
    alone.num_output_in_history[0] = 3
    alone.wants_logprobs[0] = True
    mixed = empty_sampling_metadata(4)
    for name in ("temperature", "seeds", "presence_penalty", "num_output_in_history"):
        getattr(mixed, name)[2] = getattr(alone, name)[0]
    mixed.history[2] = alone.history[0]
    mixed.wants_logprobs[2] = True
    mixed.temperature[1], mixed.repetition_penalty[1], mixed.min_p[3] = 1.5, 1.7, 0.2
    mixed.history[1, -2:] = [1, 2]
    mixed.bias_ids[0, 0], mixed.bias_values[0, 0] = 3, -np.inf
    solo = sample(jnp.asarray(logits[2:3]), alone)
    batch = sample(jnp.asarray(logits), mixed)
    assert int(solo.token_ids[0]) == int(batch.token_ids[2])
    np.testing.assert_allclose(float(solo.logprobs[0]), float(batch.logprobs[2]), atol=1e-6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repeat_last_n", PENALTY_WINDOW + 1),
        ("min_p", 1.5),
        ("min_tokens", 100),
        ("logprobs", 21),
        ("logit_bias", ((5, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
    ],
)
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})
