"""Closing a turn so the log stays a valid conversation, however the turn stopped."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from loopd.canonical import digest
from loopd.session.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    AssistantRecord,
    FileChangeRecord,
    ToolResultRecord,
    TurnEndReason,
    TurnEndRecord,
)
from loopd.session.store import Session

__all__ = ["INTERRUPTED", "close_interrupted_turn", "close_turn", "turn_open"]


async def close_turn(
    session: Session, reason: TurnEndReason, said: Mapping[str, tuple[int, str]] | None = None
) -> None:
    """Deny the approvals still waiting, answer the calls of the last answer left without
    results, then say why the turn ended. `said`: for some of those calls (by id), the number
    and the text of their result."""
    state = session.state
    waiting = {r.tool_call_id: r for r in state.open_approvals}
    for request in waiting.values():
        await session.append(
            ApprovalRecord(call=request.call, tool=request.tool, decision="deny", by="turn_end")
        )
    if state.last_answer is not None:
        await _answer_calls(session, state.last_answer, reason, said or {}, waiting)
    await session.append(TurnEndRecord(reason=reason))


async def _answer_calls(
    session: Session,
    answer: tuple[int, AssistantRecord],
    reason: TurnEndReason,
    said: Mapping[str, tuple[int, str]],
    waiting: dict[str, ApprovalRequestRecord],
) -> None:
    """A result for each call of the last answer (`answer`, and its index among the records)
    that has none (`close_turn`)."""
    state, (at, last) = session.state, answer
    # The last answer and the records after it (a turn's, not the whole log's).
    records = list(session.records[at:])
    # The calls of this answer that a person let run (ids repeat across answers).
    approved = {
        r.tool_call_id: r.call
        for r in records
        if isinstance(r, ApprovalRequestRecord) and state.allowed(r.call)
    }
    # Results go in call order; counted, since a model may give two calls one id.
    answered = Counter(r.tool_call_id for r in records if isinstance(r, ToolResultRecord))
    for call in last.tool_calls:
        if answered[call.id] > 0:
            answered[call.id] -= 1
            continue
        ended = reason.replace("_", " ")
        if call.id in said:
            number, why = said[call.id]
        elif asked := waiting.pop(call.id, None):
            why = f"Not run: the turn ended ({ended}) while it waited for approval."
            number = asked.call
        elif call.id in approved:
            why = f"Interrupted: the turn ended ({ended}) while this approved call ran."
            number = approved[call.id]
        else:
            why = f"Not run: the turn ended first ({ended})."
            number = session.next_call()
        await session.append(
            ToolResultRecord(call=number, tool_call_id=call.id, name=call.name, content=why)
        )


INTERRUPTED = (
    "Interrupted: loopd stopped while the sub-agent in session {child} worked on this task, "
    "and nothing ran it again; its log holds what it did."
)


def turn_open(session: Session) -> bool:
    """The log shows a turn that started and has not ended."""
    return session.state.turn_open


async def close_interrupted_turn(
    session: Session, sub_agents: Mapping[str, tuple[int, str]] | None = None
) -> bool:
    """After a crash: close a turn the log shows started and never ended. True if there was one.
    `sub_agents`: the sub-agents its `delegate` calls started, as the call id, and the call's
    number and the sub-agent's session; their calls are closed as interrupted."""
    if not turn_open(session):
        return False
    said = {
        call_id: (number, INTERRUPTED.format(child=child))
        for call_id, (number, child) in (sub_agents or {}).items()
    }
    said |= _writes_cut_short(session)
    await close_turn(session, "error", said)
    return True


def _writes_cut_short(session: Session) -> dict[str, tuple[int, str]]:
    """The writes of the last turn that were recorded and never answered: whether each file
    holds what was meant, read from it (the rename made it whole, old or new)."""
    said = {}
    for record in session.records[session.state.last_user :]:
        if isinstance(record, FileChangeRecord):
            try:
                now: str | None = digest(Path(record.path).read_bytes())
            except FileNotFoundError:
                now = None
            held = {record.after: "the new content", record.before: "its old content"}
            what = held.get(now, "neither: it changed since")
            said[record.tool_call_id] = (
                record.call,
                f"Interrupted: loopd stopped while it wrote {record.path}; the file holds {what}.",
            )
    return said
