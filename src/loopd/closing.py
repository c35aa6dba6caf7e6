"""Closing a turn so the log stays a valid conversation, however the turn stopped."""

from __future__ import annotations

from collections import Counter

from loopd.records import (
    ApprovalRecord,
    AssistantRecord,
    ToolResultRecord,
    TurnEndReason,
    TurnEndRecord,
    UserRecord,
    open_approvals,
)
from loopd.store import Session

__all__ = ["close_interrupted_turn", "close_turn"]


async def close_turn(session: Session, reason: TurnEndReason) -> None:
    """Deny the approvals still waiting, answer the calls of the last answer left without
    results, then say why the turn ended."""
    waiting = {r.tool_call_id: r for r in open_approvals(session.records)}
    for request in waiting.values():
        await session.append(
            ApprovalRecord(call=request.call, tool=request.tool, decision="deny", by="turn_end")
        )
    records = list(session.records)
    for index in range(len(records) - 1, -1, -1):
        last = records[index]
        if isinstance(last, AssistantRecord):
            # Results go in call order; counted, since a model may give two calls one id.
            answered = Counter(
                r.tool_call_id for r in records[index:] if isinstance(r, ToolResultRecord)
            )
            for call in last.tool_calls:
                if answered[call.id] > 0:
                    answered[call.id] -= 1
                    continue
                ended = reason.replace("_", " ")
                if asked := waiting.pop(call.id, None):
                    why = f"Not run: the turn ended ({ended}) while it waited for approval."
                    number = asked.call
                else:
                    why = f"Not run: the turn ended first ({ended})."
                    number = session.next_call()
                await session.append(
                    ToolResultRecord(call=number, tool_call_id=call.id, name=call.name, content=why)
                )
            break
    await session.append(TurnEndRecord(reason=reason))


async def close_interrupted_turn(session: Session) -> bool:
    """After a crash: close a turn the log shows started and never ended. True if there was one."""
    last_user = max(
        (i for i, r in enumerate(session.records) if isinstance(r, UserRecord)), default=-1
    )
    if last_user < 0 or any(isinstance(r, TurnEndRecord) for r in session.records[last_user:]):
        return False
    await close_turn(session, "error")
    return True
