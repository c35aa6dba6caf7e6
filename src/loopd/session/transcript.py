"""A session's records as a readable transcript: messages, tool calls and results, and the
cache figures of each request. `loopd replay` prints it, and so do `bxctl log` and `bxctl chat`
when it joins a session."""

from __future__ import annotations

import shlex

from rich.text import Text

from loopd.session.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    AssistantRecord,
    CacheLossRecord,
    GivenServer,
    HookRecord,
    McpServersRecord,
    ModeRecord,
    PlanRecord,
    Record,
    SummaryRecord,
    ToolResultRecord,
    TurnEndRecord,
    UnreadRecord,
    UsageRecord,
    UserRecord,
)

__all__ = [
    "CUT_BY",
    "approval_line",
    "flags",
    "hook_outcome",
    "mode_words",
    "plan_lines",
    "transcript",
]

CUT_BY = {"cancelled": "cancelled", "turn_limit": "the turn's deadline", "error": "the server"}
"""What cut an answer short (`AssistantRecord.cut`), as a person reads it."""
_DECISIONS = {"once": "approved once", "session": "approved for the session", "deny": "denied"}
_BY = {"user": "", "timeout": " (nobody answered in time)", "turn_end": " (the turn ended first)"}


def flags(data_class: str, untrusted: bool, truncated: bool) -> str:
    """`private, untrusted, truncated`: what a tool result is, in a few words."""
    marks = [name for name, on in (("untrusted", untrusted), ("truncated", truncated)) if on]
    return ", ".join([data_class, *marks])


def mode_words(record: ModeRecord) -> str:
    """`read_only, thinking off`: a `mode` record in a few words."""
    thinking = {True: "on", False: "off", None: "as [loop] thinking"}[record.thinking]
    return f"{record.mode}, thinking {thinking}"


def approval_line(call: int, tool: str, decision: str, by: str) -> Text:
    """How an approval ended, in a few words."""
    style = "red" if decision == "deny" else "green"
    return Text(f"  {_DECISIONS[decision]}{_BY[by]}: {tool} (call {call})", style=style)


def transcript(records: list[Record]) -> list[Text]:  # noqa: C901, PLR0912 - one branch per record kind
    """A readable transcript: messages, tool calls and results, each request's cache figures."""
    lines: list[Text] = []
    for record in records:
        if isinstance(record, UserRecord):
            lines.append(Text.assemble(("you: ", "bold green"), record.content))
        elif isinstance(record, AssistantRecord):
            if record.content:
                lines.append(Text.assemble(("model: ", "bold blue"), record.content))
            lines.extend(Text(f"⚙ {c.name} {c.arguments}", style="cyan") for c in record.tool_calls)
            if record.cut is not None:
                lines.append(Text(f"  (answer cut short: {CUT_BY[record.cut]})", style="yellow"))
        elif isinstance(record, ToolResultRecord):
            what = flags(record.data_class, record.untrusted, record.truncated)
            first = record.content.strip().split("\n", 1)[0][:160]
            lines.append(Text(f"  ↳ #{record.call} {first}  [{what}]", style="dim cyan"))
        elif isinstance(record, UsageRecord) and record.timings:
            t = record.timings
            lines.append(
                Text(
                    f"  [prompt {t.prompt_tokens} tokens: {_cached(t.cache_n)}, "
                    f"{t.prompt_n} processed; {t.predicted_n} generated]",
                    style="dim",
                )
            )
        elif isinstance(record, CacheLossRecord):
            lines.append(
                Text(
                    f"  CACHE LOSS: {record.cached} cached of {record.expected} expected",
                    style="bold white on red",
                )
            )
        elif isinstance(record, UnreadRecord):
            said = f"  (loopd could not read this answer from here, {record.error}; "
            lines.append(Text(said + "it went on as written)", style="yellow"))
        elif isinstance(record, ApprovalRequestRecord):
            what = flags(record.data_class, record.untrusted, truncated=False)
            asked = f"  ? {record.tool} asked for approval (call {record.call}) [{what}]"
            lines.append(Text(asked, style="yellow"))
        elif isinstance(record, ApprovalRecord):
            lines.append(approval_line(record.call, record.tool, record.decision, record.by))
        elif isinstance(record, SummaryRecord):
            left_out = f", the first {record.omitted} characters left out" if record.omitted else ""
            said = f"summary of session {record.session}{left_out}: "
            lines.append(Text.assemble((said, "bold magenta"), record.text))
        elif isinstance(record, McpServersRecord):
            lines.extend(_given_line(server) for server in record.servers)
        elif isinstance(record, ModeRecord):
            lines.append(Text(f"  (mode set: {mode_words(record)})", style="magenta"))
        elif isinstance(record, HookRecord):
            lines += _hook_lines(record)
        elif isinstance(record, PlanRecord):
            lines.append(Text(f"  plan (call {record.call}):", style="cyan"))
            lines += [Text(f"    {line}", style="cyan") for line in plan_lines(record)]
        elif isinstance(record, TurnEndRecord) and record.reason != "answer":
            lines.append(Text(f"  (turn ended: {record.reason.replace('_', ' ')})", style="yellow"))
    return lines


PLAN_MARKS = {"completed": "✔", "in_progress": "▸", "pending": "□"}
"""Each status of a step of the model's plan, as its mark (as `bxctl status` shows them)."""


def plan_lines(record: PlanRecord) -> list[str]:
    """The model's plan: its explanation, then each step with its mark."""
    said = [record.explanation] if record.explanation else []
    steps = [f"{PLAN_MARKS[s.status]} {s.step}" for s in record.steps]
    return said + (steps or ["(no steps: the plan was cleared)"])


def hook_outcome(record: HookRecord) -> str:
    """How a hook's run ended, in a few words."""
    if record.status is None:
        return record.error or "did not run"
    if record.status < 0:
        return f"killed by signal {-record.status}"
    said = {0: "went on", 2: "blocked"}.get(record.status, "failed, blocking nothing")
    return f"exit {record.status}: {said}"


def _hook_lines(record: HookRecord) -> list[Text]:
    for_call = f" for call {record.call} ({record.tool})" if record.call is not None else ""
    ran = f"  hook {record.event}{for_call}: {shlex.join(record.command)}"
    lines = [Text(f"{ran} - {hook_outcome(record)} in {record.seconds:.2f} s", style="dim")]
    if record.feedback:
        lines.append(Text.assemble(("you (stop hook): ", "bold green"), record.feedback))
    return lines


def _given_line(server: GivenServer) -> Text:
    """An MCP server the session was given, and whether it was started."""
    where = server.url or shlex.join(server.command)
    line = f"  MCP server {server.name} for this session: {where}"
    if server.refused is not None:
        return Text(f"{line} (not started: {server.refused})", style="yellow")
    return Text(line, style="dim")


def _cached(cache_n: int | None) -> str:
    return "cache not reported" if cache_n is None else f"{cache_n} cached"
