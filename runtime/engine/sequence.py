"""One generation in flight: its tokens, how many are already in the KV cache, and its pages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jax_llm_runtime.runtime.engine.grammar import GrammarMatcher
from jax_llm_runtime.runtime.engine.request import FinishReason, SamplingParams
from jax_llm_runtime.runtime.multimodal.inputs import SequenceImages


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids are ``prompt_ids + output_ids``; the first ``num_computed`` have their K/V cached.

    A sequence with exactly one uncached token can join a decode step; more than one needs prefill
    (a new prompt, or a preempted sequence being recomputed).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prefix cache: hashes of the full pages of ``token_slice`` so far (chained, see
    # ``page_allocator.page_hash``), how many leading pages are registered or were reused, and how
    # many prompt tokens the first admission found cached (reported as ``cached_tokens``).
    page_hashes: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int = 0
    # Constrained decoding (``SamplingParams.grammar``): this sequence's own matcher.
    matcher: GrammarMatcher | None = None
    # n > 1: sibling sequences parked until this one's prompt is computed, then started on its pages.
    forks: list[Sequence] = field(default_factory=list)
    # A vision-language prompt's images (its forks share them): where their soft tokens go.
    images: SequenceImages | None = None
    # Models with linear-attention layers: the state slot the sequence holds while it runs.
    state_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still have to be computed."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]
