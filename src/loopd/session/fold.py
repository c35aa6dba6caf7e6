"""What a session's records make of it, folded a record at a time: no I/O.

A session's mode, model, grants and call numbers, and its prompt trail, are kept here as its
records come, apart from its file (`loopd.session.store.Session`, which holds one). So are the
answers that `status` and the closing of a turn need (the turn open or not, the approvals still
waiting, the plan, the reasoning the exact prompt holds), each of which was found by reading
every record again on trio's thread, every other session's stream stopped meanwhile: 17 to 62
ms a scan of 100,000 records on two busy cores. `SessionState` is a function of the header
and the records alone, in order: `Session` makes one when it opens a log and applies each
record it appends, and a test feeds it records.
"""

from __future__ import annotations

from collections.abc import Iterable

from loopd.session.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    AssistantRecord,
    Mode,
    ModeRecord,
    PlanRecord,
    PromptRecord,
    Record,
    SessionHeader,
    ToolResultRecord,
    TurnEndRecord,
    UsageRecord,
    UserRecord,
)
from loopd.session.trail import PromptTrail

__all__ = ["SessionState"]


class SessionState:
    """A session's state after its header and the records `apply`d to it, in order. Read it;
    only the owner of the log applies records."""

    def __init__(self, header: SessionHeader, records: Iterable[Record] = ()) -> None:
        self.mode: Mode = header.mode
        """What its tools may do without asking: its last `mode` record's, else its header's."""
        self.thinking: bool | None = header.thinking
        """Whether its turns think; None: `[loop] thinking`."""
        self.model: str | None = None
        """The `[models.NAME]` its turns run on, as its last `mode` record says; None: the
        default."""
        self.granted: set[str] = set(header.grants)
        """Tools a person approved for the rest of the session (or of the one it continues)."""
        self.last_call = 0
        """The highest call number a result or an approval request holds."""
        self.last_usage: UsageRecord | None = None
        """The last request's, on the model the session runs on now (none right after a change
        of model: usage before it is another model's)."""
        self.turns = 0
        """User messages: the turns begun."""
        self.turn_open = False
        """A turn began and has not ended (no `turn_end` after the last user message)."""
        self.last_user = -1
        """The index of the last user message among the records; -1: none."""
        self.last_answer: tuple[int, AssistantRecord] | None = None
        """The last answer and its index among the records; None: none yet."""
        self.open_approvals: list[ApprovalRequestRecord] = []
        """Approvals asked for and not decided, in order: the call still waits (or loopd
        stopped while it did)."""
        self._decided: set[int] = set()
        self._denied: set[int] = set()
        self.plan: PlanRecord | None = None
        """The session's plan: the last one the model set (None: it set none)."""
        self.past_reasoning: int | None = None
        """Reasoning tokens the token-exact prompt holds (every answer's since the last full
        prompt); None when the history went as messages."""
        self.trail = PromptTrail()
        """The token-exact prompt up to the last answer."""
        self.count = 0
        """Records applied."""
        for record in records:
            self.apply(record)

    def allowed(self, call: int) -> bool:
        """Whether a person let call `call` run: decided, and never denied."""
        return call in self._decided and call not in self._denied

    def apply(self, record: Record) -> None:  # noqa: C901, PLR0912 - a branch a kind
        """The next record of the log."""
        at = self.count
        self.count += 1
        self.trail.add(record)
        if isinstance(record, UserRecord):
            self.turns += 1
            self.turn_open, self.last_user = True, at
        elif isinstance(record, TurnEndRecord):
            self.turn_open = False
        elif isinstance(record, AssistantRecord):
            self.last_answer = at, record
            if record.tokens is None:
                self.past_reasoning = None
        elif isinstance(record, PromptRecord):
            if record.full:
                self.past_reasoning = 0
        elif isinstance(record, UsageRecord):
            self.last_usage = record
            if self.past_reasoning is not None:
                self.past_reasoning += record.reasoning_tokens
        elif isinstance(record, ModeRecord):
            self.mode, self.thinking = record.mode, record.thinking
            if record.model != self.model:
                self.model, self.last_usage = record.model, None
        elif isinstance(record, ToolResultRecord):
            self.last_call = max(self.last_call, record.call)
        elif isinstance(record, ApprovalRequestRecord):
            self.last_call = max(self.last_call, record.call)
            if record.call not in self._decided:
                self.open_approvals.append(record)
        elif isinstance(record, ApprovalRecord):
            self._approved(record)
        elif isinstance(record, PlanRecord):
            self.plan = record

    def _approved(self, record: ApprovalRecord) -> None:
        self._decided.add(record.call)
        if record.decision == "deny":
            self._denied.add(record.call)
        elif record.decision == "session":
            self.granted.add(record.tool)
        if any(r.call == record.call for r in self.open_approvals):
            self.open_approvals = [r for r in self.open_approvals if r.call != record.call]
