"""Layers walked by an unrolled loop (``DecoderConfig.unroll_layers``, ``--layer-loop unrolled``):
the same logits as the scanned layers, and a step whose weights are read in place; an engine
holds them one array per layer (``ModelWeights.per_layer``), and its step slices none.

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


def _variant(model: Loaded, unroll: bool, per_layer: bool = False) -> Loaded:
    weights = model.weights.per_layer() if per_layer else model.weights
    config = dataclasses.replace(model.config, unroll_layers=unroll)
    return dataclasses.replace(model, config=config, weights=weights)


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
    variants = [_variant(model, False), _variant(model, True), _variant(model, True, True)]
    ids = prompts(hf.vocab_size)[:2]
    runners = [PagedRunner(m, 64, len(ids)) for m in variants]
    for r in runners:  # the same cache contents (including never-written pages) for all
        r.cache, r.page_indices = runners[0].cache, runners[0].page_indices
    first = [r.step(ids) for r in runners]
    for other in first[1:]:
        np.testing.assert_allclose(first[0], other, rtol=1e-5, atol=1e-5)
    nxt = [[int(t)] for t in first[0].argmax(-1)]
    second = [r.step(nxt) for r in runners]
    for other in second[1:]:
        np.testing.assert_allclose(second[0], other, rtol=1e-5, atol=1e-5)

    d, f = TINY["hidden_size"], TINY["intermediate_size"]
    weight = rf"= f32\[(1,)?({d},{f}|{f},{d}|{d},{d})\][^\n]* "
    # A layer's weight copied out of its stack: a weight-sized dynamic-slice or copy.
    hlo = _decode_hlo(variants[0])
    assert " while(" in hlo and re.search(weight + r"(dynamic-slice|copy)\(", hlo)  # the scan
    hlo = _decode_hlo(variants[1])
    assert " while(" not in hlo and not re.search(weight + r"(dynamic-slice|copy)\(", hlo)
    # Held one array per layer, the step takes no slice of a weight at all.
    hlo = _decode_hlo(variants[2])
    assert " while(" not in hlo and not re.search(weight + r"(dynamic-slice|slice|copy)\(", hlo)
    assert re.search(weight + r"(dynamic-slice|slice|copy)\(", _decode_hlo(variants[1]))


def test_per_layer_weights_are_copies_placed_as_the_stack(tmp_path):
    """``ModelWeights.per_layer``: each stacked parameter becomes one array per layer equal to
    its slice, on the stack's device; with ``consume`` the stacks are deleted (the device holds
    the weights once); everything outside the layers is the same object."""
    from jax_llm_runtime.models.layers.params import PerLayer

    hf = LlamaConfig(**{**TINY, "num_hidden_layers": 3}, architectures=["LlamaForCausalLM"])
    save_random_model(hf, tmp_path)
    weights = load_ours(tmp_path).weights
    wq = weights.state["segments"][0]["layers"]["attn"]["wq"]["kernel"]
    split = weights.per_layer()
    values = jax.tree.leaves(split.state["segments"], is_leaf=lambda x: isinstance(x, PerLayer))
    assert len(values) == 9 and all(isinstance(v, PerLayer) and len(v.layers) == 3 for v in values)
    assert split.state["embed"] is weights.state["embed"]
    layers = split.state["segments"][0]["layers"]["attn"]["wq"]["kernel"].layers
    for i, layer in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(layer), np.asarray(wq)[i])
        assert layer.devices() == wq.devices()
    weights.per_layer(consume=True)
    assert all(a.is_deleted() for a in jax.tree.leaves(weights.state["segments"]))
    assert not any(a.is_deleted() for a in jax.tree.leaves(weights.state["embed"]))


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


@pytest.mark.slow
def test_an_unrolled_engine_holds_one_array_per_layer_and_matches_hf(tmp_path):
    """``--layer-loop unrolled`` through the whole engine: the runner's weights are held per
    layer (the loaded stacks deleted), and greedy tokens are HF's."""
    import asyncio

    import torch

    from jax_llm_runtime.models.layers.params import PerLayer
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.engine.request import SamplingParams
    from jax_llm_runtime.runtime.loading.builder import build_engine
    from tests.models.harness import save_tiny_byte_llama

    hf_model = save_tiny_byte_llama(tmp_path)
    config = EngineConfig(
        model_id=str(tmp_path), max_num_seqs=2, max_model_len=64, layer_loop="unrolled"
    )
    engine = build_engine(config)
    segments = engine.runner.weights.state["segments"]
    values = jax.tree.leaves(segments, is_leaf=lambda x: isinstance(x, PerLayer))
    assert values and all(isinstance(v, PerLayer) for v in values)
    engine.start()
    try:
        ids = engine.tokenizer.encode("The quick brown fox")
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

        async def run() -> list[int]:
            return [t async for d in engine.generate(ids, greedy, "r0") for t in d.token_ids]

        got = asyncio.run(run())
    finally:
        engine.shutdown()
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert got == ref
