"""The norms give each row the same bits however many rows are normalised together (XLA:CPU's own
mean did not: rows of a batch of 2-4 differed in the last bit from the same rows among 16), and
agree with the textbook formulas."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_llm_runtime.models.layers.norms import NormConfig, apply_norm, row_mean


@pytest.mark.parametrize("kind", ["rms", "rms_one", "layer"])
@pytest.mark.parametrize("width", [576, 960, 2880, 4096, 67])
def test_each_row_is_the_same_in_any_batch(kind: str, width: int) -> None:
    rng = np.random.default_rng(width)
    x = rng.standard_normal((16, width)).astype(np.float32) * 3
    w = rng.standard_normal(width).astype(np.float32)
    norm = jax.jit(lambda h: apply_norm(NormConfig(kind, 1e-5), h, w))
    every = np.asarray(norm(x))
    for rows in (1, 2, 3, 4, 5, 8, 9):
        np.testing.assert_array_equal(np.asarray(norm(x[:rows])), every[:rows])
    # prefill chunks: the same rows inside [1, q_len, hidden]
    np.testing.assert_array_equal(np.asarray(norm(x[None, :7]))[0], every[:7])


@pytest.mark.parametrize("kind", ["rms", "rms_one", "layer"])
def test_norms_match_the_formulas(kind: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 576)).astype(np.float64)
    w = rng.standard_normal(576).astype(np.float64)
    got = np.asarray(apply_norm(NormConfig(kind, 1e-5), x.astype(np.float32), w.astype(np.float32)))
    centred = x - x.mean(-1, keepdims=True) if kind == "layer" else x
    scale = 1.0 + w if kind == "rms_one" else w
    want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_row_mean_of_odd_and_power_of_two_widths() -> None:
    for width in (1, 3, 64, 96, 67):
        x = np.arange(2 * width, dtype=np.float32).reshape(2, width)
        np.testing.assert_allclose(np.asarray(row_mean(x)), x.mean(-1, keepdims=True), rtol=1e-6)
