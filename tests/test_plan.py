"""The model's plan (`update_plan`): a real `loopd serve` on a scripted model that sets it,
raw socket clients, the real `bxctl chat`, `bxctl status` and `bxctl acp`; kept in the log,
so status, a restart and a fork have it."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from bxctl.view import TurnView
from conftest import StartDaemon
from loopd.config import Config
from loopd.session.records import PlanRecord, ToolResultRecord
from loopd.tools import Registry, builtin_entries, find_tool_text
from loopd.wire.proto import Event, TurnDone
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_acp import Editor, with_editor
from test_approvals import bxctl
from test_bxctl import Tmux
from test_hands import call, notes_folder
from test_sessions import records, welcome

Steps = list[tuple[str, str]]

FIRST: Steps = [
    ("Read the notes", "in_progress"),
    ("Write the summary", "pending"),
    ("Check the links", "pending"),
]
SECOND: Steps = [
    ("Read the notes", "completed"),
    ("Write the summary", "in_progress"),
    ("Check the links", "pending"),
]
THIRD: Steps = [
    ("Read the notes", "completed"),
    ("Write the summary", "completed"),
    ("Check the links", "completed"),
]


def update_plan(steps: Steps, explanation: str | None = None, call_id: str = "p1") -> Reply:
    arguments: dict[str, Any] = {"plan": [{"step": s, "status": status} for s, status in steps]}
    if explanation is not None:
        arguments["explanation"] = explanation
    return call("update_plan", arguments, call_id)


THREE = [
    update_plan(FIRST, "Three steps.", "p1"),
    update_plan(SECOND, call_id="p2"),
    update_plan(THIRD, call_id="p3"),
]


def told(steps: Steps, call: int, explanation: str | None = None) -> dict[str, Any]:
    """The `plan` event (and status's `plan`) of `steps`, set by call `call`."""
    return {
        "kind": "plan",
        "call": call,
        "explanation": explanation,
        "steps": [{"step": s, "status": status} for s, status in steps],
    }


async def status_of(client: LineClient) -> dict[str, Any]:
    await client.send({"type": "status"})
    return (await client.until("status"))[-1]


def results(d: Daemon, session: str) -> list[str]:
    return [r.content for r in records(d, session) if isinstance(r, ToolResultRecord)]


def test_find_tool_finds_update_plan_which_runs_without_asking_even_read_only() -> None:
    registry = Registry(builtin_entries(Config().tools))
    text = find_tool_text(registry, "keep a plan of my task's steps", 3, mode="read_only")
    first = text.splitlines()[1]
    assert first.startswith("1. update_plan: "), text  # no note: it neither asks nor is refused


async def test_each_plan_reaches_the_client_before_its_result_and_each_request_extends_the_last(
    daemon: StartDaemon,
) -> None:
    fake = FakeLlama([*THREE, Reply(content="Done.")])
    d = await daemon(fake)
    client = await d.connect()
    session = await welcome(client, {"type": "hello"})
    lines = await client.turn("t1", "Summarise my notes.")
    assert lines[-1]["type"] == "turn_done"
    events = [line["event"] for line in lines if line["type"] == "event"]
    assert [e for e in events if e["kind"] == "plan"] == [
        told(FIRST, 1, "Three steps."),
        told(SECOND, 2),
        told(THIRD, 3),
    ]
    calls = ("tool_call_started", "approval_needed", "plan", "tool_result")
    assert [e["kind"] for e in events if e["kind"] in calls] == [
        "tool_call_started",
        "plan",
        "tool_result",
    ] * 3  # no approval asked: it changes nothing outside the conversation
    assert results(d, session) == ["Plan updated."] * 3
    assert [r.call for r in records(d, session) if isinstance(r, PlanRecord)] == [1, 2, 3]
    assert len(fake.prompts) == 4
    for before, after in itertools.pairwise(fake.prompts):
        assert after.startswith(before)
    tools = [t["function"]["name"] for t in fake.bodies[0]["tools"]]
    assert tools == ["find_tool", "call_tool"]
    assert all(body["tools"] == fake.bodies[0]["tools"] for body in fake.bodies)


async def test_two_steps_in_progress_are_refused_and_the_plan_stays_as_it_was(
    daemon: StartDaemon,
) -> None:
    both = [("Read the notes", "in_progress"), ("Write the summary", "in_progress")]
    script = [update_plan(FIRST), update_plan(both, call_id="p2"), Reply(content="Sorry.")]
    d = await daemon(FakeLlama(script))
    client = await d.connect()
    session = await welcome(client, {"type": "hello"})
    lines = await client.turn("t1", "Plan it.")
    plans = [line["event"] for line in lines if line.get("event", {}).get("kind") == "plan"]
    assert plans == [told(FIRST, 1)]
    refused = (
        "The tool failed: at most one step can be in_progress at a time, and 2 are (Read the "
        "notes; Write the summary); the plan was not changed. Mark one in_progress, the others "
        "pending or completed."
    )
    assert results(d, session) == ["Plan updated.", refused]
    assert (await status_of(client))["plan"] == told(FIRST, 1)


async def test_a_step_with_a_lone_surrogate_is_kept_with_it_replaced_and_the_session_goes_on(
    daemon: StartDaemon,
) -> None:
    """JSON can carry a lone surrogate (`\\ud800`), which no log line can hold."""
    script = [update_plan([("\ud800 the notes", "pending")]), Reply(content="ok")]
    d = await daemon(FakeLlama(script))
    client = await d.connect()
    await welcome(client, {"type": "hello"})
    assert (await client.turn("t1", "Plan it."))[-1]["type"] == "turn_done"
    assert (await status_of(client))["plan"] == told([("\ufffd the notes", "pending")], 1)


async def test_the_plan_is_in_status_and_bxctl_status_after_a_loopd_restart(
    daemon: StartDaemon,
) -> None:
    script = [Reply(content="Hello."), *THREE[:2], Reply(content="Halfway.")]
    d = await daemon(FakeLlama(script))
    client = await d.connect()
    session = await welcome(client, {"type": "hello"})
    await client.turn("t1", "Hello.")
    assert (await status_of(client))["plan"] is None  # none set yet
    await client.turn("t2", "Summarise my notes.")
    await d.stop()
    await d.start()
    client = await d.connect()
    await welcome(client, {"type": "hello", "session": session})
    assert (await status_of(client))["plan"] == told(SECOND, 2)
    code, out, _ = await bxctl(d, "status", "--in", session)
    assert code == 0
    assert out.splitlines()[-3:] == [
        "plan     ✔ Read the notes",
        "         ▸ Write the summary",
        "         □ Check the links",
    ]


async def test_a_fork_has_the_plan_of_the_turn_it_starts_from(daemon: StartDaemon) -> None:
    script = [update_plan(FIRST), Reply(content="one"), update_plan(SECOND, call_id="p2")]
    d = await daemon(FakeLlama([*script, Reply(content="two")]))
    client = await d.connect()
    parent = await welcome(client, {"type": "hello"})
    await client.turn("t1", "Start.")
    await client.turn("t2", "Go on.")
    assert (await status_of(client))["plan"] == told(SECOND, 2)
    await welcome(client, {"type": "fork_session", "at": 1})
    assert (await status_of(client))["plan"] == told(FIRST, 1)
    await welcome(client, {"type": "open_session", "id": parent})
    assert (await status_of(client))["plan"] == told(SECOND, 2)


def shown(view: TurnView) -> list[str]:
    console = Console(width=60, record=True, color_system=None)
    console.print(view.final())
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_the_turn_view_shows_each_plan_with_its_marks() -> None:
    view = TurnView()
    for number, (steps, explanation) in enumerate(
        [(FIRST, "Three steps."), (THIRD, None)], start=1
    ):
        plan = told(steps, number, explanation)
        view.feed(Event.model_validate({"type": "event", "id": "t1", "event": plan}))
    view.feed(TurnDone(id="t1", content="Done.", usage=None))
    assert shown(view)[:9] == [
        "• Updated plan",
        "  └ Three steps.",
        "    ▸ Read the notes",
        "    □ Write the summary",
        "    □ Check the links",
        "• Updated plan",
        "  └ ✔ Read the notes",
        "    ✔ Write the summary",
        "    ✔ Check the links",
    ]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_bxctl_chat_shows_the_plan_each_time_it_is_set(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await daemon(FakeLlama([*THREE, Reply(content="All done.")]))
    tmux = Tmux(f"plan-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", rows=40, columns=100)
    try:
        await tmux.wait_for("/help for help")
        await tmux.keys("Summarise my notes.", "Enter")
        screen = await tmux.wait_for("All done.")
        await tmux.keys("/status", "Enter")
        status = await tmux.wait_for("plan:")  # /status shows the plan as it is now
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    now = status.splitlines()
    at = now.index("plan:")
    assert now[at + 1 : at + 4] == [
        "  ✔ Read the notes",
        "  ✔ Write the summary",
        "  ✔ Check the links",
    ]
    lines = [line.rstrip() for line in screen.splitlines()]
    first = lines.index("• Updated plan")
    assert lines[first : first + 5] == [
        "• Updated plan",
        "  └ Three steps.",
        "    ▸ Read the notes",
        "    □ Write the summary",
        "    □ Check the links",
    ]
    assert lines.count("• Updated plan") == 3
    assert "  └ ✔ Read the notes" in lines
    assert "    ▸ Write the summary" in lines
    assert lines.count("    ✔ Check the links") == 1


def entries(update: Any) -> list[tuple[str, str, str]]:
    return [(e.content, e.priority, e.status) for e in update.entries]


def as_entries(steps: Steps) -> list[tuple[str, str, str]]:
    return [(step, "medium", status) for step, status in steps]


async def test_an_editor_gets_each_plan_as_an_acp_plan_and_a_loaded_session_again(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    d = await daemon(FakeLlama([*THREE, Reply(content="Done.")]), tools=f'roots = ["{notes}"]')

    async def turn(conn: Any, _: Editor) -> str:
        session = await conn.new_session(cwd=str(notes))
        await conn.prompt(session_id=session.session_id, prompt=[{"type": "text", "text": "Go."}])
        return str(session.session_id)

    editor = Editor()
    session = await with_editor(d, turn, editor)
    expected = [as_entries(FIRST), as_entries(SECOND), as_entries(THIRD)]
    assert [entries(u) for u in editor.told("plan")] == expected
    kinds = [u.session_update for u in editor.shown()]
    assert kinds[:3] == ["tool_call", "plan", "tool_call_update"]
    started = editor.shown()[0]
    assert (started.title, started.kind) == ("update_plan", "think")

    async def load(conn: Any, _: Editor) -> None:
        await conn.load_session(cwd=str(notes), session_id=session)

    loaded = Editor()
    await with_editor(d, load, loaded)
    assert [entries(u) for u in loaded.told("plan")] == expected
