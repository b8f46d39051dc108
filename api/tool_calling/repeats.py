"""Repeated tool calls: a reply ends where the model starts a call it already made.

Small models often make one call (same name, same arguments) over and over until ``max_tokens``.
``RepeatGuard`` sits between a reply's parser events and the client:

1. A call's deltas are held while the call could still be an exact repeat of an earlier call of
   the reply: an earlier call has its name and its arguments begin with the arguments so far.
   Once that cannot hold, the held deltas go out and the rest of the call streams as it comes, so
   a reply of distinct calls is delayed only by the prefix each shares with an earlier one.
2. A call that ends still held, its arguments equal to those of an earlier call of that name, is
   a repeat: it is never sent, nothing after it is sent, and ``repeated`` is set, so the caller
   ends the reply there (``ToolCallPieces`` aborts the sequence and finishes with ``tool_calls``).

A call ends where the parser's next event begins (content or another call) or, after the last
event, when the parser holds no open call (``ToolCallStream.call_open``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jax_llm_runtime.api.tool_calling.parsers import ToolCallDelta
from jax_llm_runtime.api.tool_calling.parsers.events import StreamEvent


@dataclass
class _OpenCall:
    """The call being read: its name, its arguments so far, and its deltas not yet sent."""

    name: str
    arguments: str = ""
    held: list[ToolCallDelta] | None = field(default_factory=list)  # None: released


class RepeatGuard:
    """Filters one reply's parser events; see the module docstring."""

    def __init__(self) -> None:
        self._done: list[tuple[str, str]] = []  # the reply's ended calls: (name, arguments)
        self._open: _OpenCall | None = None
        self.repeated = False  # a repeat was found: the reply ends before it

    def filter(self, events: list[StreamEvent], call_open: bool) -> list[StreamEvent]:
        """The events that can be sent now, in order.

        ``call_open``: the parser's last call has not ended yet. After a repeat, ``repeated`` is
        True, the events returned end before it, and the reply is over: a further call raises
        RuntimeError.
        """
        if self.repeated:
            raise RuntimeError("RepeatGuard.filter() after a repeat: the reply has ended")
        out: list[StreamEvent] = []
        for event in events:
            starts_call = isinstance(event, ToolCallDelta) and event.id is not None
            if (starts_call or not isinstance(event, ToolCallDelta)) and self._end_call(out):
                return out
            if isinstance(event, ToolCallDelta):
                self._add(event, out)
            else:
                out.append(event)
        if not call_open:
            self._end_call(out)
        return out

    def _add(self, delta: ToolCallDelta, out: list[StreamEvent]) -> None:
        if delta.id is not None:
            self._open = _OpenCall(delta.name or "")
        call = self._open
        if call is None:  # the parser sends arguments only after announcing their call
            raise RuntimeError(f"arguments of tool call {delta.index} came before the call")
        call.arguments += delta.arguments
        if call.held is None:
            out.append(delta)
            return
        call.held.append(delta)
        if not self._may_repeat(call):
            out.extend(call.held)
            call.held = None

    def _may_repeat(self, call: _OpenCall) -> bool:
        return any(
            name == call.name and arguments.startswith(call.arguments)
            for name, arguments in self._done
        )

    def _end_call(self, out: list[StreamEvent]) -> bool:
        """The open call (if any) ended: True when it repeats an earlier call, else its held
        deltas go out."""
        call, self._open = self._open, None
        if call is None:
            return False
        if call.held is not None:
            if (call.name, call.arguments) in self._done:
                self.repeated = True
                return True
            out.extend(call.held)
        self._done.append((call.name, call.arguments))
        return False
