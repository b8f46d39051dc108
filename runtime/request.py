"""The request vocabulary shared by the engine, the scheduler and the HTTP layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; every field is honoured per sequence inside a batch.

    temperature 0 means greedy (argmax). top_k 0 and top_p 1.0 disable those filters.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or the engine shut down


@dataclass(frozen=True)
class GenerationDelta:
    """What one request's stream yields: the tokens (and their text) added since the last delta."""

    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None


@dataclass
class StepOutput:
    """What the engine thread hands to a request's stream after a step: new token ids, maybe a finish."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
