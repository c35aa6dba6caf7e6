"""The requests the live chat and the editor (`bxctl acp`) both make of what a person types
or chooses, worded once: `/undo [N]`, `/approve N DECISION [SESSION]`, and the answer to a
call that waits for approval. (`/rewind`'s words are `bxctl.rewind`'s.)"""

from __future__ import annotations

from typing import get_args

from loopd.session.records import Decision
from loopd.wire.events import ApprovalNeeded
from loopd.wire.proto import Approve, Undo

__all__ = ["APPROVE_USAGE", "UNDO_USAGE", "approve_of", "decided", "undo_of"]

UNDO_USAGE = "/undo, or /undo N for call N's changes alone"
APPROVE_USAGE = "/approve N once|session|deny [SUB-AGENT SESSION]"


def undo_of(words: list[str]) -> Undo | None:
    """`/undo` (the last turn's changes) or `/undo N` (call N's); None for other words."""
    if len(words) > 1 or (words and not words[0].isdigit()):
        return None
    return Undo(call=int(words[0]) if words else None)


def approve_of(words: list[str]) -> Approve | None:
    """`/approve N DECISION [SESSION]` (a sub-agent's call names its session); None for other
    words."""
    decisions: tuple[Decision, ...] = get_args(Decision)
    if len(words) not in (2, 3) or not words[0].isdigit() or words[1] not in decisions:
        return None
    decision = next(d for d in decisions if d == words[1])
    session = words[2] if len(words) == 3 else None
    return Approve(call=int(words[0]), decision=decision, session=session)


def decided(asking: ApprovalNeeded, decision: Decision) -> Approve:
    """The answer `decision` to the call `asking` asks about (a sub-agent's, by its session)."""
    return Approve(call=asking.call, session=asking.session, decision=decision)
