"""`bxctl export`: a session as a person reads it (Markdown) or as one JSON document, to keep or
to share; read from the store, so it works with no loopd running.

Both carry the whole conversation: the sessions it continues (compactions) first, oldest
first; each tool call with its arguments and its result; each sub-agent's own conversation
under the call that started it; where a fork came from. Neither carries what only the cache
needs (the token ids of the prompts and the answers): an export is for reading, `loopd replay`
and the log itself for replaying.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Literal

from loopd.session.records import (
    ApprovalRecord,
    AssistantRecord,
    HookRecord,
    ModeRecord,
    PlanRecord,
    PromptRecord,
    Record,
    SessionHeader,
    SummaryRecord,
    ToolResultRecord,
    TurnEndRecord,
    UndoRecord,
    UserRecord,
)
from loopd.session.store import SessionInfo, Store, StoreError
from loopd.session.transcript import flags, hook_outcome, mode_words, plan_lines

__all__ = ["ExportFormat", "Exported", "exported", "json_document", "markdown"]

ExportFormat = Literal["markdown", "json"]

_DECISIONS = {"once": "approved once", "session": "approved for the session", "deny": "denied"}


@dataclass
class Exported:
    """One session's header and records, and the sub-agents its calls started."""

    header: SessionHeader
    records: list[Record]
    sub_agents: dict[int, Exported] = field(default_factory=dict)
    """By the number of the call that started each."""
    unreadable: dict[str, str] = field(default_factory=dict)
    """A sub-agent's log that does not read, by its session: why."""


def exported(store: Store, session: str) -> list[Exported]:
    """The session and those it continues, oldest first, each with its sub-agents. Raises
    `StoreError` when the session itself does not read; a session it continues that does not
    read ends the chain there."""
    infos = store.sessions_now()
    chain: list[Exported] = []
    seen: set[str] = set()
    at: str | None = session
    while at is not None and at not in seen:
        seen.add(at)
        try:
            one = _one(store, infos, at, set())
        except StoreError:
            if not chain:
                raise
            break
        chain.insert(0, one)
        at = one.header.continues
    return chain


def _one(store: Store, infos: list[SessionInfo], session: str, above: set[str]) -> Exported:
    header, records, _ = store.read(session)
    one = Exported(header, records)
    # A fork's records up to its point are its parent's, calls and all: so are the
    # sub-agents those calls started (the parent's, or its own parent's for a fork of a fork).
    starters = {session}
    at: str | None = header.forked_from
    while at is not None and at not in starters:
        starters.add(at)
        at = next((i.forked_from for i in infos if i.id == at), None)
    copied = _copied_calls(records, header.at) if header.forked_from else set()
    for info in infos:
        if info.parent not in starters or info.id in above:
            continue
        try:
            child = _one(store, infos, info.id, {*above, session})
        except StoreError as e:
            if info.parent == session:
                one.unreadable[info.id] = str(e)
            continue
        call = child.header.call
        if call is not None and (info.parent == session or call in copied):
            one.sub_agents[call] = child
    return one


def _copied_calls(records: list[Record], at: int | None) -> set[int]:
    """The calls of a fork's records up to its point: the end of turn `at`."""
    calls: set[int] = set()
    ended = 0
    for record in records:
        if ended == at:
            break
        if isinstance(record, ToolResultRecord):
            calls.add(record.call)
        elif isinstance(record, TurnEndRecord):
            ended += 1
    return calls


def json_document(chain: list[Exported]) -> str:
    """The conversation as one JSON document: `sessions`, oldest first, each with its `header`,
    its `records` (as the log holds them, less the prompts and token ids) and its `sub_agents`."""
    return json.dumps(
        {"format": "loopd-export", "version": 1, "sessions": [_json(s) for s in chain]}
    )


def _json(one: Exported) -> dict[str, Any]:
    records = [
        r.model_dump(mode="json", by_alias=True, exclude={"tokens"})
        for r in one.records
        if not isinstance(r, PromptRecord)
    ]
    return {
        "id": one.header.id,
        "header": one.header.model_dump(mode="json", by_alias=True),
        "records": records,
        "sub_agents": [
            {"call": call, **_json(child)} for call, child in sorted(one.sub_agents.items())
        ],
        "unreadable_sub_agents": [
            {"session": child, "error": why} for child, why in sorted(one.unreadable.items())
        ],
    }


def markdown(chain: list[Exported]) -> str:
    """The conversation in Markdown: a section per session, a heading per message."""
    return "\n".join(line for one in chain for line in _markdown(one, level=1)).rstrip() + "\n"


def _markdown(one: Exported, level: int) -> list[str]:  # noqa: C901, PLR0912 - a branch a record kind
    h = "#" * level
    header = one.header
    lines = [f"{h} Session `{header.id}`", "", *_about(header), ""]
    names: dict[str, str] = {}
    """The tool each call of the model's named, by the call's id."""
    for record in one.records:
        if isinstance(record, UserRecord):
            lines += [f"{h}# You", "", record.content.rstrip("\n"), ""]
        elif isinstance(record, AssistantRecord):
            lines += [f"{h}# Model", ""]
            if record.reasoning_content:
                lines += [
                    "<details><summary>Reasoning</summary>",
                    "",
                    record.reasoning_content,
                    "",
                    "</details>",
                    "",
                ]
            if record.content:
                lines += [record.content.rstrip("\n"), ""]
            for call in record.tool_calls:
                name, arguments = _called(call.name, call.arguments)
                names[call.id] = name
                lines += [f"Tool call `{name}`:", "", *_fenced(arguments, "json"), ""]
        elif isinstance(record, ToolResultRecord):
            what = flags(record.data_class, record.untrusted, record.truncated)
            name = names.get(record.tool_call_id, record.name)
            lines += [f"Result of call {record.call} (`{name}`, {what}):", ""]
            lines += [*_fenced(record.content), ""]
            if (child := one.sub_agents.get(record.call)) is not None:
                lines += _quoted(_markdown(child, level + 1))
        elif isinstance(record, ApprovalRecord):
            decided = _DECISIONS[record.decision]
            lines += [f"_{decided}: `{record.tool}` (call {record.call}), by {record.by}_", ""]
        elif isinstance(record, SummaryRecord):
            lines += [f"{h}# Summary of session `{record.session}`", "", record.text, ""]
        elif isinstance(record, ModeRecord):
            lines += [f"_Mode: {mode_words(record)}_", ""]
        elif isinstance(record, UndoRecord):
            put = ", ".join(record.paths) or "nothing"
            lines += [f"_Undone: calls {', '.join(map(str, record.calls))} ({put})_", ""]
        elif isinstance(record, PlanRecord):
            lines += [f"Plan (call {record.call}):", ""]
            lines += [f"- {line}" for line in plan_lines(record)] + [""]
        elif isinstance(record, HookRecord):
            for_call = f" for call {record.call} (`{record.tool}`)" if record.call else ""
            ran = f"_Hook {record.event}{for_call}: `{shlex.join(record.command)}`"
            lines += [f"{ran}, {hook_outcome(record)}_", ""]
            if record.feedback:
                lines += [f"{h}# You (a stop hook)", "", record.feedback, ""]
        elif isinstance(record, TurnEndRecord) and record.reason != "answer":
            lines += [f"_The turn ended: {record.reason.replace('_', ' ')}_", ""]
    lines += [f"_Sub-agent `{c}` does not read: {why}_" for c, why in one.unreadable.items()]
    return lines


def _called(name: str, arguments: str) -> tuple[str, str]:
    """The tool a call runs and its arguments: for `call_tool`, the tool it names (the model
    sees two tools, and calls every other through `call_tool`)."""
    if name == "call_tool":
        try:
            inner = json.loads(arguments)
        except ValueError:
            return name, arguments
        if isinstance(inner, dict) and isinstance(inner.get("name"), str):
            return inner["name"], json.dumps(inner.get("arguments", {}), ensure_ascii=False)
    return name, arguments


def _about(header: SessionHeader) -> list[str]:
    lines = [f"- created {header.created:%Y-%m-%d %H:%M} UTC by loopd {header.loopd_version}"]
    if header.cwd:
        lines.append(f"- working in `{header.cwd}`")
    if header.forked_from:
        lines.append(f"- a fork of `{header.forked_from}` at the end of turn {header.at}")
    if header.continues:
        lines.append(f"- continues `{header.continues}` from its summary (a compaction)")
    if header.parent:
        lines.append(f"- a sub-agent of `{header.parent}`, started by its call {header.call}")
    files = header.instructions.files if header.instructions else ()
    lines += [f"- instructions from `{file.path}`" for file in files]
    return lines


def _fenced(text: str, language: str = "") -> list[str]:
    """`text` in a code fence longer than any run of backticks in it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{language}", text, fence]


def _quoted(lines: list[str]) -> list[str]:
    return [f"> {line}" if line else ">" for line in lines] + [""]
