from types import SimpleNamespace

import pytest

from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
from jax_llm_runtime.runtime.engine.request import FinishReason, SamplingParams
from jax_llm_runtime.runtime.engine.scheduler import (
    ScheduledBatch,
    Scheduler,
    StepKind,
    chunk_cost,
    chunk_tokens,
    prefix_cost_positions,
)
from jax_llm_runtime.runtime.engine.sequence import Sequence, SequenceStatus

EOS = 0


def make(
    num_pages=16,
    page_size=4,
    max_num_seqs=4,
    chunk=8,
    max_model_len=64,
    prefix_cache=True,
    budget=None,
    prefill_lens=(),
    mixed=True,
):
    alloc = PageAllocator(num_pages, page_size)
    sched = Scheduler(
        alloc,
        max_num_seqs,
        max_model_len,
        chunk,
        [EOS],
        prefill_lens=prefill_lens,
        prefix_cache=prefix_cache,
        max_num_batched_tokens=budget,
        mixed=mixed,
    )
    return sched, alloc


_arrival = iter(range(10**6))


def seq(prompt_len, max_tokens=4, rid=None, **kw):
    n = next(_arrival)
    return Sequence(
        rid or f"r{n}",
        list(range(1, prompt_len + 1)),
        SamplingParams(max_tokens=max_tokens, **kw),
        0,
        n,
    )


def run(sched, batch, token=7):
    return sched.update(batch, [[token]] * len(batch.items))


def test_admission_chunking_and_finishing():
    sched, alloc = make(chunk=8)
    s = seq(20, max_tokens=2)
    sched.add(s)
    b = sched.schedule()
    assert b.kind is StepKind.PREFILL and (b.items[0].start, b.items[0].length) == (0, 8)
    assert len(s.pages) == 2 and s.status is SequenceStatus.RUNNING
    assert run(sched, b) == [] and s.output_ids == []  # a partial chunk samples nothing
    b = sched.schedule()
    assert (b.items[0].start, b.items[0].length) == (8, 8)
    run(sched, b)
    b = sched.schedule()
    assert (b.items[0].start, b.items[0].length) == (16, 4) and b.items[0].reaches_end
    assert run(sched, b) == [s] and s.output_ids == [7]
    b = sched.schedule()
    assert b.kind is StepKind.DECODE and b.items[0].start == 20
    run(sched, b)
    assert s.status is SequenceStatus.FINISHED and s.finish_reason is FinishReason.LENGTH
    assert alloc.num_free == alloc.num_pages and not sched.has_work()


def test_eos_and_stop_tokens_finish_and_ignore_eos_does_not():
    sched, _alloc = make()
    a, b, c = seq(3), seq(3, stop_token_ids=(9,)), seq(3, ignore_eos=True)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()  # one step prefills all three
    assert batch.kind is StepKind.PREFILL and [i.seq for i in batch.items] == [a, b, c]
    run(sched, batch, token=5)
    batch = sched.schedule()
    assert batch.kind is StepKind.DECODE and len(batch.items) == 3
    sched.update(batch, [[EOS], [9], [EOS]])
    assert a.finish_reason is FinishReason.STOP and b.finish_reason is FinishReason.STOP
    assert c.status is SequenceStatus.RUNNING and c.output_ids == [5, EOS]
    assert a.output_ids == [5, EOS] and b.output_ids == [5, 9]


def test_max_num_seqs_bounds_the_running_set():
    sched, _ = make(max_num_seqs=2)
    seqs = [seq(2, max_tokens=50) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(6):
        b = sched.schedule()
        run(sched, b)
        assert len(sched.running) <= 2
    assert seqs[2].status is SequenceStatus.WAITING


def test_a_new_prompt_is_prefilled_in_the_running_decodes_steps():
    """Every step decodes the running sequence and takes one chunk of the new prompt."""
    sched, _ = make(chunk=4)
    first = seq(2, max_tokens=10)
    sched.add(first)
    run(sched, sched.schedule())
    second = seq(12)
    sched.add(second)
    steps = []
    for _ in range(4):
        b = sched.schedule()
        steps.append((b.kind, [(i.seq, i.start, i.length) for i in b.items]))
        run(sched, b)
    mixed = StepKind.PREFILL
    assert steps == [
        (mixed, [(first, 2, 1), (second, 0, 4)]),
        (mixed, [(first, 3, 1), (second, 4, 4)]),
        (mixed, [(first, 4, 1), (second, 8, 4)]),
        (StepKind.DECODE, [(first, 5, 1), (second, 12, 1)]),
    ]


def test_without_mixed_steps_prefill_and_decode_alternate():
    """Where attention has no native ragged kernel, a step is one prefill chunk or a decode."""
    sched, _ = make(chunk=4, mixed=False)
    first = seq(2, max_tokens=10)
    sched.add(first)
    run(sched, sched.schedule())
    sched.add(seq(12))
    sched.add(seq(3))
    kinds = []
    for _ in range(4):
        b = sched.schedule()
        assert b.kind is StepKind.DECODE or len(b.items) == 1
        kinds.append(b.kind)
        run(sched, b)
    assert kinds == [StepKind.DECODE, StepKind.PREFILL, StepKind.DECODE, StepKind.PREFILL]


def test_the_token_budget_bounds_a_step():
    """Decode tokens count against max_num_batched_tokens; chunks of several prompts fill the
    rest, the last one cut to fill a token bucket."""
    sched, _ = make(num_pages=64, max_num_seqs=8, chunk=16, budget=20, prefill_lens=(8, 16, 20))
    running = [seq(2, max_tokens=50) for _ in range(2)]
    for s in running:
        sched.add(s)
    run(sched, sched.schedule())  # both prefilled together: 4 tokens
    waiting = [seq(10), seq(10), seq(10)]
    for s in waiting:
        sched.add(s)
    b = sched.schedule()
    lengths = [(i.seq, i.length) for i in b.items]
    # 2 decode tokens, then 10 + 8: the second prompt is cut so that the step fills 20 tokens.
    assert lengths == [(running[0], 1), (running[1], 1), (waiting[0], 10), (waiting[1], 8)]
    assert waiting[2].status is SequenceStatus.WAITING
    assert sum(i.length for i in b.items) <= 20


def test_abort_frees_pages_wherever_the_sequence_is():
    sched, alloc = make()
    running, waiting = seq(5, rid="run"), seq(5, rid="wait")
    sched.add(running)
    run(sched, sched.schedule())
    sched.add(waiting)
    assert sched.abort("run") is running and running.finish_reason is FinishReason.ABORT
    assert sched.abort("wait") is waiting
    assert alloc.num_free == alloc.num_pages and not sched.has_work()
    assert sched.abort("nope") is None


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_when_pages_run_out_recomputes_the_newest(prefix_cache):
    sched, alloc = make(num_pages=4, page_size=4, chunk=16, prefix_cache=prefix_cache)
    old, new = seq(4, max_tokens=20), seq(4, max_tokens=20)
    for s in (old, new):
        sched.add(s)
    sched.waiting.remove(new)
    run(sched, sched.schedule())  # old: prefill, one page
    run(sched, sched.schedule())  # old: decode at position 4 takes a second page
    sched.add(new)
    run(sched, sched.schedule())  # old decodes, new is prefilled: one page
    run(sched, sched.schedule())  # both decode; new takes its second page: the cache is full
    assert alloc.num_free == 0
    while len(old.pages) * 4 >= old.num_tokens:  # until old's next token needs a third page
        b = sched.schedule()
        assert len(b.items) == 2
        run(sched, b)
    # old needs a third page: new is preempted and its pages come back.
    b = sched.schedule()
    assert b.kind is StepKind.DECODE and [i.seq for i in b.items] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed == 0 and new.pages == []
    assert sched.waiting[0] is new and sched.num_preemptions == 1
    run(sched, b)
    generated = len(new.output_ids)
    sched.abort(old.request_id)
    b = sched.schedule()  # the preempted sequence recomputes prompt + outputs in one prefill
    assert b.kind is StepKind.PREFILL and b.items[0].reaches_end
    # With the prefix cache, the full prompt page is found cached (it was freed, not reused).
    start = 4 if prefix_cache else 0
    assert (b.items[0].start, b.items[0].length) == (start, 4 + generated - start)


def test_forks_share_the_prompt_pages_and_recompute_only_the_last_partial_page():
    sched, alloc = make(num_pages=16, page_size=4, chunk=16)
    parent = seq(10, max_tokens=3)  # pages: [0-3] [4-7] [8-9]
    forks = [seq(10, max_tokens=3), seq(10, max_tokens=3)]
    parent.forks = list(forks)
    sched.add(parent)
    b = sched.schedule()
    assert b.kind is StepKind.PREFILL and b.items[0].length == 10
    run(sched, b)
    assert parent.forks == [] and list(sched.waiting) == forks
    shared = parent.pages[:2]  # the page holding the last prompt token is not shared
    for fork in forks:
        assert fork.pages == shared and fork.num_computed == 8
    assert all(alloc.ref_count(p) == 3 for p in shared)
    b = sched.schedule()  # the parent decodes; each fork recomputes from its last shared page
    assert b.kind is StepKind.PREFILL
    assert [(i.seq, i.start, i.length) for i in b.items] == [
        (parent, 10, 1), (forks[0], 8, 2), (forks[1], 8, 2)
    ]  # fmt: skip
    assert all(i.reaches_end for i in b.items)
    while sched.has_work():
        run(sched, sched.schedule())
    assert all(len(s.output_ids) == 3 for s in [parent, *forks])
    assert alloc.num_free == alloc.num_pages


def test_prompt_on_a_page_boundary_still_leaves_a_token_for_each_fork():
    sched, alloc = make(num_pages=16, page_size=4, chunk=16)
    parent, fork = seq(8, max_tokens=1), seq(8, max_tokens=1)
    parent.forks = [fork]
    sched.add(parent)
    b = sched.schedule()
    prompt_pages = list(parent.pages)
    run(sched, b)
    assert parent.finish_reason is FinishReason.LENGTH  # parent finished in the same update
    assert fork.num_computed == 4 and fork.pages == prompt_pages[:1]
    assert alloc.ref_count(prompt_pages[0]) == 1  # the parent's reference is gone, the fork's stays
    b = sched.schedule()
    assert (b.items[0].start, b.items[0].length) == (4, 4)
    run(sched, b)
    assert fork.finish_reason is FinishReason.LENGTH and alloc.num_free == alloc.num_pages


def test_aborting_a_parent_before_the_fork_point_lets_its_forks_run_alone():
    sched, alloc = make(num_pages=16, page_size=4, chunk=4)
    parent, fork = seq(10, max_tokens=2, rid="parent"), seq(10, max_tokens=2, rid="fork")
    parent.forks = [fork]
    sched.add(parent)
    run(sched, sched.schedule())  # first chunk of 4 only
    sched.abort("parent")
    assert list(sched.waiting) == [fork] and fork.pages == [] and fork.num_computed == 0
    assert sched.abort("fork") is fork and not sched.has_work()
    assert alloc.num_free == alloc.num_pages


def test_aborting_a_parked_fork_removes_it():
    sched, _ = make()
    parent, fork = seq(6, rid="p"), seq(6, rid="f")
    parent.forks = [fork]
    sched.add(parent)
    assert sched.abort("f") is fork and fork.finish_reason is FinishReason.ABORT
    assert parent.forks == []


def _prefilled(sched, *seqs):
    """Admit and prefill every sequence (one token sampled each)."""
    for s in seqs:
        sched.add(s)
    while any(s.num_pending > 1 or not s.output_ids for s in seqs):
        run(sched, sched.schedule())


def test_multi_step_decode_only_when_nothing_else_waits():
    alloc = PageAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 8, [EOS], decode_steps=4)
    a = seq(3, max_tokens=20)
    _prefilled(sched, a)
    batch = sched.schedule()
    assert batch.kind is StepKind.DECODE and batch.num_steps == 4
    # Pages cover every position the 4 steps write: 3 prompt + 1 sampled + 3 fed back = 7 tokens.
    assert len(a.pages) * 4 >= a.num_tokens + 3
    sched.update(batch, [[5, 6, 8, 9]])
    assert a.output_ids == [7, 5, 6, 8, 9] and a.num_computed == a.num_tokens - 1
    sched.add(seq(3))  # a new request waits: one step at a time so it is admitted next
    assert sched.schedule().num_steps == 1


def test_multi_step_falls_back_to_one_step():
    bans = ({"min_tokens": 3}, {"min_tokens": 3, "ignore_eos": True, "stop_token_ids": (5,)})
    for kw in ({"logprobs": 2}, {"presence_penalty": 0.5}, *bans):
        sched = Scheduler(PageAllocator(16, 4), 4, 64, 8, [EOS], decode_steps=4)
        _prefilled(sched, seq(3, **{"max_tokens": 20, **kw}))
        assert sched.schedule().num_steps == 1, kw
    # min_tokens with nothing to ban (ignore_eos, no stop token ids) does not hold it back.
    sched = Scheduler(PageAllocator(16, 4), 4, 64, 8, [EOS], decode_steps=4)
    _prefilled(sched, seq(3, max_tokens=20, min_tokens=10, ignore_eos=True))
    assert sched.schedule().num_steps == 4
    # Near the end of the context window there is no room for 4 more positions.
    sched = Scheduler(PageAllocator(16, 4), 4, 8, 8, [EOS], decode_steps=4)
    _prefilled(sched, seq(6, max_tokens=20))
    assert sched.schedule().num_steps == 1


def test_multi_step_overshoot_of_max_tokens_is_dropped():
    sched = Scheduler(PageAllocator(16, 4), 4, 64, 8, [EOS], decode_steps=4)
    a = seq(3, max_tokens=3)
    _prefilled(sched, a)
    batch = sched.schedule()
    assert batch.num_steps == 4
    sched.update(batch, [[5, 6, 8, 9]])
    assert a.output_ids == [7, 5, 6] and a.finish_reason is FinishReason.LENGTH


def test_multi_step_tokens_after_a_stop_are_dropped():
    alloc = PageAllocator(16, 4)
    sched = Scheduler(alloc, 4, 64, 8, [EOS], decode_steps=4)
    a, b = seq(3, max_tokens=20), seq(5, max_tokens=20)
    _prefilled(sched, a, b)
    batch = sched.schedule()
    assert batch.num_steps == 4
    a_before, b_before = list(a.output_ids), list(b.output_ids)
    changed = sched.update(batch, [[5, EOS, 6, 6], [5, 6, 8, 9]])
    assert changed == [a, b]
    assert a.output_ids == [*a_before, 5, EOS] and a.finish_reason is FinishReason.STOP
    assert b.output_ids == [*b_before, 5, 6, 8, 9] and b.status is SequenceStatus.RUNNING
    assert alloc.num_free == alloc.num_pages - len(b.pages)  # a's pages are back


def prompt_seq(prompt, max_tokens=4):
    return Sequence(f"p{next(_arrival)}", list(prompt), SamplingParams(max_tokens=max_tokens), 0, 0)


def drain(sched, token=7):
    while sched.has_work():
        run(sched, sched.schedule(), token)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_shared_prefix_is_computed_once(prefix_cache):
    sched, alloc = make(page_size=4, chunk=16, prefix_cache=prefix_cache)
    first = prompt_seq(range(1, 11))  # pages [1-4] [5-8] [9-10]
    sched.add(first)
    run(sched, sched.schedule())
    second = prompt_seq([*range(1, 9), 50, 51, 52])  # shares the first two full pages
    sched.add(second)
    b = sched.schedule()  # first decodes, second is prefilled in the same step
    assert b.kind is StepKind.PREFILL and [i.seq for i in b.items] == [first, second]
    b = ScheduledBatch(b.kind, b.items[1:])  # the prefill of second, as checked below
    if prefix_cache:
        assert (b.items[0].start, b.items[0].length) == (8, 3)
        assert second.pages[:2] == first.pages[:2] and second.num_cached_tokens == 8
        assert all(alloc.ref_count(p) == 2 for p in first.pages[:2])
        assert (sched.num_cache_queried_tokens, sched.num_cache_hit_tokens) == (21, 8)
    else:
        assert (b.items[0].start, b.items[0].length) == (0, 11)
        assert not set(second.pages) & set(first.pages) and second.num_cached_tokens == 0
    drain(sched)
    assert alloc.num_free == alloc.num_pages


def test_a_finished_sequence_leaves_its_prompt_and_output_pages_cached():
    sched, alloc = make(page_size=4, chunk=16)
    first = prompt_seq(range(1, 7), max_tokens=4)  # 6 prompt + 4 output tokens
    sched.add(first)
    drain(sched, token=9)
    assert first.output_ids == [9] * 4 and alloc.num_free == alloc.num_pages
    # The K/V of the first 9 tokens were computed (the last output was sampled, never fed).
    assert alloc.num_cached == 2
    follow_up = prompt_seq([*range(1, 7), 9, 9, 9, 9, 60, 61])  # a chat's next turn
    sched.add(follow_up)
    b = sched.schedule()
    assert (b.items[0].start, b.items[0].length) == (8, 4) and follow_up.num_cached_tokens == 8


def test_a_prompt_that_is_all_cached_still_computes_its_last_token():
    sched, _ = make(page_size=4, chunk=16)
    first = prompt_seq(range(1, 9))
    sched.add(first)
    drain(sched)
    again = prompt_seq(range(1, 9))
    sched.add(again)
    b = sched.schedule()
    assert (b.items[0].start, b.items[0].length) == (4, 4) and b.items[0].reaches_end


def test_cached_pages_are_given_back_when_the_rest_does_not_fit():
    sched, alloc = make(num_pages=4, page_size=4, chunk=16)
    first = prompt_seq(range(1, 9), max_tokens=1)
    sched.add(first)
    drain(sched)
    blocker = prompt_seq(range(100, 108), max_tokens=8)  # takes 2 pages, 3 once it decodes
    sched.add(blocker)
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    assert alloc.num_free == 1
    big = prompt_seq([*range(1, 9), *range(200, 209)])  # 2 cached pages + 3 more: cannot start
    sched.add(big)
    b = sched.schedule()
    assert b.kind is StepKind.DECODE and big.pages == [] and big.num_computed == 0
    assert alloc.num_cached >= 1, "the cached prefix went back to the free list, still cached"


def test_multi_step_decode_only_for_small_batches():
    # multi_step_seqs: a batch of more decoding sequences gets its tokens one step at a time.
    sched = Scheduler(PageAllocator(32, 4), 4, 64, 8, [EOS], decode_steps=4, multi_step_seqs=2)
    a, b, c = (seq(3, max_tokens=20) for _ in range(3))
    _prefilled(sched, a, b)
    assert sched.schedule().num_steps == 4
    _prefilled(sched, c)
    assert sched.schedule().num_steps == 1


def test_chunks_of_a_long_prompt_shrink_with_its_prefix():
    # With prefix_cost, a chunk also pays for the positions it attends over: one token per
    # prefix_cost positions. A 200-token prompt alone under a budget of 32: the first chunk
    # takes (almost) the whole budget, later ones less, and no step spends more than 32.
    sched = Scheduler(
        PageAllocator(64, 4), 2, 256, 256, [EOS], max_num_batched_tokens=32, prefix_cost=100
    )
    sched.add(seq(200, max_tokens=2))
    lengths = []
    while not sched.running or sched.running[0].num_pending > 1:
        batch = sched.schedule()
        (item,) = batch.items
        assert chunk_cost(item.start, item.length, 100) <= 32
        lengths.append(item.length)
        run(sched, batch)
    assert sum(lengths) == 200
    assert lengths[0] >= 27 and lengths[-2] <= 12
    assert lengths[:-1] == sorted(lengths[:-1], reverse=True)


def test_chunk_tokens_is_the_longest_chunk_that_fits():
    for start in (0, 10, 500, 5000):
        for room in (1, 7.5, 64, 300):
            n = chunk_tokens(start, room, 400)
            assert n == 1 or chunk_cost(start, n, 400) <= room
            assert chunk_cost(start, n + 1, 400) > room
    assert chunk_tokens(5000, 64, None) == 64


def test_prefix_cost_of_smollm2():
    # SmolLM2-135M: hidden 576, 30 layers, 9 heads of 64, vocab 49,152. One token's projections
    # and head (2 * (12 * 576^2 * 30 + 576 * 49152) flops) cost as much as its attention over
    # 4,275 positions (4 * 30 * 9 * 64 flops each).
    attention = SimpleNamespace(num_heads=9, head_dim=64)
    config = SimpleNamespace(
        hidden_size=576, num_layers=30, vocab_size=49152, attention=attention, head_dim=64
    )
    assert prefix_cost_positions(config) == 4275
    assert prefix_cost_positions(config, attention_flop_cost=4.0) == 1069


def test_a_step_no_stream_waits_on_takes_the_prefill_only_budget():
    # Budget 12 while sequences decode, 32 for a step without decode rows: a lone prompt runs
    # in chunks of 32; once one sequence decodes, the next prompt's chunks leave room for it.
    sched = Scheduler(
        PageAllocator(64, 4), 4, 256, 256, [EOS], max_num_batched_tokens=12,
        prefill_only_tokens=32, prefix_cache=False,
    )  # fmt: skip
    a, b = seq(40, max_tokens=20), seq(40, max_tokens=20)
    sched.add(a)
    first = sched.schedule()
    assert [(i.seq, i.length) for i in first.items] == [(a, 32)]
    run(sched, first)
    run(sched, sched.schedule())  # a's last 8 tokens: a decodes from here
    sched.add(b)
    step = sched.schedule()
    assert [(i.seq, i.length) for i in step.items] == [(a, 1), (b, 11)]


def test_a_decode_call_is_scheduled_ahead_only_where_its_inputs_are_known_without_the_host():
    sched, alloc = make(num_pages=8, page_size=4)
    a, b = seq(3, max_tokens=6), seq(3, max_tokens=6)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # both prompts, one token each
    decode = sched.schedule()
    assert decode.kind is StepKind.DECODE
    free = alloc.num_free
    ahead = sched.schedule_ahead(decode, 1)
    # The same sequences, one past the running call's token, which is fed on the device; the
    # page for position 4 (the second page) is reserved now.
    assert ahead.fed_steps == 1 and ahead.num_steps == 1
    assert [(i.seq, i.start, i.length) for i in ahead.items] == [(a, 4, 1), (b, 4, 1)]
    assert alloc.num_free == free - 2
    run(sched, decode)
    run(sched, ahead)
    assert a.output_ids == [7, 7, 7] and a.num_computed == 5
    # A waiting prompt, a sequence that needs the host's work on each token, or requests that
    # all end by length in the running call: nothing ahead.
    decode = sched.schedule()
    assert sched.schedule_ahead(decode, 3) is None  # 3 + 3 tokens: both reach max_tokens 6
    c = seq(3)
    sched.add(c)
    assert sched.schedule_ahead(decode, 1) is None
    sched.abort(c.request_id)
    assert sched.schedule_ahead(decode, 1) is not None
    logprobs = seq(3, max_tokens=6, logprobs=2)
    sched.abort(b.request_id)
    sched.add(logprobs)
    run(sched, sched.schedule())
    assert sched.schedule_ahead(sched.schedule(), 1) is None
