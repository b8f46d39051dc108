"""One request's clock: submission, first token, finish; for usage and latency metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """Monotonic timestamps in seconds; ``first_token`` and ``finished`` are set as they happen."""

    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def mark_finished(self) -> None:
        if self.finished is None:
            self.finished = time.monotonic()

    @property
    def ttft_s(self) -> float:
        """Submission to first token (0 before the first token)."""
        return 0.0 if self.first_token is None else self.first_token - self.submitted

    @property
    def decode_s(self) -> float:
        """First token to finish, or to now while still generating."""
        if self.first_token is None:
            return 0.0
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.first_token

    @property
    def prompt_time_costs_ms(self) -> int:
        """candle-vllm's ``prompt_time_costs``: time to first token in milliseconds."""
        return round(self.ttft_s * 1000)

    @property
    def completion_time_costs_ms(self) -> int:
        """candle-vllm's ``completion_time_costs``: first token to finish in milliseconds."""
        return round(self.decode_s * 1000)
