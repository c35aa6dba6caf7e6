"""Going on past a full context: a new session continues the old one from the model's summary,
written on the side slot while the main slot keeps the old session's cache. Real `loopd serve`
on the real llama-server and model, besides the pure parts."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import trio

from conftest import StartDaemon, StartLlama
from loopd.infer import HttpError, Timings, ToolCall
from loopd.session.baseline import make_baseline
from loopd.session.compact import _cut, continued_baseline, earlier_summary, transcript
from loopd.session.records import (
    AssistantRecord,
    ContinuedRecord,
    Record,
    SessionHeader,
    SummaryRecord,
    ToolResultRecord,
    TurnEndRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_approvals import approve, asking, ended, event, read_file
from test_bxctl import Tmux
from test_sessions import SHORT, assert_no_loss, embedded, records, welcome

SMALL = "[server.managed]\nn_ctx = 512\n"
"""A context that a few turns fill (the first prompt is about 130 tokens, each turn about 60)."""
WORDY = (
    "Here is something to remember about my garden: the {n}th row has tomatoes, beans, "
    "carrots, leeks and a small apple tree that my grandmother planted long ago. Reply short."
)


def test_the_transcript_keeps_messages_and_calls_and_shortens_results() -> None:
    log: list[Record] = [
        SummaryRecord(session="s0", text="Earlier things.", timings=None, slot=1),
        UserRecord(content="Read my notes."),
        AssistantRecord(
            content=None,
            reasoning_content="secret thoughts",
            tool_calls=(ToolCall(id="c1", name="find_tool", arguments='{"query": "notes"}'),),
        ),
        ToolResultRecord(call=1, tool_call_id="c1", name="find_tool", content="x" * 5000),
        AssistantRecord(content="They say: buy milk."),
    ]
    text = transcript(log, earlier_summary(log))
    assert text.splitlines()[0] == "(Summary of what came before: Earlier things.)"
    assert "User: Read my notes." in text
    assert 'Assistant called find_tool {"query": "notes"}' in text
    assert "Assistant: They say: buy milk." in text
    assert "secret thoughts" not in text
    assert len(text) < 2300  # the 5000-character result is cut to 2000


def test_a_continued_baseline_keeps_the_tools_and_adds_the_summary() -> None:
    base = make_baseline("Be brief.")
    continued = continued_baseline(base, "The user likes tomatoes.")
    assert continued.tools == base.tools
    assert continued.system.startswith("Be brief.\n\n")
    assert continued.system.endswith("The user likes tomatoes.")


def _full(n_prompt: int, n_ctx: int) -> HttpError:
    error = {"type": "exceed_context_size_error", "n_prompt_tokens": n_prompt, "n_ctx": n_ctx}
    body = {"error": error}
    return HttpError(400, json.dumps(body))


def test_a_transcript_that_does_not_fit_keeps_its_end_by_the_servers_count() -> None:
    text = "\n".join(f"line {n:04d} " + "w" * 40 for n in range(1000))
    start, max_tokens = _cut(text, 0, 1024, _full(n_prompt=20000, n_ctx=4096))
    assert max_tokens == 1024
    kept = text[start:]
    assert kept.startswith("line ")  # cut at a line's start
    # (4096 - 1024) * 0.9 / 20000 of it: about 14 %
    assert 0.12 < len(kept) / len(text) < 0.15
    # A small context: the summary gets a quarter of it at most.
    _, max_tokens = _cut(text, 0, 1024, _full(n_prompt=3000, n_ctx=1024))
    assert max_tokens == 256
    # Without the server's figures: half.
    start, _ = _cut(text, 0, 100, HttpError(400, "no json"))
    assert 0.49 < len(text[start:]) / len(text) < 0.51


async def _fill(client: LineClient, limit: int = 12) -> tuple[int, list[dict[str, object]]]:
    """Send wordy messages until one continues the session; its number and its lines."""
    for n in range(1, limit + 1):
        lines = await client.turn(f"t{n}", WORDY.format(n=n), timeout=120)
        if any(_kind(line) == "session_continued" for line in lines):
            return n, lines
        assert lines[-1]["type"] == "turn_done", lines[-1]
    raise AssertionError(f"{limit} turns did not fill the context")


def _kind(line: dict[str, object]) -> object:
    event = line.get("event")
    return event.get("kind") if isinstance(event, dict) else None


def _header(d: Daemon, session: str) -> SessionHeader:
    return Store(d.home / "sessions").read(session)[0]


@pytest.mark.llama
async def test_a_full_context_goes_on_in_a_session_that_continues_it(tmp_path: Path) -> None:
    d = embedded(tmp_path / "loopd", session="summary_tokens = 60\n")
    d.config.write_text(d.config.read_text() + SMALL)
    await d.start()
    try:
        client = await d.connect()
        old = await welcome(client, {"type": "hello"})
        n, lines = await _fill(client)
        (continued,) = [line["event"] for line in lines if _kind(line) == "session_continued"]
        assert isinstance(continued, dict)
        new = continued["session"]
        assert continued["previous"] == old
        assert [_kind(line) for line in lines].index("compacting") < lines.index(
            next(line for line in lines if _kind(line) == "session_continued")
        )
        assert lines[-1]["type"] == "turn_done"  # the message that did not fit, answered
        assert (await client.turn("after", "And the first row?"))[-1]["type"] == "turn_done"
        await client.send({"type": "sessions"})
        listed = (await client.until("sessions"))[-1]
        chain = {s["id"]: s["continues"] for s in listed["sessions"]}
        assert chain == {old: None, new: old}
        assert listed["current"] == new
        # Going back: the old session's cache was saved to its file, for its next turn.
        assert await welcome(client, {"type": "open_session", "id": old}) == old
        await client.send({"type": "status"})
        assert (await client.until("status"))[-1]["session"] == old
    finally:
        await d.end()
    text = d.log.read_text()
    assert f"saved the slot of session {old}" in text
    assert "own slot" not in text  # the summary ran on a free slot
    old_log, new_log = records(d, old), records(d, new)
    assert conversation_problems(old_log) == []
    assert conversation_problems(new_log) == []
    # The old log ends with the full turn, then where it went on (what an editor follows).
    assert old_log[-1] == ContinuedRecord(time=old_log[-1].time, session=new, by="compact")
    assert isinstance(old_log[-2], TurnEndRecord)
    assert old_log[-2].reason == "session_full"
    assert [r.content for r in old_log if isinstance(r, UserRecord)][-1] == WORDY.format(n=n)
    summary = new_log[0]
    assert isinstance(summary, SummaryRecord)
    assert (summary.session, summary.slot) == (old, 1)
    assert summary.text
    assert isinstance(summary.timings, Timings)
    assert summary.omitted > 0  # the old session filled the context: its start was left out
    assert summary.text in _header(d, new).baseline.system
    assert _header(d, new).continues == old
    assert [r.content for r in new_log if isinstance(r, UserRecord)] == [
        WORDY.format(n=n),
        "And the first row?",
    ]
    assert_no_loss(d, new)


async def test_compact_of_an_empty_session_or_with_no_summary_changes_nothing(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([Reply(content="One."), Reply(content="")]))
    client = await d.connect()
    session = await welcome(client, {"type": "hello"})
    await client.send({"type": "compact", "id": "c1"})
    failed = (await client.until("turn_failed"))[-1]
    assert failed["kind"] == "error"
    assert failed["message"] == "the session has nothing to summarise yet"
    assert (await client.turn("t1", "Say one word."))[-1]["content"] == "One."
    await client.send({"type": "compact", "id": "c2"})
    failed = (await client.until("turn_failed"))[-1]
    assert failed["message"] == "the model wrote an empty summary"
    await client.send({"type": "sessions"})
    assert [s["id"] for s in (await client.until("sessions"))[-1]["sessions"]] == [session]


async def _compact_and_come_back(d: Daemon) -> tuple[str, str]:
    """A turn, `compact`, a turn in the new session, then back to the old one for a turn;
    the two sessions' ids."""
    client = await d.connect()
    old = await welcome(client, {"type": "hello"})
    assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
    await client.send({"type": "compact", "id": "c1"})
    lines = await client.until("turn_done", timeout=120)
    (continued,) = [line["event"] for line in lines if _kind(line) == "session_continued"]
    assert lines[-1]["content"] == continued["summary"]
    assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
    assert await welcome(client, {"type": "open_session", "id": old}) == old
    assert (await client.turn("t3", "Name another colour."))[-1]["type"] == "turn_done"
    return old, continued["session"]


@pytest.mark.llama
async def test_compact_leaves_the_old_sessions_cache_as_it_was(tmp_path: Path) -> None:
    """The summary runs on the side slot: the old session, reopened, costs only its new
    tokens."""
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        old, new = await _compact_and_come_back(d)
    finally:
        await d.end()
    assert_no_loss(d, old)
    assert_no_loss(d, new)
    (summary,) = [r for r in records(d, new) if isinstance(r, SummaryRecord)]
    assert (summary.session, summary.slot, summary.omitted) == (old, 1, 0)


@pytest.mark.llama
async def test_compact_on_a_one_slot_server_saves_the_main_slot_first(
    llama: StartLlama, tmp_path: Path
) -> None:
    """A server with one slot has no slot free for the summary: loopd saves the session's
    cache and summarises on its own slot; the old session comes back with no loss."""
    server = await llama()
    d = Daemon(tmp_path / "loopd", server.url, history="exact")
    d.config.write_text(d.config.read_text() + SHORT)
    await d.start()
    try:
        old, new = await _compact_and_come_back(d)
    finally:
        await d.end()
    assert_no_loss(d, old)
    assert "the summary is written on its own slot" in d.log.read_text()
    (summary,) = [r for r in records(d, new) if isinstance(r, SummaryRecord)]
    assert (summary.session, summary.slot, summary.omitted) == (old, 0, 0)
    assert_no_loss(d, new)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_compact_in_the_chat_and_the_chain_in_sessions_and_log(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    replies = [
        Reply(content="Tomatoes are in row three."),
        Reply(content="The user keeps tomatoes in row three."),  # the summary
        Reply(content="Still row three."),
    ]
    d = await daemon(FakeLlama(replies))
    tmux = Tmux(f"compact-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", rows=40, columns=160)
    try:
        screen = await tmux.wait_for("/help for help")
        old = re.findall(r"session (\S+)", screen)[0]
        await tmux.keys("where are the tomatoes?", "Enter")
        await tmux.wait_for("Tomatoes are in row three.")
        await tmux.keys("/compact", "Enter")
        screen = await tmux.wait_for("from a summary")
        assert "summary: The user keeps tomatoes in row three." in screen
        new = re.findall(r"session (\S+) continues", screen)[0]
        await tmux.keys("and now?", "Enter")
        await tmux.wait_for("Still row three.")
        await tmux.keys("/sessions", "Enter")
        screen = await tmux.wait_for("  2. ")
        assert f"* {new}" in screen
        assert f"continues {old}" in " ".join(screen.split())  # the line may wrap
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    listed = await _bxctl(d, "sessions")
    assert f"{new}" in listed
    assert f"continues {old}" in listed
    log = await _bxctl(d, "log", new)
    order = [
        f"session {old}",
        "you: where are the tomatoes?",
        f"session {new}",
        f"summary of session {old}: The user keeps tomatoes",
        "you: and now?",
    ]
    positions = [log.index(text) for text in order]
    assert positions == sorted(positions)


async def _bxctl(d: Daemon, *args: str) -> str:
    command = [sys.executable, "-m", "bxctl", "--config", str(d.config), *args]
    wide = {**os.environ, "COLUMNS": "200"}
    done = await trio.run_process(command, capture_stdout=True, env=wide)
    return done.stdout.decode()


async def test_a_tool_approved_for_the_session_stays_approved_after_a_compaction(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(
        daemon,
        tmp_path,
        read_file(),
        Reply(content="Milk."),
        Reply(content="The user buys milk; read_file is approved."),  # the summary
        read_file("today.md", "c2"),
        Reply(content="Still milk."),
    )
    client = await d.connect()
    old = await welcome(client, {"type": "hello"})
    await client.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    await event(client, "approval_needed")
    await approve(client, 1, "session")
    assert (await ended(client))["type"] == "turn_done"
    await client.send({"type": "compact", "id": "c1"})
    new = (await event(client, "session_continued"))["event"]["session"]
    assert (await ended(client, "c1"))["type"] == "turn_done"
    assert (await client.turn("t2", "and now?"))[-1]["content"] == "Still milk."
    header, new_log = Store(d.home / "sessions").read(new)[:2]
    assert (header.continues, header.grants) == (old, ("read_file",))
    assert [r.content for r in new_log if isinstance(r, ToolResultRecord)] == ["buy milk"]
    assert not [r for r in new_log if r.kind == "approval_request"]  # not asked again


@pytest.mark.parametrize("on_full", ["stop", "continue"])
async def test_on_full_says_whether_a_full_context_ends_the_turn_or_continues(
    daemon: StartDaemon, on_full: str
) -> None:
    replies = [
        Reply(content="One."),
        Reply(kind="context_full"),
        Reply(content="The user asked for a word."),  # the summary, when it continues
        Reply(content="Two."),
    ]
    d = await daemon(FakeLlama(replies), session=f'on_full = "{on_full}"\n')
    client = await d.connect()
    old = await welcome(client, {"type": "hello"})
    assert (await client.turn("t1", "Say one word."))[-1]["content"] == "One."
    lines = await client.turn("t2", "And another.")
    await client.send({"type": "sessions"})
    listed = [s["id"] for s in (await client.until("sessions"))[-1]["sessions"]]
    if on_full == "stop":
        assert (lines[-1]["type"], lines[-1]["kind"]) == ("turn_failed", "session_full")
        assert listed == [old]
    else:
        assert lines[-1]["content"] == "Two."
        assert len(listed) == 2
    old_log = records(d, old)
    if on_full == "continue":  # the old log says where it went on
        (new,) = [s for s in listed if s != old]
        last = old_log.pop()
        assert last == ContinuedRecord(time=last.time, session=new, by="compact")
    assert isinstance(old_log[-1], TurnEndRecord)
    assert old_log[-1].reason == "session_full"
