"""The hybrid cache of linear-attention models through the scheduler and the model runner: a tiny
random Qwen3.5 (linear, full, linear, full layers) gives HF's greedy tokens alone, in mixed
steps with other sequences, with several decode steps per call, after preemption (a slot given
back and taken again, its stale state ignored), and for both sequences of ``n = 2`` (the fork from a copy of its parent's state); its state
slots are all free at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.state_slots import StateSlots
from tests.models.harness import greedy_hf, load_ours, save_random_model

NEW_TOKENS = 10
PAGE_SIZE = 4
MAX_SEQS = 4
PROMPT_LENS = (5, 13, 22)


@dataclass
class Setup:
    model: object
    runner: object
    prompts: list[list[int]]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    import transformers

    from jax_llm_runtime.models.layers.linear_attention import HybridCache
    from jax_llm_runtime.pallas_kernels.paged_attention import KVCache
    from jax_llm_runtime.runtime.engine.buckets import BucketPlan
    from jax_llm_runtime.runtime.engine.model_runner import ModelRunner
    from tests.models.test_qwen3_next import HYBRID, LAYER_TYPES

    folder: Path = tmp_path_factory.mktemp("qwen3_5")
    hf = transformers.Qwen3_5TextConfig(**HYBRID, layer_types=LAYER_TYPES)
    hf_model = save_random_model(hf, folder, seed=3)
    model = load_ours(folder)
    cfg = model.config
    plan = BucketPlan.build(MAX_SEQS, 64, 8, PAGE_SIZE, 16, mixed=True)
    k_shape, v_shape = cfg.cache_shapes(64, PAGE_SIZE)
    kv = KVCache.zeros(k_shape, np.float32, v_shape)
    cache = HybridCache.zeros(kv, cfg.linear_attention, cfg.num_linear_layers, MAX_SEQS, np.float32)
    runner = ModelRunner(model.spec, cfg, model.weights, cache, plan)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, hf.vocab_size, n).tolist() for n in PROMPT_LENS]
    hf_model.generation_config.eos_token_id = None
    expected = [greedy_hf(hf_model, p)[:NEW_TOKENS] for p in prompts]
    return Setup(model, runner, prompts, expected)


def _scheduler(setup: Setup, num_pages: int, decode_steps: int = 1):
    from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
    from jax_llm_runtime.runtime.engine.scheduler import Scheduler

    return Scheduler(
        PageAllocator(num_pages, PAGE_SIZE),
        max_num_seqs=MAX_SEQS,
        max_model_len=64,
        prefill_chunk_size=8,
        eos_token_ids=(),
        prefill_lens=setup.runner.plan.prefill_lens,
        prefix_cache=False,
        max_num_batched_tokens=16,
        state_slots=True,
        decode_steps=decode_steps,
    )


def _sequence(request_id: str, prompt: list[int], arrival: int):
    from jax_llm_runtime.runtime.engine.request import SamplingParams
    from jax_llm_runtime.runtime.engine.sequence import Sequence

    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return Sequence(request_id, list(prompt), sampling, seed=0, arrival=arrival)


def _run(setup: Setup, scheduler, seqs: list) -> list:
    """Steps until every sequence finished (each step's slots are its own sequences'); returns
    the batches run."""
    for seq in seqs:
        scheduler.add(seq)
    batches = []
    for _ in range(500):
        batch = scheduler.schedule()
        if batch is None:
            break
        slots = [item.seq.state_slot for item in batch.items]
        assert None not in slots and len(set(slots)) == len(slots)
        result = setup.runner.run(batch)
        scheduler.update(batch, result.token_ids)
        batches.append(batch)
    assert not scheduler.has_work()
    assert scheduler.state_slots.num_used == 0
    return batches


def test_alone_and_in_mixed_steps(setup: Setup) -> None:
    from jax_llm_runtime.runtime.engine.scheduler import StepKind

    for i, prompt in enumerate(setup.prompts):
        seq = _sequence(f"alone-{i}", prompt, 0)
        _run(setup, _scheduler(setup, 64), [seq])
        assert seq.output_ids == setup.expected[i]
    seqs = [_sequence(f"mixed-{i}", p, i) for i, p in enumerate(setup.prompts)]
    batches = _run(setup, _scheduler(setup, 64), seqs)
    assert [s.output_ids for s in seqs] == setup.expected
    mixed = [b for b in batches if b.kind is StepKind.PREFILL and len(b.items) > 1]
    assert mixed, "no step mixed several sequences"


def test_after_preemption(setup: Setup) -> None:
    scheduler = _scheduler(setup, 14)  # too few pages for all three: the newest is preempted
    seqs = [_sequence(f"preempt-{i}", p, i) for i, p in enumerate(setup.prompts)]
    _run(setup, scheduler, seqs)
    assert scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == setup.expected


def test_multi_step_decode(setup: Setup) -> None:
    """Several decode steps in one call carry the state from step to step on the device."""
    plan = setup.runner.plan
    setup.runner.compiled.compile_now([(1, 1, p, 4) for p in plan.pages if p <= 8])
    seq = _sequence("multi", setup.prompts[1], 0)
    batches = _run(setup, _scheduler(setup, 64, decode_steps=4), [seq])
    assert any(b.num_steps == 4 for b in batches)
    assert seq.output_ids == setup.expected[1]


@pytest.mark.parametrize("free_slots", [True, False])
def test_n_2_fork_starts_from_a_copy_of_the_parent_state(setup: Setup, free_slots: bool) -> None:
    """The parent's 13-token prompt is computed up to its last full page (12 tokens); the fork
    shares those pages, gets the parent's state copied into its own slot and computes from
    position 12. Without a free slot then, it recomputes the prompt from position 0."""
    scheduler = _scheduler(setup, 64)
    # Three short prompts ahead of the parent hold the other slots until after the fork point.
    others = [] if free_slots else [_sequence(f"busy-{i}", [7, 8], i) for i in range(3)]
    parent, fork = (_sequence(f"n2-{i}", setup.prompts[1], 3 + i) for i in range(2))
    parent.forks = [fork]
    batches = _run(setup, scheduler, [*others, parent])
    assert parent.output_ids == fork.output_ids == setup.expected[1]
    copies = [b.state_copies for b in batches if b.state_copies]
    starts = [item.start for b in batches for item in b.items if item.seq is fork]
    if free_slots:
        assert (copies, starts[0]) == ([((0, 1),)], 12)  # the parent in slot 0, the fork in 1
    else:
        assert (copies, starts[0]) == ([], 0)


def test_state_slots_are_taken_and_given_back() -> None:
    slots = StateSlots(2)
    a, b = slots.take(), slots.take()
    assert {a, b} == {0, 1} and slots.num_free == 0
    with pytest.raises(RuntimeError, match="in use"):
        slots.take()
    slots.give_back(a)
    assert slots.take() == a
    with pytest.raises(ValueError, match="not in use"):
        slots.give_back(5)


def test_a_fork_waits_with_its_slot_and_an_abort_gives_it_back() -> None:
    """No model: the parent's prefill stops at its last full page (12 of 13 tokens), the fork
    takes a slot there with a copy of the parent's state queued for the next batch, and an
    aborted fork gives its slot back."""
    from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
    from jax_llm_runtime.runtime.engine.scheduler import Scheduler

    scheduler = Scheduler(
        PageAllocator(64, PAGE_SIZE),
        max_num_seqs=MAX_SEQS,
        max_model_len=64,
        prefill_chunk_size=8,
        eos_token_ids=(),
        prefix_cache=False,
        state_slots=True,
    )
    parent, fork = (_sequence(f"abort-{i}", list(range(1, 14)), i) for i in range(2))
    parent.forks = [fork]
    scheduler.add(parent)
    lengths = []
    for _ in range(2):
        batch = scheduler.schedule()
        lengths.append(batch.items[0].length)
        scheduler.update(batch, [[5]])
    assert lengths == [8, 4] and fork.num_computed == 12 and len(fork.pages) == 3
    batch = scheduler.schedule()
    assert batch.state_copies == ((parent.state_slot, fork.state_slot),)
    assert scheduler.state_slots.num_used == 2
    scheduler.abort(fork.request_id)
    assert fork.state_slot is None and scheduler.state_slots.num_used == 1
