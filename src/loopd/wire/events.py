"""The events of a turn, as clients see them: the inference events passed on one to one, and
the turn's own (a tool call starting, an approval asked for and given, its result, a cache
loss, a command's output as it runs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field

from loopd.infer import (
    Content,
    Progress,
    Queued,
    Reasoning,
    Repeating,
    Retrying,
    ThinkingCapped,
    Waiting,
)
from loopd.session.records import DataClass, Decision, PlanRecord, PlanStep

__all__ = [
    "AgentState",
    "AgentUpdate",
    "ApprovalDecided",
    "ApprovalNeeded",
    "CacheLoss",
    "Compacting",
    "FileChange",
    "MovedToServer",
    "PlanUpdate",
    "SessionContinued",
    "ToolCallStarted",
    "ToolOutputChunk",
    "ToolResult",
    "TurnEvent",
    "WaitReason",
    "WaitingForServer",
]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)


class ToolCallStarted(_Event):
    """The model called a tool; it is about to be answered."""

    kind: Literal["tool_call_started"] = "tool_call_started"
    name: str
    """The tool the model named (`find_tool`, `call_tool`, or another it made up)."""
    call: int
    """The session's number for this call."""
    tool: str | None = None
    """For `call_tool`: the tool it asks for, when the arguments name one."""


class ToolOutputChunk(_Event):
    """What a running call (`run_command`) printed since its last chunk, stdout and stderr as
    they come: sent at most every 0.2 s, at most 32 KiB of output a call (a note says when
    the rest is not sent). For the people watching only: the model reads the call's result,
    which `tool_result` reports."""

    kind: Literal["tool_output"] = "tool_output"
    call: int
    """The session's number for the call (as in `tool_call_started`)."""
    text: str


class FileChange(BaseModel):
    """A write's or an edit's whole change, for an editor's own diff view."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    path: str
    """The file's absolute path."""
    old_text: str | None
    """What it holds; None: it does not exist yet."""
    new_text: str
    """What it would hold."""


class ToolResult(_Event):
    """The answer to a call is in the log."""

    kind: Literal["tool_result"] = "tool_result"
    name: str
    call: int
    data_class: DataClass = Field(alias="class")
    untrusted: bool
    truncated: bool
    preview: str
    """The first line of the result, shortened."""
    change: FileChange | None = None
    """What a write or an edit changed (as `approval_needed`'s `change`), once it is made."""


class ApprovalNeeded(_Event):
    """A call waits for a person: any client of the session answers it with `approve`."""

    kind: Literal["approval_needed"] = "approval_needed"
    call: int
    session: str | None = None
    """A sub-agent's session, when the call is one of its own (answer it there); None: the
    turn's own session."""
    tool: str
    arguments: dict[str, Any]
    data_class: DataClass = Field(alias="class")
    """What its result would hold."""
    untrusted: bool
    """Its result would come from outside (the model sees it marked as data)."""
    timeout: float
    """Seconds it waits before it is denied (`[tools] approval_timeout`)."""
    preview: str | None = None
    """What it would do: a write's or an edit's unified diff; a command, its folder and
    sandbox."""
    change: FileChange | None = None
    """A write's or an edit's texts, before and after, where both are text and each at most
    20,000 characters: an editor shows them as its own diff."""


class ApprovalDecided(_Event):
    """The approval of a call ended: by a client, by its timeout, or with its turn."""

    kind: Literal["approval_decided"] = "approval_decided"
    call: int
    session: str | None = None
    """As for `approval_needed`."""
    tool: str
    decision: Decision
    by: Literal["user", "timeout", "turn_end"]


class PlanUpdate(_Event):
    """The model set its plan (an `update_plan` call): the whole plan, which replaces the one
    before. Sent before the call's `tool_result`."""

    kind: Literal["plan"] = "plan"
    call: int
    """The call that set it."""
    explanation: str | None = None
    """Why the plan is what it is, or changed, where the model said."""
    steps: tuple[PlanStep, ...]
    """Each `{step, status}` in order; `status` is `pending`, `in_progress` (at most one) or
    `completed`. Empty: the model cleared its plan."""

    @classmethod
    def of(cls, record: PlanRecord) -> PlanUpdate:
        return cls(call=record.call, explanation=record.explanation, steps=record.steps)


class CacheLoss(_Event):
    """The request found fewer tokens in the KV cache than the previous prompt held."""

    kind: Literal["cache_loss"] = "cache_loss"
    expected: int
    cached: int


class Compacting(_Event):
    """The model writes a summary of the session, for a new session that continues it (the
    context is full, or a client asked with `compact`). Progress events of the summary's
    prompt follow; its text comes with `session_continued`."""

    kind: Literal["compacting"] = "compacting"
    session: str
    slot: int
    """The slot the summary is written on."""


class SessionContinued(_Event):
    """Turns go to a new session from now on, which continues `previous` from `summary`."""

    kind: Literal["session_continued"] = "session_continued"
    previous: str
    session: str
    summary: str


WaitReason = Literal["loading", "restarting", "unreachable"]


class WaitingForServer(_Event):
    """The turn's llama-server cannot take its request yet: the turn tries again until it
    can, or until the turn's deadline (`[loop] turn_timeout`). Sent when the wait begins and
    when its reason changes; the wait is over when the request is taken (`waiting`)."""

    kind: Literal["waiting_for_server"] = "waiting_for_server"
    reason: WaitReason
    """`loading`: it answers 503 while it loads its model; `restarting`: loopd's own
    llama-server exited and is being started again; `unreachable`: no connection can be
    made."""
    detail: str
    """The error of the last try, as llama-server or the connection gave it."""

    def said(self) -> str:
        """The wait in one line, as clients show it."""
        return f"waiting for the server: {_WAITS[self.reason]} ({self.detail})"


class MovedToServer(_Event):
    """The turn's llama-server could not take its request (as in `waiting_for_server`), and
    another of loopd's servers could: the turn goes on there at once, on a slot of that
    server, the session's cache restored from its slot file where that server can read it
    (else recomputed, and recorded as a `cache_loss`)."""

    kind: Literal["moved_to_server"] = "moved_to_server"
    previous: str
    """The server that could not take the request."""
    server: str
    """The server the turn goes on on."""
    reason: WaitReason
    detail: str
    """The error the request met on `previous`."""

    def said(self) -> str:
        """The move in one line, as clients show it."""
        why = _WAITS[self.reason].removeprefix("it ")
        return (
            f"moved to the server at {self.server}: the one at {self.previous} {why} "
            f"({self.detail})"
        )


_WAITS: dict[WaitReason, str] = {
    "loading": "it is loading its model",
    "restarting": "it is being restarted",
    "unreachable": "it cannot be reached",
}


AgentState = Literal["running", "answered", "failed", "cancelled"]


class AgentUpdate(_Event):
    """A sub-agent started by a `delegate` call is running, or has ended."""

    kind: Literal["agent"] = "agent"
    session: str
    """The sub-agent's session."""
    parent: str
    """The session whose call started it."""
    call: int
    """That call's number in `parent`."""
    state: AgentState
    """`failed`: it ended by a limit or an error (`detail` says which)."""
    tool_calls: int = 0
    """Tool calls it has made."""
    tokens: int = 0
    """Tokens it has generated."""
    tool: str | None = None
    """The tool it called last."""
    detail: str | None = None
    """Why it failed."""


TurnEvent = Annotated[
    Queued
    | Waiting
    | Progress
    | Reasoning
    | Content
    | ThinkingCapped
    | Repeating
    | Retrying
    | WaitingForServer
    | MovedToServer
    | ToolCallStarted
    | ToolOutputChunk
    | ApprovalNeeded
    | ApprovalDecided
    | ToolResult
    | PlanUpdate
    | CacheLoss
    | Compacting
    | SessionContinued
    | AgentUpdate,
    Discriminator("kind"),
]
