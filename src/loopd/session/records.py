"""The records of a session log: one JSON object per line, each with a `kind` and a `time`.

A log is the whole truth of a session. Records are only ever appended; the messages sent to
the model are a pure function of the baseline and the records (`loopd.session.baseline.messages`).
`time` goes to the log only, never into a message, so a replay gives the same bytes.

Versioning: the header carries `format`. A field added later gets a default, so older logs
keep loading; a renamed field keeps its old name as an alias. Fields a newer loopd wrote and
this one does not know are ignored on reading. A change that old readers could not survive
raises `format`, and readers refuse formats newer than theirs with a clear message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, TypeAdapter

from loopd.infer import Completion, PromptPiece, Timings, ToolCall

__all__ = [
    "FORMAT",
    "RECORD",
    "ApprovalRecord",
    "ApprovalRequestRecord",
    "AssistantRecord",
    "Baseline",
    "CacheLossRecord",
    "ContinuedRecord",
    "CutReason",
    "DataClass",
    "Decision",
    "FailureKind",
    "FileChangeRecord",
    "GivenServer",
    "HookEvent",
    "HookRecord",
    "InstructionFile",
    "Instructions",
    "McpServersRecord",
    "Mode",
    "ModeRecord",
    "PlanRecord",
    "PlanStatus",
    "PlanStep",
    "PromptRecord",
    "Record",
    "SessionHeader",
    "SummaryRecord",
    "ToolResultRecord",
    "TurnEndReason",
    "TurnEndRecord",
    "UndoRecord",
    "UnreadRecord",
    "UsageRecord",
    "UserRecord",
    "conversation_problems",
    "current_plan",
    "dump",
    "granted_tools",
    "now",
    "open_approvals",
    "stricter",
]

FORMAT = 8
"""The log format this loopd writes and the newest it reads. 2 added `prompt` records and the
tokens of an answer; 3 added `approval_request` and `approval` records; 4 added `summary`
records (a session that continues another); 5 added `file_change` and `undo` records, an
approval's `preview`, and a sub-agent's header (`parent`, `call`, `call_id`); 6 added
`mcp_servers`, `mode` and `unread` records and the header's `mode` and `thinking`; 7 added
`plan` and `hook` records; 8 added `continued` records."""

DataClass = Literal["public", "private", "secret"]
TurnEndReason = Literal["answer", "turn_limit", "session_full", "cancelled", "error"]
CutReason = Literal["cancelled", "turn_limit", "error"]
"""What cut an answer short as it streamed: a cancel, the turn's deadline, its server."""
FailureKind = Literal["turn_limit", "session_full", "infer", "cancelled", "error"]
"""How a turn that did not answer ended, as clients are told: `infer` when llama-server
could not answer (its log says `error`)."""
Mode = Literal["ask", "accept_edits", "read_only"]
"""What a session's tools may do without asking (docs/editors.md, "Modes"): `ask`: the
configured policies; `accept_edits`: write_file and edit_file run without asking where they
ask by loopd's default alone; `read_only`: write_file, edit_file, run_command and every call
that would ask are refused, without asking."""
_LOOSEST_FIRST: tuple[Mode, ...] = ("accept_edits", "ask", "read_only")
Decision = Literal["once", "session", "deny"]
"""A person's answer to an approval: run this call, run this tool for the rest of the
session without asking, or do not run it."""


def now() -> datetime:
    return datetime.now(UTC)


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    time: datetime = Field(default_factory=now)
    """When the record was written (UTC). In the log only, never in a message."""


class Baseline(BaseModel):
    """What every request of a session starts with; fixed when the session is created."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    system: str
    """The system prompt."""
    tools: tuple[dict[str, Any], ...]
    """The tool definitions the model sees: `find_tool` and `call_tool`, forever."""


class InstructionFile(BaseModel):
    """One `AGENTS.md` a session's baseline carries, as it was when the session was made."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    path: str
    """Its absolute path."""
    sha256: str
    """SHA-256 of the whole file as read."""
    size: int
    """Its length in bytes."""
    kept: int
    """Bytes of it in the prompt: less than `size` where `[session] instructions_bytes` cut
    it (0: left out whole), the prompt saying so where it is cut."""


class Instructions(BaseModel):
    """The `AGENTS.md` files of a session's baseline (`SessionHeader.instructions`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    files: tuple[InstructionFile, ...]
    start: int
    """Where their text starts in the baseline's system prompt (characters)."""
    end: int
    """Where it ends."""

    def text(self, baseline: Baseline) -> str:
        return baseline.system[self.start : self.end]


class SessionHeader(_Record):
    """The first line of every log."""

    kind: Literal["session"] = "session"
    id: str
    created: datetime
    baseline: Baseline
    loopd_version: str
    """The loopd that created the session."""
    format: int = FORMAT
    continues: str | None = None
    """The session this one continues (compacted into the summary its baseline carries)."""
    grants: tuple[str, ...] = ()
    """Tools a person approved for the rest of the session this one continues, or of the one
    that delegated to it: approved here too."""
    parent: str | None = None
    """A sub-agent's: the session whose `delegate` call started it."""
    call: int | None = None
    """A sub-agent's: the number of that call in its parent."""
    call_id: str | None = None
    """A sub-agent's: the model's id of that call (`tool_call_id`)."""
    cwd: str | None = None
    """The folder the session's file tools work in (an editor's project), under one of
    `[tools] roots`; None: all of `[tools] roots`. Kept by the sessions that continue it and
    by its sub-agents."""
    instructions: Instructions | None = None
    """The `AGENTS.md` files its system prompt carries (`loopd.session.instructions`): each
    one's path and SHA-256, read when the session was made and carried unchanged by the
    sessions that continue it and by its sub-agents. None: none (and in logs older than it)."""
    mode: Mode = "ask"
    """The mode it starts in: that of the session it continues, or that delegated to it."""
    thinking: bool | None = None
    """Whether its turns think, as it starts (carried as `mode` is); None: `[loop] thinking`."""
    forked_from: str | None = None
    """A fork's: the session whose history it starts with (`loopd.session.fork`)."""
    at: int | None = None
    """A fork's: the turn of `forked_from` its history ends with; the records up to that
    turn's end are copied after the header, unchanged."""


class UserRecord(_Record):
    kind: Literal["user"] = "user"
    content: str


class AssistantRecord(_Record):
    """An answer exactly as received: it goes back to the model unchanged."""

    kind: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    """Ids, names and the `arguments` strings as the model sent them."""
    tokens: tuple[PromptPiece, ...] | None = None
    """The tokens the model generated (token-exact history); what the next prompt holds."""
    ended: bool = False
    """The last token ended the message (it was not cut by a limit)."""
    cut: CutReason | None = None
    """The answer was cut short before its end: by a cancel (`cancelled`), the turn's deadline
    (`turn_limit`) or its server (`error`: the stream broke or said an error). It holds what
    came, as far as it came; None: it came whole (or was cut by `max_tokens`, `ended` false)."""

    @classmethod
    def of(cls, c: Completion, cut: CutReason | None = None) -> AssistantRecord:
        return cls(
            content=c.content,
            reasoning_content=c.reasoning_content,
            tool_calls=c.tool_calls,
            tokens=c.tokens,
            ended=c.ended,
            cut=cut,
        )


class PromptRecord(_Record):
    """Text a token-exact request added to the prompt: the rendering of the messages since the
    last answer and the generation prompt. Written with the answer, never for a failed request.
    Produces no message: `loopd.turn.exact` builds each prompt from these and the answers'
    tokens."""

    kind: Literal["prompt"] = "prompt"
    text: str
    full: bool = False
    """The whole history rendered anew: the prompt starts here (a session's first request, or
    the first after history was sent any other way)."""
    trim: int = 0
    """Trailing tokens of the previous answer left out: an end token the template writes
    differently (harmony's `<|return|>`), never in the slot anyway."""


class UsageRecord(_Record):
    """What one request cost; produces no message."""

    kind: Literal["usage"] = "usage"
    timings: Timings | None
    """llama-server's timings; None when the client cut the stream (the thinking cap)."""
    reasoning_tokens: int = 0
    thinking_capped: bool = False


class UnreadRecord(_Record):
    """Text of an answer loopd's parser failed on: it went on as content, as written, and so
    did the rest of that answer, unread. Produces no message."""

    kind: Literal["unread"] = "unread"
    text: str
    error: str
    """What the parser raised."""


class CacheLossRecord(_Record):
    """The request found fewer tokens in the KV cache than the previous prompt held."""

    kind: Literal["cache_loss"] = "cache_loss"
    expected: int
    cached: int
    reason: str | None = None
    """Why, where loopd knows: the slot file its cache was to come from could not be restored
    (gone, or a server that keeps none)."""


class ToolResultRecord(_Record):
    """The answer to one tool call; becomes a `tool` message."""

    kind: Literal["tool_result"] = "tool_result"
    call: int
    """The session's own number for this call (`Session.next_call`)."""
    tool_call_id: str
    """The model's id of the call this answers."""
    name: str
    content: str
    """As the model will see it: capped, and wrapped in the untrusted envelope if untrusted."""
    data_class: DataClass = Field(default="public", alias="class")
    untrusted: bool = False
    truncated: bool = False


class ApprovalRequestRecord(_Record):
    """A call waits for a person's approval (its policy is `ask`); produces no message."""

    kind: Literal["approval_request"] = "approval_request"
    call: int
    """The session's number for this call; its result will carry the same number."""
    tool_call_id: str
    tool: str
    arguments: dict[str, Any]
    data_class: DataClass = Field(default="public", alias="class")
    untrusted: bool = False
    preview: str | None = None
    """What the call would do, as the person was shown it (a diff, a command)."""
    basis: str | None = None
    """A write's: what its preview was planned on, the SHA-256 of the file as shown, or `new`
    when there was no file. Once approved, the write is refused if the file no longer matches."""


class FileChangeRecord(_Record):
    """A call is about to change a file: written before the change, so a log cut short by a
    crash still says what was meant (the file's hash says whether it happened). The contents
    are kept by their hashes in loopd's state folder, for `undo`."""

    kind: Literal["file_change"] = "file_change"
    call: int
    tool_call_id: str
    path: str
    """The file's absolute path."""
    before: str | None
    """SHA-256 of what it held; None: it did not exist."""
    after: str
    """SHA-256 of what it will hold."""


class UndoRecord(_Record):
    """A person put back what these calls changed."""

    kind: Literal["undo"] = "undo"
    calls: tuple[int, ...]
    paths: tuple[str, ...]


class GivenServer(BaseModel):
    """An MCP server a client gave the session, as its log keeps it: never its environment or
    headers, which may hold tokens."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    command: tuple[str, ...] = ()
    """Its command line; empty for a server at a URL."""
    url: str | None = None
    """The URL of a server that runs elsewhere (never its headers)."""
    refused: str | None = None
    """Why it was not started (its name is taken); None: it was."""


class McpServersRecord(_Record):
    """The MCP servers a client gave the session as it opened it (an editor's `mcpServers`):
    their tools are offered to it alone while it is live. Produces no message."""

    kind: Literal["mcp_servers"] = "mcp_servers"
    servers: tuple[GivenServer, ...]


class ApprovalRecord(_Record):
    """How an approval ended; produces no message (the call's result says it to the model)."""

    kind: Literal["approval"] = "approval"
    call: int
    tool: str
    decision: Decision
    by: Literal["user", "timeout", "turn_end"] = "user"
    """`user`: a client's answer; `timeout`: `[tools] approval_timeout` passed; `turn_end`:
    the turn ended first (cancelled, a limit, or loopd stopped)."""


class SummaryRecord(_Record):
    """How a continued session began: the model's summary of the session it continues, and
    what the summary request cost. Produces no message: the baseline's system prompt carries
    the summary."""

    kind: Literal["summary"] = "summary"
    session: str
    """The session summarised."""
    text: str
    timings: Timings | None
    slot: int
    """The slot the summary was written on."""
    omitted: int = 0
    """Characters of the old transcript's start left out so that it fit the slot's context."""


class ContinuedRecord(_Record):
    """The conversation went on in another session, made from this one: a fork at an earlier
    turn's end (a `rewind`), or a session that continues from the model's summary (a
    compaction). Produces no message, and a fork never copies it: it is this log's alone. A
    client that asks to follow (an editor reopening its session) is taken along the last such
    record of each session to the newest (`loopd.session.continued`)."""

    kind: Literal["continued"] = "continued"
    session: str
    """The session it went on in."""
    by: Literal["rewind", "compact"]
    at: int | None = None
    """A rewind's: the turn whose end the fork starts from."""


class ModeRecord(_Record):
    """A client set the session's mode; it holds from here until the next. Produces no
    message."""

    kind: Literal["mode"] = "mode"
    mode: Mode
    thinking: bool | None = None
    """Whether its turns think (a `send` may still say otherwise for one turn); None:
    `[loop] thinking`."""
    model: str | None = None
    """The `[models.NAME]` its turns run on; None: the default model. Where it changes, the
    next request renders the whole conversation with the new model's template, and what that
    request computes is the change's cost, not a cache loss (docs/cache.md)."""


HookEvent = Literal["pre_tool_use", "post_tool_use", "user_prompt_submit", "stop"]
"""The points of a turn where the user's hooks run (`[hooks]`, docs/hooks.md)."""


class HookRecord(_Record):
    """One run of a hook (`[hooks]`): what ran, for which event, and how it ended. Produces no
    message, but for `feedback`: a stop hook's reason to go on, which the model reads as a user
    message after its answer. Never the hook's environment."""

    kind: Literal["hook"] = "hook"
    event: HookEvent
    command: tuple[str, ...]
    """Its command line, as the config gives it."""
    call: int | None = None
    """The call it ran for (tool events): the number its result carries."""
    tool: str | None = None
    """That call's tool, as the hook's `matcher` saw it."""
    status: int | None
    """Its exit status (0 went on, 2 blocked, any other an error that blocked nothing),
    negative where a signal killed it; None: it did not start, or was killed at its timeout."""
    seconds: float
    """How long it ran."""
    stdout: str = ""
    """The first 2,000 characters of its stdout."""
    stderr: str = ""
    """The first 2,000 characters of its stderr."""
    error: str | None = None
    """Why it did not start, or that it was killed at its timeout."""
    feedback: str | None = None
    """A stop hook that exited 2: the user message that sends the model back to work."""


PlanStatus = Literal["pending", "in_progress", "completed"]


class PlanStep(BaseModel):
    """One step of the model's plan."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: str
    status: PlanStatus


class PlanRecord(_Record):
    """The model set its plan (an `update_plan` call): the whole plan, which holds from here
    until the next. Produces no message: the call and its result carry it to the model."""

    kind: Literal["plan"] = "plan"
    call: int
    tool_call_id: str
    explanation: str | None = None
    steps: tuple[PlanStep, ...]
    """In order; at most one `in_progress`."""


class TurnEndRecord(_Record):
    kind: Literal["turn_end"] = "turn_end"
    reason: TurnEndReason


Record = Annotated[
    SessionHeader
    | UserRecord
    | AssistantRecord
    | UsageRecord
    | CacheLossRecord
    | ToolResultRecord
    | TurnEndRecord
    | PromptRecord
    | ApprovalRequestRecord
    | ApprovalRecord
    | SummaryRecord
    | ContinuedRecord
    | FileChangeRecord
    | UndoRecord
    | McpServersRecord
    | ModeRecord
    | UnreadRecord
    | PlanRecord
    | HookRecord,
    Discriminator("kind"),
]
RECORD: TypeAdapter[Record] = TypeAdapter(Record)
"""Reads one line of a log: `RECORD.validate_json(line)`."""


def dump(record: Record) -> bytes:
    """One log line, newline included. Field names as in the log (`class`, not `data_class`)."""
    return record.model_dump_json(by_alias=True).encode() + b"\n"


def conversation_problems(records: list[Record]) -> list[str]:
    """What makes a log not a valid conversation: tool calls left without results before the
    next message or the end of their turn, results that answer no call, a turn without its end.
    Empty for a good log. (Ids are counted, not just collected: a model may repeat one.)"""
    problems: list[str] = []
    open_calls: Counter[str] = Counter()
    for number, record in enumerate(records, start=2):
        if isinstance(record, (UserRecord, AssistantRecord, TurnEndRecord)) and +open_calls:
            problems.append(f"record {number}: calls left without results: {sorted(+open_calls)}")
            open_calls = Counter()
        if isinstance(record, AssistantRecord):
            open_calls = Counter(c.id for c in record.tool_calls)
        elif isinstance(record, ToolResultRecord):
            if open_calls[record.tool_call_id] <= 0:
                problems.append(
                    f"record {number}: a result for no open call {record.tool_call_id!r}"
                )
            open_calls[record.tool_call_id] -= 1
    users = sum(isinstance(r, UserRecord) for r in records)
    ends = sum(isinstance(r, TurnEndRecord) for r in records)
    if ends not in (users, users - 1):  # the last turn may still be running
        problems.append(f"{users} user messages but {ends} turn ends")
    return problems


def granted_tools(records: Sequence[Record]) -> frozenset[str]:
    """Tools a person approved for the rest of the session."""
    return frozenset(
        r.tool for r in records if isinstance(r, ApprovalRecord) and r.decision == "session"
    )


def current_plan(records: Sequence[Record]) -> PlanRecord | None:
    """The session's plan: the last one the model set (None: it set none)."""
    return next((r for r in reversed(records) if isinstance(r, PlanRecord)), None)


def stricter(a: Mode, b: Mode) -> Mode:
    """The mode that allows less of the two."""
    return max(a, b, key=_LOOSEST_FIRST.index)


def open_approvals(records: Sequence[Record]) -> list[ApprovalRequestRecord]:
    """Approvals asked for and not decided: the call still waits (or loopd stopped while it did)."""
    decided = {r.call for r in records if isinstance(r, ApprovalRecord)}
    return [r for r in records if isinstance(r, ApprovalRequestRecord) and r.call not in decided]
