"""`bxctl export`: a session with a sub-agent and a fork of it, made by a real `loopd serve` on a
scripted model, written out as Markdown and as one JSON document, from the store."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from loopd.session.records import HookRecord, PlanRecord, PlanStep
from loopd.session.store import Store
from loopd.session.transcript import hook_outcome, plan_lines, transcript
from support.daemon import Daemon
from support.fake_llama import Reply
from support.replay import ReplayServer
from test_agents import Conversations, delegate
from test_bxctl import bxctl

SCRIPTS = {
    # The fork's conversation begins as its parent's: the same script answers it, last.
    "What do I buy?": [
        delegate("Read the list."),
        Reply(content="Milk, says the sub-agent."),
        Reply(content="Bread, in the fork."),
    ],
    "Read the list.": [Reply(content="The list says: buy milk.")],
}


@pytest.fixture
async def made(tmp_path: Path) -> AsyncIterator[tuple[Daemon, str, str, str]]:
    """A session whose turn delegated, its sub-agent, and a fork of it at turn 1 that went on:
    the daemon and the three ids."""
    server = ReplayServer([Conversations({k: list(v) for k, v in SCRIPTS.items()})] * 100, slots=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        d = Daemon(tmp_path / "loopd", server.url, slots='save = "never"\n')
        await d.start()
        try:
            code, out, err = await bxctl(d, "chat", "-m", "What do I buy?")
            assert (code, out) == (0, "Milk, says the sub-agent.\n"), err
            store = Store(d.home / "sessions")
            infos = store.sessions_now()
            (parent,) = [i.id for i in infos if i.parent is None]
            (child,) = [i.id for i in infos if i.parent == parent]
            code, out, err = await bxctl(d, "fork", parent, "--at", "1")
            assert code == 0, err
            fork = next(i.id for i in store.sessions_now() if i.forked_from == parent)
            code, out, err = await bxctl(d, "chat", "--session", fork, "-m", "And after that?")
            assert code == 0, err
            yield d, parent, child, fork
        finally:
            await d.end()
            nursery.cancel_scope.cancel()


async def test_markdown_has_the_calls_results_and_the_sub_agent_under_its_call(
    made: tuple[Daemon, str, str, str],
) -> None:
    d, parent, child, _ = made
    code, out, err = await bxctl(d, "export", parent)
    assert code == 0, err
    assert out.startswith(f"# Session `{parent}`\n")
    assert "## You\n\nWhat do I buy?\n" in out
    assert 'Tool call `delegate`:\n\n```json\n{"task": "Read the list."}\n```' in out
    assert "Result of call 1 (`delegate`, " in out
    # The sub-agent's own conversation, quoted under the result of the call that started it.
    sub = out.index(f"> ## Session `{child}`")
    assert out.index("Result of call 1") < sub < out.index("Milk, says the sub-agent.")
    assert f"> - a sub-agent of `{parent}`, started by its call 1" in out
    assert "> The list says: buy milk." in out


async def test_a_fork_is_named_and_carries_its_parents_sub_agent(
    made: tuple[Daemon, str, str, str],
) -> None:
    d, parent, child, fork = made
    code, out, err = await bxctl(d, "export", fork)
    assert code == 0, err
    assert f"- a fork of `{parent}` at the end of turn 1" in out
    assert f"> ## Session `{child}`" in out  # the copied call's sub-agent
    assert out.rstrip().endswith("Bread, in the fork.")


async def test_json_is_one_document_without_token_ids(
    made: tuple[Daemon, str, str, str], tmp_path: Path
) -> None:
    d, parent, child, fork = made
    target = tmp_path / "fork.json"
    code, out, err = await bxctl(d, "export", fork, "--format", "json", "-o", str(target))
    assert (code, out, err) == (0, "", "")
    document = json.loads(target.read_text())
    (session,) = document["sessions"]
    assert session["header"]["forked_from"] == parent
    kinds = [r["kind"] for r in session["records"]]
    assert "prompt" not in kinds
    assert all("tokens" not in r for r in session["records"])
    (sub,) = session["sub_agents"]
    assert (sub["call"], sub["id"]) == (1, child)
    said = [r["content"] for r in session["records"] if r["kind"] == "user"]
    assert said == ["What do I buy?", "And after that?"]


async def test_an_unknown_session_fails_saying_so(made: tuple[Daemon, str, str, str]) -> None:
    d, *_ = made
    code, out, err = await bxctl(d, "export", "20990101T000000000Z-000000")
    assert (code, out) == (1, "")
    assert err.startswith("bxctl: ")


def test_a_hooks_run_reads_in_the_transcript_and_the_export() -> None:
    """`bxctl log` (the transcript) and `bxctl export` name each hook's run and how it ended,
    and a stop hook's reason to go on as the message the model read."""
    blocked = HookRecord(
        event="pre_tool_use", command=("guard", "--strict"), call=3, tool="run_command",
        status=2, seconds=0.25, stderr="no rm",
    )  # fmt: skip
    stop = HookRecord(event="stop", command=("check",), status=2, seconds=1.0, feedback="Go on.")
    hung = HookRecord(event="stop", command=("slow",), status=None, seconds=60, error="timed out")
    lines = [str(line) for line in transcript([blocked, stop, hung])]
    assert lines == [
        "  hook pre_tool_use for call 3 (run_command): guard --strict - exit 2: blocked in 0.25 s",
        "  hook stop: check - exit 2: blocked in 1.00 s",
        "you (stop hook): Go on.",
        "  hook stop: slow - timed out in 60.00 s",
    ]
    assert hook_outcome(HookRecord(event="stop", command=("x",), status=-9, seconds=0)) == (
        "killed by signal 9"
    )


def test_the_plan_reads_in_the_transcript_with_its_marks() -> None:
    plan = PlanRecord(
        call=2,
        tool_call_id="c2",
        explanation="Three steps.",
        steps=(
            PlanStep(step="read", status="completed"),
            PlanStep(step="write", status="in_progress"),
            PlanStep(step="test", status="pending"),
        ),
    )
    assert [str(line) for line in transcript([plan])] == [
        "  plan (call 2):",
        "    Three steps.",
        "    ✔ read",
        "    ▸ write",
        "    □ test",
    ]
    cleared = PlanRecord(call=3, tool_call_id="c3", steps=())
    assert plan_lines(cleared) == ["(no steps: the plan was cleared)"]
