"""loopd's events, records and ends of turns as the Agent Client Protocol says them.

Pure functions from loopd's types to the `agent-client-protocol` package's models: what a
turn streams (`session/update`), what a loaded session replays, how a turn ends (the stop
reason and the usage), and what a call waiting for approval asks the editor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from acp import schema

from bxctl.oneshot import plan_lines
from bxctl.text import title_of, turns_text
from bxctl.user_commands import UserCommand
from loopd.infer import Content, Reasoning
from loopd.session.records import (
    AssistantRecord,
    Decision,
    PlanRecord,
    Record,
    ToolResultRecord,
    UserRecord,
)
from loopd.session.transcript import CUT_BY
from loopd.wire.events import (
    AgentUpdate,
    ApprovalNeeded,
    FileChange,
    MovedToServer,
    PlanUpdate,
    ToolCallStarted,
    ToolResult,
    WaitingForServer,
)
from loopd.wire.proto import McpServer, SessionInfo, Status, TurnFailed, Undone, Usage

__all__ = [
    "COMMANDS",
    "LIST_PAGE",
    "BadCursor",
    "Command",
    "EditorServer",
    "NotOffered",
    "UnsupportedServer",
    "Update",
    "command_of",
    "commands_update",
    "decision_of",
    "listed",
    "mcp_servers",
    "output_update",
    "permission_request",
    "plan_update",
    "replayed",
    "rewound_text",
    "status_text",
    "stop_reason",
    "text_of",
    "undone_text",
    "update_of",
    "usage_of",
    "usage_update",
]

Update = (
    schema.AgentMessageChunk
    | schema.AgentThoughtChunk
    | schema.UserMessageChunk
    | schema.ToolCallStart
    | schema.ToolCallProgress
    | schema.AvailableCommandsUpdate
    | schema.UsageUpdate
    | schema.AgentPlanUpdate
    | schema.ConfigOptionUpdate
    | schema.SessionInfoUpdate
)

COMMANDS = [
    schema.AvailableCommand(
        name="compact",
        description="Go on in a new session that starts from the model's summary of this one",
    ),
    schema.AvailableCommand(
        name="undo",
        description="Put back the files the last turn changed (or call N's alone)",
        input=schema.AvailableCommandInput(
            root=schema.UnstructuredCommandInput(hint="N: one call's changes (optional)")
        ),
    ),
    schema.AvailableCommand(
        name="rewind",
        description="Go on from the end of an earlier turn, in a fork (alone: the turns to pick "
        "from)",
        input=schema.AvailableCommandInput(
            root=schema.UnstructuredCommandInput(
                hint="N: from turn N; N files: and put back what the later turns changed"
            )
        ),
    ),
    schema.AvailableCommand(
        name="status",
        description="What loopd is doing: the model, the context, the slot, waiting approvals",
    ),
]
"""loopd's commands an editor offers; a prompt that is one of them (`/compact`) runs it."""

Command = tuple[str, list[str]]
"""A command's name and the words after it."""

_KINDS: dict[str, schema.ToolKind] = {
    "read_file": "read",
    "list_directory": "read",
    "search_text": "search",
    "find_files": "search",
    "find_tool": "search",
    "write_file": "edit",
    "edit_file": "edit",
    "run_command": "execute",
    "current_time": "other",
    "delegate": "think",
    "update_plan": "think",
}
_FAILED = ("The tool failed: ", "The call was denied: ", "Not run: ")
"""How a result the model reads starts when the call did not run to an answer."""

# Each option's id is the loopd `approve` decision it stands for.
_OPTIONS = [
    schema.PermissionOption(option_id="once", name="Allow once", kind="allow_once"),
    schema.PermissionOption(
        option_id="session", name="Allow always (this session)", kind="allow_always"
    ),
    schema.PermissionOption(option_id="deny", name="Reject", kind="reject_once"),
]

# What a turn's failure is to the editor: a stop reason, or (None) a JSON-RPC error.
_STOPS: dict[str, schema.StopReason | None] = {
    "cancelled": "cancelled",
    "turn_limit": "max_turn_requests",
    "session_full": "max_tokens",
    "infer": None,
    "error": None,
}


def _text(text: str) -> schema.TextContentBlock:
    return schema.TextContentBlock(type="text", text=text)


ToolContent = list[
    schema.ContentToolCallContent | schema.FileEditToolCallContent | schema.TerminalToolCallContent
]


def _content(text: str) -> ToolContent:
    return [schema.ContentToolCallContent(type="content", content=_text(text))]


SHOWN_OUTPUT = 8_000
"""Characters of a running command's output one update carries at most: its tail, as a
terminal shows it. Each update replaces the last, so the whole output every time would cost
the editor the square of a long command's output."""


def output_update(call: int, output: str) -> schema.ToolCallProgress:
    """A running command's output so far as its call's content (an update replaces the content
    it had): a fenced block, which an editor shows as it is, not as markdown; past
    `SHOWN_OUTPUT`, its last whole lines. ACP's `terminal` content is no fit: it shows a
    terminal the editor runs, at the agent's request."""
    if len(output) > SHOWN_OUTPUT:
        tail = output[-SHOWN_OUTPUT:]
        tail = tail[tail.find("\n") + 1 :]
        output = f"[... {len(output) - len(tail)} characters above]\n{tail}"
    longest = max((len(run) for run in re.findall("`+", output)), default=0)
    fence = "`" * max(3, longest + 1)  # no run of backticks in the output closes it
    shown = output.removesuffix("\n")
    return schema.ToolCallProgress(
        session_update="tool_call_update",
        tool_call_id=str(call),
        status="in_progress",
        content=_content(f"{fence}\n{shown}\n{fence}"),
    )


def _diff(change: FileChange) -> ToolContent:
    """A write's change as ACP's `diff`, which an editor shows as its own reviewable diff."""
    diff = schema.FileEditToolCallContent(
        type="diff", path=change.path, old_text=change.old_text, new_text=change.new_text
    )
    return [diff]


def kind_of(tool: str | None) -> schema.ToolKind:
    if tool is None:
        return "other"
    return _KINDS.get(tool.rsplit(".", 1)[-1], "other")  # an MCP tool by its own name


def _status(result: str) -> schema.ToolCallStatus:
    return "failed" if result.startswith(_FAILED) else "completed"


def update_of(event: object, session: str) -> Update | None:
    """The `session/update` a live event of a turn in loopd session `session` is, if the
    editor shows it. A sub-agent's progress shows in the `delegate` call that started it."""
    if isinstance(event, AgentUpdate):
        return _agent_progress(event) if event.parent == session else None
    if isinstance(event, Reasoning | WaitingForServer | MovedToServer):
        # A wait for the server, or a move to another, is told as a thought, not as the
        # answer: the editor shows it, and the message the model then writes stays its own.
        text = event.text if isinstance(event, Reasoning) else f"({event.said()})\n"
        return schema.AgentThoughtChunk(session_update="agent_thought_chunk", content=_text(text))
    if isinstance(event, Content):
        return schema.AgentMessageChunk(
            session_update="agent_message_chunk", content=_text(event.text)
        )
    if isinstance(event, ToolCallStarted | PlanUpdate | ToolResult):
        return _call_update(event)
    return None


def _call_update(event: ToolCallStarted | PlanUpdate | ToolResult) -> Update:
    """A call as it starts, the plan an `update_plan` call set, a call's result."""
    if isinstance(event, ToolCallStarted):
        tool = event.tool or event.name
        return schema.ToolCallStart(
            session_update="tool_call",
            tool_call_id=str(event.call),
            title=tool,
            kind=kind_of(tool),
            status="in_progress",
        )
    if isinstance(event, PlanUpdate):
        return plan_update(event)
    return schema.ToolCallProgress(
        session_update="tool_call_update",
        tool_call_id=str(event.call),
        status=_status(event.preview),
        # A write that was made shows as the editor's own diff, the summary beside it.
        content=_content(event.preview) + (_diff(event.change) if event.change else []),
    )


def plan_update(plan: PlanUpdate) -> schema.AgentPlanUpdate:
    """The model's plan as ACP's: the whole plan, which the editor puts in the place of the
    last. loopd's steps have no priority, so each is `medium`; the explanation is not ACP's."""
    entries = [
        schema.PlanEntry(content=step.step, priority="medium", status=step.status)
        for step in plan.steps
    ]
    return schema.AgentPlanUpdate(session_update="plan", entries=entries)


def _agent_progress(agent: AgentUpdate) -> schema.ToolCallProgress:
    said = f"sub-agent {agent.session}: {agent.state}, {agent.tool_calls} tool calls, "
    said += f"{agent.tokens} tokens"
    if agent.tool:
        said += f", last {agent.tool}"
    if agent.detail:
        said += f" ({agent.detail})"
    return schema.ToolCallProgress(
        session_update="tool_call_update",
        tool_call_id=str(agent.call),
        status="in_progress" if agent.state == "running" else None,
        content=_content(said),
    )


def permission_request(session: str, asking: ApprovalNeeded) -> schema.RequestPermissionRequest:
    """What the editor is asked for a call that waits for approval: the call, with what it
    would do (a write's or an edit's diff, a command with its folder) when loopd can say."""
    detail = asking.preview or json.dumps(asking.arguments, indent=2, ensure_ascii=False)
    title = asking.tool if asking.session is None else f"{asking.tool} (sub-agent {asking.session})"
    return schema.RequestPermissionRequest(
        session_id=session,
        tool_call=schema.ToolCallUpdate(
            tool_call_id=str(asking.call),
            title=title,
            kind=kind_of(asking.tool),
            status="pending",
            raw_input=asking.arguments,
            content=_diff(asking.change) if asking.change else _content(detail),
        ),
        options=_OPTIONS,
    )


def decision_of(option_id: str | None) -> Decision:
    """The `approve` decision of the option the editor chose; `deny` for none (a cancelled
    request) or one that is not ours."""
    for option in _OPTIONS:
        if option.option_id == option_id:
            return option.option_id  # type: ignore[return-value] # one of Decision, above
    return "deny"


def stop_reason(failed: TurnFailed) -> schema.StopReason | None:
    """How a failed turn ended, as a stop reason; None: it is an error to the editor."""
    return _STOPS[failed.kind]


def usage_of(usage: Usage | None) -> schema.Usage | None:
    """The turn's last request: its whole prompt (cached or not), its answer."""
    if usage is None or usage.prompt_n is None or usage.predicted_n is None:
        return None
    cached = usage.cache_n or 0
    prompt = usage.prompt_n + cached
    return schema.Usage(
        input_tokens=prompt,
        output_tokens=usage.predicted_n,
        total_tokens=prompt + usage.predicted_n,
        cached_read_tokens=cached,
        thought_tokens=usage.reasoning_tokens or None,
    )


def commands_update(own: Sequence[UserCommand] = ()) -> schema.AvailableCommandsUpdate:
    """loopd's commands, then the user's and the project's own (`bxctl.user_commands`)."""
    listed = [
        schema.AvailableCommand(
            name=c.name,
            description=c.description or f"the text of {c.path}",
            input=schema.AvailableCommandInput(
                root=schema.UnstructuredCommandInput(hint=c.hint or "what $ARGUMENTS stands for")
            ),
        )
        for c in own
    ]
    return schema.AvailableCommandsUpdate(
        session_update="available_commands_update", available_commands=[*COMMANDS, *listed]
    )


def command_of(text: str) -> Command | None:
    """The command a prompt is (`/undo 3`), if it is one of `COMMANDS`; any other text, one
    that starts with another `/word` too, is a message for the model."""
    words = text.split()
    if not words or not words[0].startswith("/"):
        return None
    name = words[0][1:]
    if name not in {c.name for c in COMMANDS}:
        return None
    return name, words[1:]


def status_text(status: Status) -> str:
    """`/status`'s answer, in a few lines."""
    model = status.model or "a model it does not name"
    lines = [f"Session {status.session}: {turns_text(status.turns)}, {model} at {status.server}."]
    if status.context is not None:
        lines.append(f"Context: {status.context} tokens.")
    if status.slot is None:
        lines.append("No slot holds its cache now: it comes back from its slot file.")
    else:
        lines.append(f"Its cache is in slot {status.slot}.")
    if status.busy or status.queue:
        lines.append(f"A turn runs; {status.queue} wait behind it.")
    lines.extend(f"Waits for approval: {_asking(w.event)}." for w in status.pending)
    if status.plan is not None:
        lines += ["Plan:", *(f"  {line}" for line in plan_lines(status.plan))]
    return "\n".join(lines)


def _asking(event: object) -> str:
    if isinstance(event, ApprovalNeeded):
        return f"call {event.call}, {event.tool}"
    return "a call"


def undone_text(undone: Undone) -> str:
    """`/undo`'s answer: which calls' changes were put back, in which files."""
    calls = ", ".join(str(c) for c in undone.calls)
    paths = "\n".join(f"- {p}" for p in undone.paths) or "- (no files)"
    return f"Put back the changes of call{'s' * (len(undone.calls) > 1)} {calls}:\n{paths}"


def rewound_text(at: int, fork: str, parent: str, paths: list[str] | None) -> str:
    """`/rewind N`'s answer: where the session goes on (`fork`, of loopd session `parent`)
    and the files put back (`paths`; None: files were not asked for)."""
    said = f"Rewound to the end of turn {at}: the next prompt goes on from there, in loopd "
    said += f"session {fork} (a fork of {parent}, which keeps the later turns)."
    if paths is None:
        return f"{said}\nNo file was put back."
    if not paths:
        return f"{said}\nThe later turns changed no file: none was put back."
    return f"{said}\nPut back as they were at the end of turn {at}:\n" + "\n".join(
        f"- {p}" for p in paths
    )


LIST_PAGE = 50
"""Sessions in one `session/list` answer at most."""


EditorServer = (
    schema.McpServerStdio | schema.HttpMcpServer | schema.SseMcpServer | schema.AcpMcpServer
)


class UnsupportedServer(ValueError):
    """An MCP server the editor gave over a transport loopd does not run (acp)."""


def mcp_servers(servers: Sequence[EditorServer] | None) -> list[McpServer]:
    """The editor's MCP servers (`mcpServers`) as loopd's `mcp_servers`: over stdio, http or
    sse. Raises `UnsupportedServer` for one over acp: the capabilities `initialize` answered
    say loopd has none of those."""
    given = []
    for server in servers or ():
        if isinstance(server, schema.McpServerStdio):
            env = {variable.name: variable.value for variable in server.env}
            command = [server.command, *server.args]
            given.append(McpServer(name=server.name, command=command, env=env))
        elif isinstance(server, schema.HttpMcpServer | schema.SseMcpServer):
            headers = {header.name: header.value for header in server.headers}
            given.append(
                McpServer(name=server.name, url=server.url, transport=server.type, headers=headers)
            )
        else:
            raise UnsupportedServer(
                f"MCP server {server.name!r} is over {server.type}: loopd runs MCP servers over "
                "stdio, http and sse (its mcpCapabilities say acp is not supported)"
            )
    return given


class BadCursor(ValueError):
    """A `session/list` cursor that no answer of ours gave."""


def listed(
    sessions: Sequence[SessionInfo], cwd: str | None, cursor: str | None, page: int = LIST_PAGE
) -> tuple[list[schema.SessionInfo], str | None]:
    """One page of `session/list`, the latest activity first, and the cursor of the next page
    (None: this is the last). Listed: each session that has a folder (`cwd`, the filter's when
    one is given), that is not a sub-agent's and that no later session continues (the one
    that does stands for it, with the title of the session the chain began with). A session
    with no folder (made in the terminal, working in all of `[tools] roots`) has none to give
    and matches no filter: it is not listed. The cursor is the last session given, as
    `<updatedAt> <id>`: sessions made or active since do not shift the pages."""
    by_id = {s.id: s for s in sessions}
    continued = {s.continues for s in sessions if s.continues}
    folder = _folder(cwd) if cwd else None
    shown = [
        s
        for s in sessions
        if s.cwd
        and s.parent is None
        and s.id not in continued
        and (folder is None or _folder(s.cwd) == folder)
    ]
    shown.sort(key=_order, reverse=True)
    if cursor is not None:
        after = _after(cursor)
        shown = [s for s in shown if _order(s) < after]
    infos = [
        schema.SessionInfo(
            session_id=s.id,
            cwd=s.cwd,  # type: ignore[arg-type] # those with none are left out above
            title=title_of(s, by_id),
            updated_at=s.last_activity,
        )
        for s in shown[:page]
    ]
    if len(shown) <= page:
        return infos, None
    last = shown[page - 1]
    return infos, f"{last.last_activity} {last.id}"


def _folder(path: str) -> str:
    return os.path.normpath(path)


def _order(session: SessionInfo) -> tuple[datetime, str]:
    return datetime.fromisoformat(session.last_activity), session.id


def _after(cursor: str) -> tuple[datetime, str]:
    updated, _, session = cursor.partition(" ")
    try:
        return datetime.fromisoformat(updated), session
    except ValueError:
        raise BadCursor(f"{cursor!r} is not a cursor that session/list gave") from None


def usage_update(usage: Usage | None, size: int | None) -> schema.UsageUpdate | None:
    """Where the session stands after a turn's last request: the tokens its slot holds (the
    whole prompt and the answer) of the context window `size`; `_meta.loopd` gives that
    request's prompt and the part of it found in the cache. None when loopd does not know."""
    if usage is None or size is None or usage.prompt_n is None or usage.predicted_n is None:
        return None
    cached = usage.cache_n or 0
    prompt = usage.prompt_n + cached
    return schema.UsageUpdate(
        session_update="usage_update",
        used=prompt + max(usage.predicted_n - 1, 0),  # the last token is sampled, not held
        size=size,
        field_meta={"loopd": {"promptTokens": prompt, "cachedTokens": cached}},
    )


def replayed(records: Sequence[Record]) -> Iterator[Update]:
    """A session's history as the updates that would have shown it live: what was said, the
    reasoning, each call with its result, each plan the model set."""
    asked: dict[str, tuple[str, Any]] = {}
    """The model's id of each call: the tool it named and its arguments."""
    for record in records:
        if isinstance(record, UserRecord):
            yield schema.UserMessageChunk(
                session_update="user_message_chunk", content=_text(record.content)
            )
        elif isinstance(record, AssistantRecord):
            if record.reasoning_content:
                yield schema.AgentThoughtChunk(
                    session_update="agent_thought_chunk", content=_text(record.reasoning_content)
                )
            if record.content:
                yield schema.AgentMessageChunk(
                    session_update="agent_message_chunk", content=_text(record.content)
                )
            if record.cut is not None:  # marked as `bxctl log` marks it
                said = _text(f"\n\n(answer cut short: {CUT_BY[record.cut]})")
                yield schema.AgentMessageChunk(session_update="agent_message_chunk", content=said)
            for call in record.tool_calls:
                asked[call.id] = _named(call.name, call.arguments)
        elif isinstance(record, PlanRecord):
            yield plan_update(PlanUpdate.of(record))
        elif isinstance(record, ToolResultRecord):
            tool, arguments = asked.get(record.tool_call_id, (record.name, None))
            yield schema.ToolCallStart(
                session_update="tool_call",
                tool_call_id=str(record.call),
                title=tool,
                kind=kind_of(tool),
                status=_status(record.content),
                raw_input=arguments,
                content=_content(record.content),
            )


def _named(name: str, arguments: str) -> tuple[str, Any]:
    """The tool a call is for (`call_tool` names it in its arguments) and its arguments."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return name, arguments
    if name == "call_tool" and isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
        return parsed["name"], parsed.get("arguments")
    return name, parsed


class NotOffered(ValueError):
    """A prompt's block of a kind loopd's prompt capabilities do not offer (an image, audio),
    which ACP says a client must not send: refused, never turned into text."""


_NOT_OFFERED = {"image": "images are", "audio": "audio is"}


def text_of(blocks: Sequence[Any]) -> str:
    """A prompt's blocks as one user message: text as it is, a linked or embedded resource as
    a mention of it (with its text, when the editor sent it). Raises `NotOffered` for an image
    or audio block."""
    parts = []
    for block in blocks:
        if isinstance(block, schema.TextContentBlock):
            parts.append(block.text)
        elif isinstance(block, schema.ResourceContentBlock):
            parts.append(f"[{block.name}]({block.uri})")
        elif isinstance(block, schema.EmbeddedResourceContentBlock):
            resource = block.resource
            text = getattr(resource, "text", None)
            if text is None:
                parts.append(f"[{resource.uri}] (not text: not shown)")
            else:
                parts.append(f"[{resource.uri}]\n```\n{text}\n```")
        else:
            kind = _NOT_OFFERED.get(block.type, f"{block.type} content is")
            raise NotOffered(
                f"{kind} not supported: loopd takes text, resource links and embedded "
                f"text resources (its prompt capabilities say {block.type}: false); nothing "
                "of this prompt was sent"
            )
    return "\n\n".join(parts)
