"""What a turn looks like: built from its events, drawn with rich.

`TurnView` is plain state fed by `feed(message)`; `live()` is what the screen shows while the
turn runs (the tail of it, so a long answer never overflows the terminal), `final()` what is
printed above the prompt once it ends. No terminal is needed to test it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.markdown import Markdown
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.spinner import Spinner
from rich.syntax import Syntax
from rich.text import Text

from bxctl.oneshot import PLAN_MARKS
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
from loopd.session.records import Decision
from loopd.session.transcript import approval_line, flags
from loopd.wire.events import (
    AgentUpdate,
    ApprovalDecided,
    ApprovalNeeded,
    CacheLoss,
    Compacting,
    MovedToServer,
    PlanUpdate,
    SessionContinued,
    ToolCallStarted,
    ToolOutputChunk,
    ToolResult,
    WaitingForServer,
)
from loopd.wire.proto import (
    Context,
    DaemonMessage,
    Event,
    SessionFailed,
    TurnDone,
    TurnFailed,
    Usage,
)

__all__ = [
    "APPROVAL_KEYS",
    "DEMO_MODELS",
    "HINTS",
    "TurnView",
    "agent_line",
    "approval_panel",
    "context_lines",
    "demo_note",
    "instructions_line",
    "plan_block",
    "session_failed",
    "usage_line",
]

DEMO_MODELS = frozenset({"SmolLM2-135M-Instruct.Q4_1.gguf"})
"""The model `just setup` bundles: too small to call tools, which the greeting says."""


def demo_note(config: Path) -> str:
    """What the greeting says of the bundled model, and where to name a real one: `config`,
    the config file in effect (`~` for the home folder)."""
    shown = f"~/{config.relative_to(Path.home())}" if config.is_relative_to(Path.home()) else config
    return (
        "This is the bundled demonstration model (SmolLM2-135M): it answers simple questions "
        "and calls no tools. For a real one, set [server.managed] model or [server] url in "
        f"{shown} (docs/operations.md)."
    )


APPROVAL_KEYS: dict[str, Decision] = {"y": "once", "n": "deny", "a": "session"}
"""The keys that answer an approval, and the decision each sends."""

HINTS = {
    "turn_limit": "The turn stopped at a limit. Send another message to go on.",
    "session_full": "The session is full: the conversation no longer fits the model's context. "
    "/compact goes on in a new session from a summary of this one; /new starts a fresh one "
    "(this one stays on disk either way).",
    "infer": "the model's server could not answer. Is it running? `bxctl status` shows where.",
    "cancelled": "Cancelled. What it had written is kept in the log, marked as cut short.",
    "error": "The turn failed; loopd's log says more.",
}


def session_failed(failed: SessionFailed) -> list[Text]:
    """What a person reads when loopd closed the session: why, and how to go on."""
    return [
        Text(f"session {failed.session} failed and is closed: {failed.message}", style="bold red"),
        Text(
            f"Nothing written before is lost. Once that is fixed, /resume {failed.session} "
            "opens it again; /new starts a fresh one.",
            style="red",
        ),
    ]


_Note = (
    ThinkingCapped
    | Repeating
    | Retrying
    | WaitingForServer
    | MovedToServer
    | CacheLoss
    | Compacting
    | SessionContinued
)
"""Events told as a line under the turn (or as its state)."""

RUNNING_LINES = 5
"""Lines of a running command's latest output shown under its call."""
RUNNING_KEEP = 4096
"""Characters of it kept: enough for those lines."""


class Tail:
    """The last `height` lines of a renderable."""

    def __init__(self, renderable: RenderableType, height: int) -> None:
        self.renderable, self.height = renderable, height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        for line in lines[-self.height :]:
            yield from line
            yield Segment.line()


@dataclass
class _Request:
    """One request of the turn, as the server's progress told it (none on a server that
    reports none)."""

    total: int = 0
    cache: int = 0
    processed: int = 0


@dataclass
class TurnView:
    content: str = ""
    reasoning: str = ""
    show_reasoning: bool = False
    state: str = "sending"
    tools: list[Text | str] = field(default_factory=list)
    """Lines about tool calls; a string stands for a sub-agent's line (its session), drawn
    from its latest news."""
    agents: dict[str, AgentUpdate] = field(default_factory=dict)
    notes: list[Text] = field(default_factory=list)
    requests: list[_Request] = field(default_factory=list)
    outcome: TurnDone | TurnFailed | None = None
    approval: ApprovalNeeded | None = None
    """The call that waits for the user's answer, until it is decided."""
    running: dict[int, str] = field(default_factory=dict)
    """The latest output of each command that runs, by call, until its result."""

    def feed(self, message: DaemonMessage) -> None:
        if isinstance(message, TurnDone | TurnFailed):
            self.outcome = message
        elif isinstance(message, SessionFailed):
            self.notes += session_failed(message)
        elif isinstance(message, Event):
            self._event(message.event)

    def _event(self, event: object) -> None:
        if isinstance(event, Queued):
            self.state = "queued: the model is busy"
        elif isinstance(event, Waiting):
            self.state = "waiting for the model"
            self.requests.append(_Request())
        elif isinstance(event, Progress):
            request = self._request()
            request.total, request.cache, request.processed = (
                event.total,
                event.cache,
                event.processed,
            )
            self.state = "reading the prompt"
        elif isinstance(event, Reasoning | Content):
            if isinstance(event, Reasoning):
                self.reasoning += event.text
                self.state = "thinking"
            else:
                self.content += event.text
                self.state = "answering"
        elif isinstance(event, _Note):
            self._note(event)
        else:
            self._tool(event)

    def _tool(self, event: object) -> None:
        if isinstance(event, ToolCallStarted):
            what = f"{event.name} → {event.tool}" if event.tool else event.name
            self.tools.append(Text(f"⚙ {what} (call {event.call})", style="cyan"))
            self.state = f"running {event.tool or event.name}"
        elif isinstance(event, ApprovalNeeded | ApprovalDecided):
            self._approval(event)
        elif isinstance(event, AgentUpdate):
            if event.session not in self.agents:
                self.tools.append(event.session)
            self.agents[event.session] = event
        elif isinstance(event, ToolOutputChunk):
            self.running[event.call] = (self.running.get(event.call, "") + event.text)[
                -RUNNING_KEEP:
            ]
        elif isinstance(event, PlanUpdate):
            self.tools.append(plan_block(event))
        elif isinstance(event, ToolResult):
            self.running.pop(event.call, None)
            what = flags(event.data_class, event.untrusted, event.truncated)
            self.tools.append(Text(f"  ↳ {event.preview}  [{what}]", style="dim cyan"))

    def _note(self, event: _Note) -> None:
        if isinstance(event, ThinkingCapped):
            self.notes.append(Text(f"thinking capped at {event.cap} tokens", style="yellow"))
        elif isinstance(event, Repeating):
            self.notes.append(
                Text(
                    f"the model said the same {event.period} characters over and over "
                    f"({event.span} characters): cut",
                    style="yellow",
                )
            )
        elif isinstance(event, Retrying):
            self.notes.append(Text(event.said(), style="yellow"))
        elif isinstance(event, WaitingForServer):
            self.notes.append(Text(event.said(), style="yellow"))
            self.state = "waiting for the server"
        elif isinstance(event, MovedToServer):
            self.notes.append(Text(event.said(), style="yellow"))
            self.state = f"moved to the server at {event.server}"
        elif isinstance(event, Compacting):
            self.state = f"summarising session {event.session} to go on in a new one"
        elif isinstance(event, SessionContinued):
            self.notes.append(
                Text(
                    f"the context was compacted: session {event.session} continues "
                    f"{event.previous} from a summary (/resume reopens the old one)",
                    style="magenta",
                )
            )
            self.notes.append(Text.assemble(("summary: ", "bold magenta"), event.summary))
        elif isinstance(event, CacheLoss):
            self.notes.append(
                Text(
                    f"CACHE LOSS: {event.cached} tokens cached of {event.expected} expected",
                    style="bold white on red",
                )
            )

    def _approval(self, event: ApprovalNeeded | ApprovalDecided) -> None:
        # An `approval_needed` can come twice (a subscription replays what waits): once shown.
        if isinstance(event, ApprovalNeeded):
            if self.approval is None or _key(self.approval) != _key(event):
                self.approval = event
                self.state = f"waiting for your approval of {event.tool}"
            return
        if self.approval is not None and _key(self.approval) == _key(event):
            self.approval = None
        line = approval_line(event.call, event.tool, event.decision, event.by)
        if event.session:
            line.append(f" (sub-agent {event.session})")
        self.tools.append(line)

    def _request(self) -> _Request:
        if not self.requests:
            self.requests.append(_Request())
        return self.requests[-1]

    def _reasoning(self) -> RenderableType | None:
        if not self.reasoning:
            return None
        if self.show_reasoning or not self.content:
            return Text(self.reasoning.strip(), style="dim italic")
        return Text(
            f"(thought for {len(self.reasoning.split())} words; --show-reasoning shows it)",
            style="dim",
        )

    def _footers(self, usage: Usage | None = None) -> list[Text]:
        """A line for each request of the turn: its prompt as the server's progress told it,
        and for the last (the answer's, or a compaction's summary) the server's own figures
        once the turn is done, what it generated included. Only the server counts the tokens
        generated (the end token too, which streams no text), and it reports them for the
        turn's last request alone: an earlier one's line says nothing of them."""
        requests = self.requests or [_Request()]
        lines = []
        for number, r in enumerate(requests, start=1):
            if number == len(requests) and usage is not None and usage.prompt_n is not None:
                lines.append(usage_line(usage, number))
            elif r.total:
                said = f"prompt {r.total} tokens, {r.cache} cached, {r.total - r.cache} processed"
                lines.append(Text(f"request {number}: {said}", style="dim"))
        return lines

    def _body(self) -> list[RenderableType]:
        parts: list[RenderableType] = [
            agent_line(self.agents[line]) if isinstance(line, str) else line for line in self.tools
        ]
        if (reasoning := self._reasoning()) is not None:
            parts.append(reasoning)
        if self.content:
            parts.append(Markdown(self.content))
        return parts

    def _running(self) -> list[Text]:
        """The last lines of each running command's output, as a terminal would leave them (a
        line rewritten after a carriage return shows as its last version)."""
        shown = []
        for output in self.running.values():
            for line in output.rstrip("\n").split("\n")[-RUNNING_LINES:]:
                last = line.rsplit("\r", 1)[-1]
                shown_line = Text("    │ ", style="dim cyan", no_wrap=True, overflow="ellipsis")
                shown.append(shown_line.append_text(Text.from_ansi(last, style="dim")))
        return shown

    def live(self, height: int) -> RenderableType:
        parts = self._body()
        parts[len(self.tools) : len(self.tools)] = self._running()  # under the calls
        if self.approval is not None:
            parts.append(approval_panel(self.approval))
        body = Tail(Group(*parts), max(3, height - 4))
        status: RenderableType = Spinner("dots", text=Text(self.state, style="dim"))
        request = self.requests[-1] if self.requests else None
        if request and request.total and request.processed < request.total:
            status = Group(
                Text(
                    f"reading the prompt: {request.processed}/{request.total} tokens", style="dim"
                ),
                ProgressBar(total=request.total, completed=request.processed, width=40),
            )
        return Group(body, *self.notes, status)

    def final(self) -> RenderableType:
        parts = [*self._body(), *self.notes]
        outcome = self.outcome
        if isinstance(outcome, TurnFailed):
            parts.append(
                Text(f"{outcome.kind.replace('_', ' ')}: {outcome.message}", style="bold red")
            )
            parts.append(Text(HINTS.get(outcome.kind, ""), style="red"))
        usage = outcome.usage if isinstance(outcome, TurnDone) else None
        parts += self._footers(usage)
        return Group(*parts)


def _key(event: ApprovalNeeded | ApprovalDecided) -> tuple[str | None, int]:
    return event.session, event.call


_AGENT_STYLES = {"answered": "green", "failed": "red", "cancelled": "yellow"}


def agent_line(news: AgentUpdate) -> Text:
    """A sub-agent, under the call that started it: its state, tool calls and tokens."""
    calls = f"{news.tool_calls} tool call{'s' * (news.tool_calls != 1)}"
    if news.tool:
        calls += f", last {news.tool}"
    line = Text(f"  ↳ sub-agent {news.session} (call {news.call}): ", style="cyan")
    line.append(news.state, style=_AGENT_STYLES.get(news.state, "bold cyan"))
    line.append(f" · {calls} · {news.tokens} tokens", style="dim cyan")
    if news.detail:
        line.append(f" · {news.detail}", style="red")
    return line


_PLAN_STYLES = {"completed": "dim strike", "in_progress": "bold cyan", "pending": "dim"}


def plan_block(plan: PlanUpdate) -> Text:
    """The model's plan as it set it, as Codex shows one: its explanation, then each step with
    its mark, the one under way in bold and those done struck through."""
    lines: list[tuple[str, str]] = []
    if plan.explanation:
        lines.append((plan.explanation, "dim italic"))
    lines += [(f"{PLAN_MARKS[s.status]} {s.step}", _PLAN_STYLES[s.status]) for s in plan.steps]
    if not plan.steps:
        lines.append(("(no steps: the plan was cleared)", "dim italic"))
    block = Text.assemble(("• ", "dim"), ("Updated plan", "bold"))
    for number, (line, style) in enumerate(lines):
        block.append("\n  └ " if number == 0 else "\n    ", style="dim")
        block.append(line, style=style)
    return block


def approval_panel(asking: ApprovalNeeded) -> Panel:
    """A call that waits for approval: what it would do, and the keys that answer."""
    marks = flags(asking.data_class, asking.untrusted, truncated=False)
    arguments = json.dumps(asking.arguments, indent=2, ensure_ascii=False)
    shown: RenderableType = Text(arguments)
    if asking.preview is not None:  # what it would do says more than its arguments
        lexer = "diff" if asking.preview.startswith(("---", "@@")) else "text"
        shown = Syntax(asking.preview, lexer, theme="ansi_dark", background_color="default")
    body = Group(
        Text.assemble(("tool  ", "dim"), (asking.tool, "bold"), ("   result: ", "dim"), marks),
        shown,
        Text.assemble(
            ("y", "bold green"),
            " run it   ",
            ("n", "bold red"),
            " do not run it   ",
            ("a", "bold green"),
            " always run this tool in this session",
            (f"   (denied in {asking.timeout:g} s)", "dim"),
        ),
    )
    of = f" of sub-agent {asking.session}" if asking.session else ""
    return Panel(body, title=f"approve call {asking.call}{of}?", border_style="yellow")


def instructions_line(paths: Sequence[str]) -> Text:
    """The `AGENTS.md` files a session's system prompt carries."""
    return Text(f"instructions from {', '.join(paths)}", style="dim")


def usage_line(usage: Usage, number: int) -> Text:
    """Request `number`'s figures as its server reported them (`usage`); a thinking cap is
    told by its own line (`thinking_capped`)."""
    if usage.cache_n is None:
        prompt = f"prompt {usage.prompt_n} tokens processed, cache not reported"
    else:
        total = usage.cache_n + (usage.prompt_n or 0)
        prompt = f"prompt {total} tokens, {usage.cache_n} cached, {usage.prompt_n} processed"
    text = f"request {number}: {prompt}"
    if usage.predicted_n is not None:
        text += f"; {usage.predicted_n} generated"
        if usage.predicted_n and usage.predicted_ms:
            text += f" at {usage.predicted_n / usage.predicted_ms * 1000:.0f} tokens/s"
    return Text(text, style="dim")


_PARTS = (
    ("start", "the first prompt: system prompt, tool definitions, first message"),
    ("messages", "your messages since"),
    ("tool_results", "tool results"),
    ("answers", "the model's answers"),
    ("reasoning", "its past reasoning"),
)


def context_lines(context: Context) -> list[str]:
    """What `/context` and `bxctl context` print: the system prompt whole, the `AGENTS.md`
    files in it, the tools the model sees and those it finds through `find_tool`, and the
    slot's tokens by part against the context window."""
    lines = [f"session {context.session}", "system prompt:", *context.system_prompt.splitlines()]
    lines += [
        f"instructions from {f.path} ({f.kept} of {f.size} bytes in the prompt)"
        for f in context.instructions
    ]
    offered = [t.name for t in context.tools if not t.found]
    lines.append(f"tools offered to the model: {', '.join(offered)}")
    found = [t for t in context.tools if t.found]
    if found:
        lines.append("tools behind them, found through find_tool and called through call_tool:")
        lines += [f"  {t.name} ({t.source}): {t.summary}" for t in found]
    if context.tokens is None or context.parts is None:
        lines.append("context: no request yet")
        return lines
    window = "" if context.context_size is None else f" of {context.context_size}"
    share = f" ({context.tokens / context.context_size:.0%})" if context.context_size else ""
    how = (
        "exact: the server's counts"
        if context.exact
        else "not exact: history went as messages, or a request or its cache went unreported"
    )
    lines.append(f"context: {context.tokens}{window} tokens in the slot{share}, {how}")
    width = max(len(label) for _, label in _PARTS)
    lines += [f"  {label:<{width}}  {getattr(context.parts, part):>7}" for part, label in _PARTS]
    return lines
