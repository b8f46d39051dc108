"""The request vocabulary shared by the engine, the scheduler and the HTTP layer."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

# Fixed per-step widths, so these settings never change a compiled shape (see runtime/engine/sampler.py).
PENALTY_WINDOW = 1024  # the most recent tokens penalties look at; repeat_last_n is capped by it
MAX_LOGIT_BIAS = 300  # entries of logit_bias
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # |bias| <= 100; a bias of -100 bans the token


class SamplingFieldError(ValueError):
    """A sampling setting the engine cannot honour; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class OutputError(RuntimeError):
    """A request's sampled tokens could not be turned into text (a detokenizer or stop-string
    failure): a server-side fault of that request alone; its sequence is aborted."""


class ContextLengthError(ValueError):
    """A prompt and its completion budget do not fit the model's context (``check_context``)."""

    def __init__(self, max_model_len: int, prompt_len: int, completion_len: int) -> None:
        self.max_model_len = max_model_len
        self.prompt_len = prompt_len
        self.completion_len = completion_len
        self.prompt_too_long = prompt_len + 1 > max_model_len  # no room for a single token
        super().__init__(self.describe("messages"))

    def describe(self, prompt_param: str) -> str:
        """OpenAI's wording, naming the prompt as the request does ("messages", "prompt")."""
        return (
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {self.prompt_len + self.completion_len} tokens ({self.prompt_len} in the "
            f"{prompt_param}, {self.completion_len} in the completion). Please reduce the length "
            f"of the {prompt_param} or completion."
        )


def check_context(max_model_len: int, prompt_len: int, completion_len: int) -> None:
    """The one context-length rule: a prompt needs room for at least one token, and the prompt
    plus ``completion_len`` must fit ``max_model_len``. The engine (and the mock engine) checks
    every submission with it, and only there; the HTTP layer turns its error into a 400 naming
    the request's prompt field."""
    if prompt_len + max(completion_len, 1) > max_model_len:
        raise ContextLengthError(max_model_len, prompt_len, max(completion_len, 1))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; every field is honoured per sequence inside a batch.

    temperature 0 means greedy (argmax). top_k 0, top_p 1.0 and min_p 0 disable those filters.

    Penalties (applied to the logits before logit_bias, temperature and the filters):
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI) subtract ``presence * [count > 0] +
    frequency * count`` where ``count`` is how often the token occurs among the *generated*
    tokens; ``repetition_penalty`` (HF/vLLM) divides a positive logit by it and multiplies a
    negative one, for every token occurring in the prompt or the output. ``repeat_last_n``
    (candle-vllm) limits all three to the last ``repeat_last_n`` tokens of prompt + output
    (0 or less: the whole history); either way the window is capped at ``PENALTY_WINDOW`` tokens.

    ``stop``: strings that end the generation where they appear in its text; the text handed
    out ends before the first one, and the finish reason is "stop" (``runtime.text.stop_strings``).
    ``logit_bias`` maps token ids to a bias in [-100, 100] added to their logits; -100 bans the
    token. ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before that many tokens.
    ``seed`` makes sampling reproducible whatever else is batched (None: the engine picks one).
    ``logprobs``: None returns none; k >= 0 returns the sampled token's logprob and the k most
    likely alternatives (k <= ``MAX_TOP_LOGPROBS``).
    ``grammar``: an llguidance grammar (``runtime.engine.grammar``) the output must follow; tokens it
    does not allow are masked before sampling, and the sequence ends when it is complete.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the text (runtime.text.stop_strings)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # for the streamed text; token ids are unaffected
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        self._check_penalties()
        self._check_logit_bias()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.repeat_last_n > PENALTY_WINDOW:
            raise ValueError(f"repeat_last_n must be <= {PENALTY_WINDOW}, got {self.repeat_last_n}")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def banned_until_min_tokens(self, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
        """The token ids suppressed while fewer than ``min_tokens`` were generated: the stop
        token ids, and the model's EOS ids unless ``ignore_eos``."""
        return self.stop_token_ids + (() if self.ignore_eos else tuple(eos_token_ids))

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or the engine stopped
    ERROR = "error"  # processing this request raised; the engine serves the others on


@dataclass(frozen=True)
class GenerationDelta:
    """What one request's stream yields: the tokens (and their text) added since the last delta."""

    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id when the request asked for them
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives, best first.

    Values are the log-softmax of the logits the token was sampled from, after penalties and
    logit_bias, before temperature and the top-k/top-p/min-p filters.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), at most the requested count


@dataclass
class StepOutput:
    """What the engine thread hands to a request's stream after a step: new token ids, maybe a finish."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
