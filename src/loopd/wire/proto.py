"""The channel's wire messages: JSON lines over a Unix socket, one object per line with a
`type`. docs/protocol.md shows each with an example; `loopd.wire.proto.json_schema()` is the schema.

The protocol version is `PROTOCOL`. A field added later gets a default, so older clients and
daemons keep understanding each other; anything else raises `PROTOCOL`. The daemon still
serves clients of `OLDEST_PROTOCOL` and later, each as its version says.

Every client message may carry a `ref` of the client's, and every line that answers it
carries the same `ref` back (the events of a turn, the `ref` of the `send` or `compact` that
started it, to that client alone): a client matches answers to requests by it. A line with
no `ref` leaves the field out, so a client that sends none reads what it always read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, TypeAdapter, model_validator

from loopd.session.records import Decision, FailureKind, InstructionFile, Mode, UsageRecord
from loopd.session.store import SessionInfo as StoredSession
from loopd.session.store import Unreadable as StoredUnreadable
from loopd.session.store import WriteFault
from loopd.wire import OLDEST_PROTOCOL, PROTOCOL
from loopd.wire.events import PlanUpdate, TurnEvent

__all__ = [
    "CLIENT_MESSAGE",
    "DAEMON_MESSAGE",
    "HISTORY_PAGE",
    "OLDEST_PROTOCOL",
    "PROTOCOL",
    "Accepted",
    "Approve",
    "Approved",
    "Bye",
    "Cancel",
    "ClientMessage",
    "Compact",
    "Context",
    "ContextParts",
    "ContextRequest",
    "DaemonMessage",
    "Error",
    "Event",
    "ForkSession",
    "Hello",
    "History",
    "HistoryRequest",
    "McpServer",
    "ModeChanged",
    "ModeSet",
    "NewSession",
    "OpenSession",
    "Rewind",
    "Send",
    "SessionFailed",
    "SessionFault",
    "SessionInfo",
    "Sessions",
    "SessionsRequest",
    "SetMode",
    "SlotInfo",
    "Status",
    "StatusRequest",
    "Subscribe",
    "ToolShown",
    "TurnDone",
    "TurnFailed",
    "Undo",
    "Undone",
    "Unreadable",
    "Usage",
    "Welcome",
    "dump",
    "json_schema",
]

SessionFault = WriteFault | Literal["error"]
"""Why a session failed: its log could not be written, or `error`, a bug in loopd."""

HISTORY_PAGE = 500
"""Records in one `history` answer at most."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)


class _Request(_Message):
    """A client message: any may name itself."""

    ref: str | None = Field(default=None, min_length=1, max_length=200)
    """Chosen by the client (protocol 3): every answer to this message carries it back, and
    so does every line of the turn it starts, to this client."""


class _Answer(_Message):
    """A daemon message that answers a request (or belongs to the turn one started)."""

    ref: str | None = Field(default=None, exclude_if=lambda ref: ref is None)
    """The `ref` of the request it answers (for an event, of the `send` or `compact` that
    started the turn), for the client that sent it; absent where that gave none, and on what
    another client's turn shows a subscriber."""


# -- client to daemon ------------------------------------------------------------------------


class McpServer(_Message):
    """An MCP server that a client gives the session it goes into (an editor's own), a
    program over stdio (`command`) or a server at a `url`: loopd runs it or connects to it
    for that session, whose model alone is offered its tools, named `<name>.<tool>`, until
    the session stops (docs/editors.md)."""

    name: str = Field(min_length=1, max_length=200)
    """Refused (not started) when `[tools] mcp`, loopd's own tools or an earlier server of
    the same list have it already."""
    command: list[str] | None = Field(default=None, min_length=1)
    """Its command line; it runs as the user, unsandboxed. This or `url`."""
    env: dict[str, str] = {}
    """With `command`: variables added to loopd's environment for it; never written to the
    log."""
    url: str | None = Field(default=None, pattern=r"^https?://", max_length=4096)
    """The http:// or https:// URL of a server that runs elsewhere. This or `command`."""
    transport: Literal["http", "sse"] = "http"
    """With `url`: `http`, streamable HTTP; `sse`, the older HTTP with server-sent events."""
    headers: dict[str, str] = Field(default={}, repr=False)
    """With `url`: headers sent with every request to it; never written to the log."""

    @model_validator(mode="after")
    def _one_way_in(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server has a command or a url, not both or neither")
        return self


McpServers = Annotated[list[McpServer], Field(max_length=64)]


class Hello(_Request):
    """Optional first line; the daemon answers `welcome`. A client that sends none is in the
    latest session from its first message on."""

    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL
    client: str = ""
    """The client's name and version, for the daemon's log."""
    session: str = Field(default="latest", min_length=1, max_length=200)
    """The session this client's messages go to: a session id, `latest`, or `new`."""
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    """With `new`: the one folder the new session's file tools work in (an absolute path
    inside one of `[tools] roots`); without it, they work in all of `[tools] roots`."""
    mcp_servers: McpServers = []
    """MCP servers for this session alone, started as it goes live; a session live already
    keeps those it has, and these are not started."""
    discard_if_empty: bool = False
    """With `new`: remove the new session once every client has left it, if nothing was said
    in it (a chat quit before its first message). For a client that makes a session to talk
    in at once; never for one another process may prompt later (an editor's, acpx's)."""
    follow: bool = False
    """With a session id: go on where that session's conversation went on last, following its
    `continued` records (a rewind's fork, a compaction's continuation) to the newest session;
    `welcome` names the one opened. An editor's id stands for its session so."""


class Send(_Request):
    """A user message. It runs now or waits in order; `accepted` gives its place."""

    type: Literal["send"] = "send"
    id: str = Field(min_length=1, max_length=200)
    """Chosen by the client; every line about this turn carries it."""
    content: str
    thinking: bool | None = None
    """Let the model reason in this turn; absent: the daemon's `[loop] thinking`."""


class Compact(_Request):
    """Go on in a new session that starts from the model's summary of this one. It runs like
    a turn, by its `id`: `accepted`, then `compacting` and `session_continued` events, then
    `turn_done` with the summary as its content (or `turn_failed`)."""

    type: Literal["compact"] = "compact"
    id: str = Field(min_length=1, max_length=200)


class Cancel(_Request):
    """Cancel a running or waiting turn of this client's."""

    type: Literal["cancel"] = "cancel"
    id: str


class StatusRequest(_Request):
    type: Literal["status"] = "status"


class ContextRequest(_Request):
    """What the model of this session sees, and how full its context is; answered with
    `context`."""

    type: Literal["context"] = "context"


class Subscribe(_Request):
    """See every turn of the session from now on, whoever sent it (including a running one)."""

    type: Literal["subscribe"] = "subscribe"


class NewSession(_Request):
    """This client goes on in a fresh session (other clients stay where they are; a turn it
    left running goes on); answered with `welcome`."""

    type: Literal["new_session"] = "new_session"
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    """As `hello`'s: the one folder the new session's file tools work in."""
    mcp_servers: McpServers = []
    """As `hello`'s."""
    discard_if_empty: bool = False
    """As `hello`'s."""


class OpenSession(_Request):
    """This client goes on in another session, as `new_session` does; answered with
    `welcome`. A session other clients are in is shared with them; one nobody is in has its
    cache back from its slot file when it next needs a slot."""

    type: Literal["open_session"] = "open_session"
    id: str = Field(min_length=1, max_length=200)
    """A session id, or `latest`."""
    mcp_servers: McpServers = []
    """As `hello`'s."""
    follow: bool = False
    """As `hello`'s."""


class ForkSession(_Request):
    """This client goes on in a new session, the fork of `session` at the end of its turn
    `at`: its history is that session's up to there (its header says `forked_from` and
    `at`), and the forked session is left as it is. Answered with `welcome`, as
    `open_session`; refused (`fork_refused`) at a turn that does not exist or still runs, or
    for a sub-agent's session. The fork's first request extends what the forked session's
    slot held: it is served from that slot, or from its slot file, costing only its new
    message (docs/operations.md, "Forks")."""

    type: Literal["fork_session"] = "fork_session"
    session: str | None = Field(default=None, min_length=1, max_length=200)
    """The session to fork; absent: the client's own."""
    at: int | None = Field(default=None, ge=1)
    """The turn (1 is the first) whose end the fork starts from; absent: the latest."""


class Rewind(_Request):
    """This client goes on from an earlier point of its session: in a new fork of it at the
    end of turn `at` (as `fork_session`; the session's log stays as it is). With `files`, what
    the later turns changed is put back first, every file as it was at that turn's end, through
    the undo store; a file changed since outside loopd refuses it (`undo_refused`, naming the
    file), and then nothing is put back and no fork is made. Answered with `undone` (when
    files were put back) and then `welcome`; refused as `fork_session` and `undo` are, and
    (`busy`) while a turn runs and `files` is asked."""

    type: Literal["rewind"] = "rewind"
    at: int = Field(ge=1)
    """The turn (1 is the first) whose end the session goes on from."""
    files: bool = False


class SessionsRequest(_Request):
    type: Literal["sessions"] = "sessions"


class HistoryRequest(_Request):
    """The records of the current session, or those from `start` (inclusive; negative counts
    from the end, so -20 is the last twenty) to `end`."""

    type: Literal["history"] = "history"
    start: int | None = None
    end: int | None = None


class Approve(_Request):
    """Answer a call that waits for approval (an `approval_needed` event, or `status`)."""

    type: Literal["approve"] = "approve"
    call: int
    """The session's number for the call."""
    session: str | None = None
    """For a call of a sub-agent of this session: the sub-agent's session (as its
    `approval_needed` event names it)."""
    decision: Decision
    """`once`: run it; `session`: run it, and this tool from now on in this session without
    asking; `deny`: do not run it."""


class Undo(_Request):
    """Put back what the model changed: the files of call `call`, or (without one) of the
    last turn that changed files and was not undone. Refused, changing nothing, while a turn
    runs or when a file changed since; answered with `undone`."""

    type: Literal["undo"] = "undo"
    call: int | None = None


class SetMode(_Request):
    """Set the session's mode and whether its turns think; answered with `mode`, which a
    `set_mode` with neither field only asks for. Written to the session's log (a `mode`
    record), so it holds when the session is opened again, and for the sessions that continue
    it and its sub-agents. A running turn's next tool call is decided by the new mode."""

    type: Literal["set_mode"] = "set_mode"
    mode: Mode | None = None
    """`ask`, `accept_edits` or `read_only` (docs/editors.md, "Modes"); absent: as it is."""
    thinking: bool | None = None
    """Whether its turns think (a `send`'s `thinking` still decides for its own turn);
    absent: as it is."""
    model: str | None = None
    """The model its turns run on, one of the answer's `models` (`[models.NAME]`); absent: as
    it is. Refused with `unknown_model` where loopd serves none of that name, and with `busy`
    while a turn runs."""


ClientMessage = Annotated[
    Hello
    | Send
    | Compact
    | Cancel
    | StatusRequest
    | ContextRequest
    | Subscribe
    | NewSession
    | OpenSession
    | ForkSession
    | Rewind
    | SessionsRequest
    | HistoryRequest
    | Approve
    | Undo
    | SetMode,
    Discriminator("type"),
]
CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)


# -- daemon to client ------------------------------------------------------------------------


class Welcome(_Answer):
    type: Literal["welcome"] = "welcome"
    protocol: int = PROTOCOL
    """The version this connection speaks: its `hello`'s (`OLDEST_PROTOCOL` or later), else
    the daemon's."""
    daemon: str
    """loopd's version."""
    session: str
    """The session turns go to."""
    instructions: list[str] = []
    """The paths of the `AGENTS.md` files its system prompt carries, read when it was made."""
    cwd: str | None = None
    """The session's own folder (its file tools work there); None: `[tools] roots`."""


class Accepted(_Answer):
    """A `send` was taken: `position` 0 runs now, 1 waits for one turn, and so on."""

    type: Literal["accepted"] = "accepted"
    id: str
    position: int


class Event(_Answer):
    type: Literal["event"] = "event"
    id: str
    """The turn's id, as its client chose it."""
    event: TurnEvent


class Usage(_Message):
    """What the turn's last request cost."""

    prompt_n: int | None
    cache_n: int | None
    predicted_n: int | None
    prompt_ms: float | None
    predicted_ms: float | None
    reasoning_tokens: int
    thinking_capped: bool

    @classmethod
    def of(cls, usage: UsageRecord | None) -> Usage | None:
        if usage is None:
            return None
        t = usage.timings
        return cls(
            prompt_n=t.prompt_n if t else None,
            cache_n=t.cache_n if t else None,
            predicted_n=t.predicted_n if t else None,
            prompt_ms=t.prompt_ms if t else None,
            predicted_ms=t.predicted_ms if t else None,
            reasoning_tokens=usage.reasoning_tokens,
            thinking_capped=usage.thinking_capped,
        )


class TurnDone(_Answer):
    type: Literal["turn_done"] = "turn_done"
    id: str
    content: str
    usage: Usage | None


class TurnFailed(_Answer):
    type: Literal["turn_failed"] = "turn_failed"
    id: str
    kind: FailureKind
    message: str


class SessionFailed(_Message):
    """The session's log could not be written (or a bug ended its actor), so loopd closed the
    session; every other
    session goes on. Each of its turns, running or waiting, then ends with `turn_failed`. The
    client stays in it, and what it sends is answered `session_unavailable`, until it opens it
    again (`open_session` with its id, or `hello`), which works once the cause is gone."""

    type: Literal["session_failed"] = "session_failed"
    session: str
    fault: SessionFault
    """`disk_full`, `read_only` (loopd may no longer write there), `io_error`, `other`; or
    `error`: a bug in loopd ended the session's actor (its traceback is in loopd's log)."""
    message: str
    """What happened: `the disk is full: ...`, with the system's error."""


class SlotInfo(_Message):
    server: str
    """The llama-server it is a slot of."""
    slot: int
    session: str | None
    """The session whose cache it holds; None: free."""
    tokens: int | None
    """Tokens it holds, as far as loopd knows."""
    model: str | None = None
    """The `[models.NAME]` its server serves; None: loopd serves one unnamed model."""
    busy: bool
    """A turn (or a summary) runs on it."""


class Status(_Answer):
    type: Literal["status"] = "status"
    session: str
    server: str
    """The server loopd talks to (several: comma-separated)."""
    model: str | None
    session_model: str | None = None
    """The `[models.NAME]` this session runs on; None: loopd serves one unnamed model."""
    engine: str | None = None
    """What serves the model: `llama` (llama-server), `vllm`, `openai` (any
    OpenAI-compatible server); None: not known yet (the server has not answered)."""
    slot: int | None
    """The slot that holds this session's cache, if one does."""
    busy: bool
    """A turn is running."""
    queue: int
    """Messages waiting behind it."""
    turns: int
    last_usage: Usage | None
    context: int | None = None
    """Tokens the slot holds for this session after its last request."""
    context_size: int | None = None
    """Each slot's context window in tokens (`[server.managed] n_ctx`, or an external
    server's own, as it said when loopd started); None: it did not say."""
    past_reasoning: int | None = None
    """Of those, reasoning of earlier answers, sent back as generated (token-exact history);
    None when history went as messages, where the chat template decides what stays."""
    pending: list[Event] = []
    """Calls that wait for approval: each the `approval_needed` event that asked."""
    slots: list[SlotInfo] = []
    """Every slot of the pool."""
    plan: PlanUpdate | None = None
    """The model's plan, as its last `update_plan` set it (the `plan` event that told it),
    kept in the session's log; None: it has set none."""


class ToolShown(_Message):
    """A tool the model can use."""

    name: str
    summary: str
    """One line: what it does."""
    found: bool
    """True: behind `find_tool` and `call_tool` (the model finds it by searching, and calls it
    through `call_tool`); False: offered to the model directly."""
    source: str
    """`loopd` for the two it is offered, `builtin`, or the MCP server's name."""


class ContextParts(_Message):
    """The tokens the slot holds, by part; they add up to `context`'s `tokens`."""

    start: int
    """The first prompt: the system prompt, the tool definitions and the first message."""
    messages: int
    """The user's messages since, each with the chat template's markers."""
    tool_results: int
    """The tool results since, with their markers."""
    answers: int
    """The model's answers (text and tool calls), their reasoning aside."""
    reasoning: int
    """The reasoning of those answers, kept as generated (past reasoning)."""


class Context(_Answer):
    """The answer to `context`: what the session's model sees (its system prompt, the
    `AGENTS.md` files in it, its tools) and how its context is filled."""

    type: Literal["context"] = "context"
    session: str
    system_prompt: str
    """The whole system prompt, the `AGENTS.md` files' block included."""
    instructions: list[InstructionFile]
    """The `AGENTS.md` files the system prompt carries, as read when the session was made."""
    tools: list[ToolShown]
    """`find_tool` and `call_tool`, offered; then every tool found through them."""
    tokens: int | None
    """Tokens the slot holds after the last request, as the server counted them; None before
    the first request."""
    context_size: int | None
    """The context window in tokens (as `status`'s); None: the server did not say."""
    parts: ContextParts | None
    """`tokens` by part, from each request's figures; None before the first request."""
    exact: bool
    """`parts` are the server's counts (token-exact history); false where history went as
    messages (the chat template may drop past reasoning), a server did not report its cache,
    or a request reported nothing."""


class Approved(_Answer):
    """An `approve` was taken: the call runs, or is denied, now."""

    type: Literal["approved"] = "approved"
    call: int
    session: str | None = None
    """As in the `approve`."""
    decision: Decision


class SessionInfo(_Message):
    id: str
    created: str
    turns: int
    last_activity: str
    continues: str | None = None
    """The session this one continues (it began from a summary of it)."""
    parent: str | None = None
    """For a sub-agent's session: the session that delegated to it."""
    cwd: str | None = None
    """The one folder its file tools work in (`hello`'s `cwd`); None: all of `[tools] roots`."""
    title: str | None = None
    """Its first user message's first line, at most 80 characters; None before the first."""
    forked_from: str | None = None
    """The session this one is a fork of (a `fork_session` or a `rewind`)."""
    at: int | None = None
    """For a fork: the turn of `forked_from` whose end it starts from."""

    @classmethod
    def of(cls, info: StoredSession) -> SessionInfo:
        """A session of the store, as the wire says it."""
        return cls(
            id=info.id,
            created=info.created.isoformat(),
            turns=info.turns,
            last_activity=info.last_activity.isoformat(),
            continues=info.continues,
            parent=info.parent,
            cwd=info.cwd,
            title=info.title,
            forked_from=info.forked_from,
            at=info.at,
        )


class Unreadable(_Message):
    """A log in the store that does not read as a session: it is not in `sessions`."""

    id: str
    reason: str
    """Which line, and what is wrong there: `line 1: not a record: Invalid JSON: ...`."""

    @classmethod
    def of(cls, log: StoredUnreadable) -> Unreadable:
        return cls(id=log.id, reason=log.reason)


class Undone(_Answer):
    """An `undo` was done: these calls' changes are put back in these files."""

    type: Literal["undone"] = "undone"
    calls: list[int]
    paths: list[str]


class ModeSet(_Answer):
    """The answer to `set_mode`: the session's mode now."""

    type: Literal["mode"] = "mode"
    session: str
    mode: Mode
    """What its tool calls may do (a running sub-agent's: the stricter of its own and its
    parent's)."""
    thinking: bool
    """Whether its turns think (where no `set_mode` said: `[loop] thinking`)."""
    model: str | None = None
    """The model its turns run on (where no `set_mode` said: `[session] model`, else the
    first `[models.NAME]`); None: loopd serves one unnamed model."""
    models: list[str] = []
    """The models `set_mode` may choose between; empty: loopd serves one."""


class ModeChanged(_Message):
    """Another client of the session changed its mode, thinking or model (`set_mode`): what
    they are now, as `mode` says them. Sent to every client in the session but the one that
    asked (which has its `mode` answer), whether or not it subscribed."""

    type: Literal["mode_changed"] = "mode_changed"
    session: str
    mode: Mode
    thinking: bool
    model: str | None = None
    models: list[str] = []


class Sessions(_Answer):
    type: Literal["sessions"] = "sessions"
    sessions: list[SessionInfo]
    current: str | None
    """The client's session; None: it is in none yet (it asked before any `hello`, and
    asking does not put it in one)."""
    unreadable: list[Unreadable] = []
    """The logs that do not read, each with why (none: every log reads)."""


class History(_Answer):
    type: Literal["history"] = "history"
    session: str
    start: int
    records: list[dict[str, Any]]
    """As in the log: each with `kind` and `time`."""


ErrorCode = Literal[
    "bad_utf8",
    "bad_json",
    "not_object",
    "unknown_type",
    "bad_message",
    "line_too_long",
    "busy",
    "undo_refused",
    "fork_refused",
    "folder_refused",
    "unknown_turn",
    "duplicate_id",
    "too_many_sessions",
    "lagged",
    "unknown_session",
    "session_unavailable",
    "unknown_call",
    "protocol",
    "too_many_clients",
    "unknown_model",
]
"""Every error's `code`, as protocol.md's table lists them."""


class Error(_Answer):
    """Something the client sent could not be done; the connection stays open unless said."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    id: str | None = None
    """The turn it concerns, if any."""


class Bye(_Message):
    """The daemon closes the connection; nothing follows."""

    type: Literal["bye"] = "bye"
    reason: str


DaemonMessage = Annotated[
    Welcome
    | Accepted
    | Event
    | TurnDone
    | TurnFailed
    | SessionFailed
    | Status
    | Context
    | Sessions
    | History
    | Approved
    | Undone
    | ModeSet
    | ModeChanged
    | Error
    | Bye,
    Discriminator("type"),
]
DAEMON_MESSAGE: TypeAdapter[DaemonMessage] = TypeAdapter(DaemonMessage)


def dump(message: _Message) -> bytes:
    """One line of the channel, newline included."""
    return message.model_dump_json(by_alias=True, exclude_none=False).encode() + b"\n"


def json_schema(direction: Literal["client", "daemon"]) -> dict[str, Any]:
    """The JSON Schema of the lines one side sends (docs/protocol-*.schema.json)."""
    adapter: TypeAdapter[Any] = CLIENT_MESSAGE if direction == "client" else DAEMON_MESSAGE
    who = "client to daemon" if direction == "client" else "daemon to client"
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"loopd channel protocol {PROTOCOL}: {who}",
        **adapter.json_schema(by_alias=True),
    }
