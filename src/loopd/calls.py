"""The tool calls of one turn: each answered in order, its approval (when its policy asks)
and its result written to the log before the event that reports them.

A call repeated with the same arguments in one turn is answered from the log once, and ends
the turn the third time (`[loop] repeat_detection`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from loopd.baseline import untrusted_envelope
from loopd.config import LoopConfig
from loopd.events import ApprovalDecided, ApprovalNeeded, ToolCallStarted, ToolResult, TurnEvent
from loopd.infer import ToolCall
from loopd.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    ToolResultRecord,
)
from loopd.store import Session
from loopd.tools import (
    Asking,
    CallOrigin,
    ModelAnswer,
    Registry,
    ToolPort,
    answer_call,
    call_key,
    requested_tool,
)

__all__ = ["REPEAT_TEXT", "RepeatedCall", "ToolCalls", "approval_needed", "cap_result"]

REPEAT_TEXT = (
    "Not run: this call was already made with these arguments in this turn; its result is above."
)
PREVIEW = 120


class RepeatedCall(Exception):
    """The same call a third time in one turn: the turn ends (a `TurnLimit` for the caller)."""


def cap_result(text: str, cap: int) -> tuple[str, bool]:
    """At most `cap` characters, with a marker saying how much was cut."""
    if len(text) <= cap:
        return text, False
    return f"{text[:cap]}\n[... truncated: {len(text) - cap} more characters not shown]", True


def approval_needed(asking: Asking) -> ApprovalNeeded:
    """The event that asks clients for an approval."""
    return ApprovalNeeded(
        call=asking.call,
        tool=asking.tool,
        arguments=asking.arguments,
        data_class=asking.data_class,
        untrusted=asking.untrusted,
        timeout=asking.timeout,
    )


@dataclass
class ToolCalls:
    """Answers the calls of one turn."""

    session: Session
    loop: LoopConfig
    port: ToolPort
    registry: Registry
    find_limit: int
    on_event: Callable[[TurnEvent], None]

    def __post_init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()

    async def answer(self, call: ToolCall) -> None:
        number = self.session.next_call()
        self.on_event(
            ToolCallStarted(
                name=call.name, call=number, tool=requested_tool(call.name, call.arguments)
            )
        )
        answer = await self._run(call, number)
        if (approval := answer.approval) is not None:
            tool, decision, by = approval.tool, approval.decision, approval.by
            await self.session.append(
                ApprovalRecord(call=number, tool=tool, decision=decision, by=by)
            )
            self.on_event(ApprovalDecided(call=number, tool=tool, decision=decision, by=by))
        text, truncated = cap_result(answer.text, self.loop.tool_result_cap)
        if answer.untrusted:
            text = untrusted_envelope(text)
        await self.session.append(
            ToolResultRecord(
                call=number,
                tool_call_id=call.id,
                name=call.name,
                content=text,
                data_class=answer.data_class,
                untrusted=answer.untrusted,
                truncated=truncated,
            )
        )
        self.on_event(
            ToolResult(
                name=call.name,
                call=number,
                data_class=answer.data_class,
                untrusted=answer.untrusted,
                truncated=truncated,
                preview=text.strip().split("\n", 1)[0][:PREVIEW],
            )
        )

    async def _run(self, call: ToolCall, number: int) -> ModelAnswer:
        key = call_key(call.name, call.arguments)
        self.seen[key] += 1
        if self.loop.repeat_detection and self.seen[key] > 1:
            if self.seen[key] > 2:
                raise RepeatedCall(
                    f"{call.name} was called a third time with the same arguments "
                    "in one turn ([loop] repeat_detection)"
                )
            return ModelAnswer(REPEAT_TEXT)

        async def on_asking(asking: Asking) -> None:
            await self.session.append(
                ApprovalRequestRecord(
                    call=number,
                    tool_call_id=call.id,
                    tool=asking.tool,
                    arguments=asking.arguments,
                    data_class=asking.data_class,
                    untrusted=asking.untrusted,
                )
            )
            self.on_event(approval_needed(asking))

        origin = CallOrigin(self.session.id, number, self.session.granted)
        return await answer_call(
            self.registry,
            self.port,
            call.name,
            call.arguments,
            origin,
            find_limit=self.find_limit,
            on_asking=on_asking,
        )
