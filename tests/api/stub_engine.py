"""A real ``Engine`` (loop thread, scheduler, page allocator, streams) over a scripted runner.

There is no model and nothing to compile, so tests of admission, draining and engine death run
the engine's own code paths in milliseconds. Every step samples the same byte token for every
sequence, so a request runs until ``max_tokens``; ``ScriptedRunner`` samples a scripted reply.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from jax_llm_runtime.runtime.engine.core import Engine
from jax_llm_runtime.runtime.engine.mock import EOS_ID, VOCAB_SIZE, MockTokenizer
from jax_llm_runtime.runtime.engine.model_runner import InFlight, StepResult
from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
from jax_llm_runtime.runtime.engine.scheduler import ScheduledBatch, Scheduler
from jax_llm_runtime.runtime.text.tokenizer import IncrementalDecoder

TOKEN = ord("x")


class StubTokenizer(MockTokenizer):
    """The mock's byte-level tokenizer plus the incremental decoder the engine's streams use."""

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)  # type: ignore[arg-type]


class _NothingToCompile:
    def compile_now(self, keys: list[Any]) -> float:
        return 0.0

    def compile_each(self, keys: list[Any], stop: threading.Event) -> int:
        return 0


class StubRunner:
    """Stands in for ``ModelRunner``: each call sleeps ``step_s`` and samples ``TOKEN``.

    ``gate``: calls wait while it is clear (to hold sequences in place). ``fail``: once set, the
    next call raises as if the device had failed with the cache donated, which kills the engine
    loop. ``fail_prompt``: a call raises (cache intact) while a sequence whose prompt ends so is in
    the batch, a failure of that request alone. ``batch_sizes`` and ``seen`` record what ran.
    """

    vocab_size = VOCAB_SIZE
    images = None  # a text-only model: no image encoder
    mirror = None  # not a multi-node leader

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.compiled = _NothingToCompile()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = threading.Event()
        self.fail_prompt: list[int] | None = None
        self.batch_sizes: list[int] = []
        self.seen: set[str] = set()

    def cache_lost(self) -> bool:
        return self.fail.is_set()

    def startup_shapes(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def dispatch(self, batch: ScheduledBatch, fed: InFlight | None = None) -> InFlight:
        """Runs nothing yet: ``collect`` runs the batch, so a call scheduled ahead sees the
        tokens of the call before it, as on the device."""
        return InFlight(batch, batch.num_steps, None, None, False)

    def collect(self, call: InFlight) -> StepResult:
        return self.run(call.batch)

    def run(self, batch: ScheduledBatch) -> StepResult:
        if not self.gate.wait(timeout=30):
            raise TimeoutError("the test left StubRunner.gate closed")
        time.sleep(self.step_s)
        if self.fail.is_set():
            raise RuntimeError("injected runner failure")
        poison = self.fail_prompt
        if poison and any(item.seq.prompt_ids[-len(poison) :] == poison for item in batch.items):
            raise ValueError("injected failure of one request")
        self.batch_sizes.append(len(batch.items))
        self.seen.update(item.seq.request_id for item in batch.items)
        return StepResult([[TOKEN] * batch.num_steps for _ in batch.items])


class ScriptedRunner(StubRunner):
    """Samples the bytes of ``script`` in order, then EOS, or with ``loop`` the script again from
    its start until ``max_tokens`` (a model that repeats itself). ``lengths`` records each
    request's output length after the last step that ran it: how far the engine generated."""

    def __init__(self, step_s: float, script: str, loop: bool = False) -> None:
        super().__init__(step_s)
        self.script = list(script.encode())
        self.loop = loop
        self.lengths: dict[str, int] = {}

    def run(self, batch: ScheduledBatch) -> StepResult:
        result = super().run(batch)
        for row, item in enumerate(batch.items):
            start = len(item.seq.output_ids)
            result.token_ids[row] = [self._token(start + k) for k in range(batch.num_steps)]
            self.lengths[item.seq.request_id] = start + batch.num_steps
        return result

    def _token(self, position: int) -> int:
        if self.loop:
            return self.script[position % len(self.script)]
        return self.script[position] if position < len(self.script) else EOS_ID


def stub_engine(
    *,
    max_num_seqs: int = 4,
    max_waiting: int = 0,
    num_pages: int = 64,
    page_size: int = 16,
    max_model_len: int = 512,
    step_s: float = 0.002,
    runner: StubRunner | None = None,
    tokenizer: StubTokenizer | None = None,
) -> tuple[Engine, StubRunner]:
    """An unstarted engine over a ``StubRunner`` (``start()`` returns at once); ``runner`` and
    ``tokenizer`` replace the plain ones (subclasses that inject failures)."""
    runner = runner or StubRunner(step_s)
    scheduler = Scheduler(
        PageAllocator(num_pages, page_size),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        prefill_chunk_size=64,
        eos_token_ids=[EOS_ID],
    )
    engine = Engine(
        runner,  # type: ignore[arg-type]
        scheduler,
        tokenizer or StubTokenizer(),
        "stub-model",
        max_model_len,
        max_waiting=max_waiting,
    )
    return engine, runner
