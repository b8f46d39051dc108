"""Layers walked by an unrolled loop (``DecoderConfig.unroll_layers``, ``--layer-loop unrolled``):
the same logits as the scanned layers, and a step whose weights are read in place.

On GPU a scanned step copied every layer's slice of each stacked weight before its matmul (a
device trace of a Llama-3-8B-shaped step: 2.3 of its 4.7 ms in copies); unrolled, each layer's
slice is static. The compiled CPU step shows the same structure: no layer loop and no copy of a
weight-sized slice.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from transformers import LlamaConfig

from jax_llm_runtime.models.batch import StepBatch
from tests.models.harness import TINY, Loaded, PagedRunner, load_ours, prompts, save_random_model


def _variant(model: Loaded, unroll: bool) -> Loaded:
    return dataclasses.replace(
        model, config=dataclasses.replace(model.config, unroll_layers=unroll)
    )


def _decode_hlo(model: Loaded) -> str:
    runner = PagedRunner(model, 16, 2)
    ones = np.ones(2, np.int32)
    zeros = np.zeros((2, 1), np.int32)
    batch = StepBatch.padded(zeros, zeros, ones, ones, runner.page_indices)
    step = jax.jit(model.spec.forward, static_argnums=0, donate_argnums=2)
    return step.lower(model.config, model.weights, runner.cache, batch).compile().as_text()


def test_unrolled_layers_match_the_scan_and_read_weights_in_place(tmp_path):
    hf = LlamaConfig(**{**TINY, "num_hidden_layers": 3}, architectures=["LlamaForCausalLM"])
    save_random_model(hf, tmp_path)
    model = load_ours(tmp_path)
    scanned, unrolled = _variant(model, False), _variant(model, True)
    ids = prompts(hf.vocab_size)[:2]
    runners = [PagedRunner(m, 64, len(ids)) for m in (scanned, unrolled)]
    for r in runners:  # the same cache contents (including never-written pages) for both
        r.cache, r.page_indices = runners[0].cache, runners[0].page_indices
    first = [r.step(ids) for r in runners]
    np.testing.assert_allclose(first[0], first[1], rtol=1e-5, atol=1e-5)
    nxt = [[int(t)] for t in first[0].argmax(-1)]
    second = [r.step(nxt) for r in runners]
    np.testing.assert_allclose(second[0], second[1], rtol=1e-5, atol=1e-5)

    d, f = TINY["hidden_size"], TINY["intermediate_size"]
    # A layer's weight copied out of its stack: a weight-sized dynamic-slice or copy.
    weight_copy = rf"= f32\[(1,)?({d},{f}|{f},{d}|{d},{d})\][^\n]* (dynamic-slice|copy)\("
    hlo = _decode_hlo(scanned)
    assert " while(" in hlo and re.search(weight_copy, hlo)  # what the scan compiles to
    hlo = _decode_hlo(unrolled)
    assert " while(" not in hlo and not re.search(weight_copy, hlo)


@pytest.mark.parametrize(("argv", "unroll"), [([], None), (["--layer-loop", "unrolled"], True)])
def test_layer_loop_flag_reaches_the_model_and_auto_scans(argv, unroll, tmp_path):
    """``--layer-loop``: auto walks the layers under the scan on every backend (an unrolled
    step compiled too slowly on a GPU to start an engine); unrolled is asked for by name."""
    from jax_llm_runtime.api.cli.serve import _config_from_args, build_parser
    from jax_llm_runtime.runtime.loading.builder import configure_model

    config = _config_from_args(build_parser().parse_args(argv))
    hf = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).to_dict()
    _, model_config = configure_model(config, hf)
    assert model_config.unroll_layers is unroll
    hf_model = LlamaConfig(**{**TINY, "num_hidden_layers": 2}, architectures=["LlamaForCausalLM"])
    save_random_model(hf_model, tmp_path)
    model = load_ours(tmp_path)
    hlo = _decode_hlo(_variant(model, model_config.unroll_layers))
    assert (" while(" in hlo) is (unroll is None)


def test_bad_layer_loop_is_one_line_exit_2():
    from tests.api.test_cli import run_cli

    result = run_cli("--layer-loop", "twice")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--layer-loop" in lines[0] and "'twice'" in lines[0], result.stderr
