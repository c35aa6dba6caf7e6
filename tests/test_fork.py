"""Forks: a new session with another's history up to one of its turns, served from that
session's cache (its hot slot, or its slot file), the session forked left as it was. The
cache figures are the real llama-server's (SmolLM2, 4 slots); the refusals come from a
scripted one."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from conftest import StartDaemon
from loopd.infer import slot_tokens
from loopd.session.records import CacheLossRecord, UsageRecord, conversation_problems
from loopd.session.store import ParentCall, Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_hands import edit, notes_folder, write
from test_sessions import assert_no_loss, embedded, losses, records, welcome

QUESTIONS = ("Name a colour.", "Name a fruit.", "Name a tree.", "Name a bird.")


def usages(d: Daemon, session: str) -> list[UsageRecord]:
    return [r for r in records(d, session) if isinstance(r, UsageRecord)]


async def four_turns(client: LineClient) -> str:
    session = await welcome(client, {"type": "hello", "session": "new"})
    for n, question in enumerate(QUESTIONS):
        assert (await client.turn(f"p{n}", question))[-1]["type"] == "turn_done"
    return session


def assert_fork(d: Daemon, parent: str, fork: str, at: int) -> None:
    """`fork`'s history is `parent`'s up to turn `at`, and its first request reused all of it:
    nothing but its new message was computed."""
    header = Store(d.home / "sessions").read(fork)[0]
    assert (header.forked_from, header.at) == (parent, at)
    first = usages(d, fork)[at].timings
    assert first is not None
    # All the parent's slot held at that turn's end, and on a hot slot the template's tokens
    # that open the next message too (the parent's next turn starts as the fork's does).
    assert first.cache_n >= slot_tokens(usages(d, parent)[at - 1].timings)  # type: ignore[arg-type]
    assert not losses(d, fork)
    assert conversation_problems(records(d, fork)) == []


@pytest.mark.llama
async def test_a_fork_at_turn_2_is_served_from_the_parents_hot_slot(tmp_path: Path) -> None:
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        client = await d.connect()
        parent = await four_turns(client)
        before = Store(d.home / "sessions").path_of(parent).read_bytes()
        fork = await welcome(client, {"type": "fork_session", "at": 2})
        assert fork != parent
        assert (await client.turn("f1", "Name a river."))[-1]["type"] == "turn_done"
        assert Store(d.home / "sessions").path_of(parent).read_bytes() == before
        # The parent goes on from its slot file: its slot went to the fork.
        assert await welcome(client, {"type": "open_session", "id": parent}) == parent
        assert (await client.turn("p5", "Name a fish."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    assert_fork(d, parent, fork, at=2)
    assert_no_loss(d, parent)


@pytest.mark.llama
async def test_a_fork_whose_parent_lost_its_slot_is_restored_from_its_slot_file(
    tmp_path: Path,
) -> None:
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        client = await d.connect()
        parent = await four_turns(client)
        for n in range(4):  # every slot taken by another session: the parent's saved
            await welcome(client, {"type": "new_session"})
            assert (await client.turn(f"o{n}", QUESTIONS[n]))[-1]["type"] == "turn_done"
        fork = await welcome(client, {"type": "fork_session", "session": parent})
        assert (await client.turn("f1", "Name a river."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    assert f"restored the slot of session {parent} for its fork {fork}" in d.log.read_text()
    assert_fork(d, parent, fork, at=4)


@pytest.mark.llama
async def test_two_forks_of_one_point_at_once_are_each_served_from_the_cache(
    tmp_path: Path,
) -> None:
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        client = await d.connect()
        parent = await four_turns(client)
        forks: list[str] = []

        async def fork_and_turn(name: str) -> None:
            other = await d.connect()
            forks.append(await welcome(other, {"type": "fork_session", "session": parent}))
            assert (await other.turn(name, "Name a river."))[-1]["type"] == "turn_done"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fork_and_turn, "a")
            nursery.start_soon(fork_and_turn, "b")
        await client.send({"type": "status"})
        slots = (await client.until("status"))[-1]["slots"]
    finally:
        await d.end()
    held = {s["session"]: s["slot"] for s in slots if s["session"] in forks}
    assert len(set(held.values())) == 2  # each on a slot of its own
    for fork in forks:
        assert_fork(d, parent, fork, at=4)


async def refused(client: LineClient, message: dict[str, object], code: str) -> str:
    await client.send(message)
    error = (await client.until("error"))[-1]
    assert error["code"] == code, error
    text: str = error["message"]
    return text


async def test_a_fork_is_refused_where_it_cannot_be_made(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(content="one"), Reply(content="two and more", delay=0.5)]))
    client = await d.connect()
    parent = await welcome(client, {"type": "hello"})
    assert (await client.turn("t1", "first"))[-1]["type"] == "turn_done"
    fork: dict[str, object] = {"type": "fork_session", "session": parent}
    assert "no session" in await refused(client, {**fork, "session": "nope"}, "unknown_session")
    assert "no turn 3" in await refused(client, {**fork, "at": 3}, "fork_refused")
    await refused(client, {**fork, "at": 0}, "bad_message")
    store = Store(d.home / "sessions")
    with await store.create(store.read(parent)[0].baseline, parent=ParentCall(parent, 1, "c")) as s:
        child = s.id
    assert "sub-agent" in await refused(client, {**fork, "session": child}, "fork_refused")
    empty = await welcome(client, {"type": "new_session"})
    assert "no turn yet" in await refused(client, {**fork, "session": empty}, "fork_refused")
    await welcome(client, {"type": "open_session", "id": parent})
    await client.send({"type": "send", "id": "t2", "content": "second"})
    await client.until("event")  # the answer streams: the turn's message is in the log
    assert "still running" in await refused(client, fork, "fork_refused")
    assert (await client.until("turn_done"))[-1]["id"] == "t2"
    assert [r.kind for r in records(d, parent)].count("user") == 2
    assert len(list(store.directory.glob("*.jsonl"))) == 3  # no fork was written


async def test_a_fork_not_served_from_cache_records_the_loss_and_why(
    daemon: StartDaemon,
) -> None:
    """A server of one slot, taken by another session since, and no slot files."""
    d = await daemon(FakeLlama([Reply(content="one"), Reply(content="two"), Reply(content="3")]))
    client = await d.connect()
    parent = await welcome(client, {"type": "hello"})
    assert (await client.turn("t1", "first"))[-1]["type"] == "turn_done"
    await welcome(client, {"type": "new_session"})
    assert (await client.turn("o1", "other"))[-1]["type"] == "turn_done"
    fork = await welcome(client, {"type": "fork_session", "session": parent})
    assert (await client.turn("f1", "forked"))[-1]["type"] == "turn_done"
    (loss,) = losses(d, fork)
    assert loss.cached < loss.expected
    assert loss.reason == 'loopd keeps no slot files ([slots] save = "never")'
    assert not [r for r in records(d, parent) if isinstance(r, CacheLossRecord)]


def files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


async def test_a_rewind_with_files_puts_back_every_file_or_nothing_and_goes_on_from_there(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """Turns 2 and 3 write and edit files; a rewind to turn 1's end puts every one back and
    goes on in a fork whose next request extends turn 1's exactly. A file changed outside
    loopd since is named, and then nothing is put back and no fork is made."""
    notes = notes_folder(tmp_path)
    script = [
        Reply(content="answer-1"),
        write("new.md", "hello\n"),
        Reply(content="wrote it"),
        edit("today.md", "milk", "tea"),
        write("new.md", "bye\n", "c2"),
        Reply(content="edited them"),
        Reply(content="from turn 1"),
    ]
    fake = FakeLlama(script)
    d = await daemon(fake, tools=f'roots = ["{notes}"]')
    client = await d.connect()
    parent = await welcome(client, {"type": "hello", "session": "new", "cwd": str(notes)})
    await client.send({"type": "set_mode", "mode": "accept_edits"})
    await client.until("mode")
    assert (await client.turn("t1", "first"))[-1]["type"] == "turn_done"
    before = files_in(notes)
    for turn, text in (("t2", "write"), ("t3", "edit")):
        assert (await client.turn(turn, text))[-1]["type"] == "turn_done"
    assert files_in(notes) == {"new.md": b"bye\n", "today.md": b"buy tea\n"}
    store = Store(d.home / "sessions")
    (notes / "new.md").write_bytes(b"changed by hand\n")
    rewind = {"type": "rewind", "at": 1, "files": True}
    assert "new.md changed since" in await refused(client, rewind, "undo_refused")
    assert files_in(notes) == {"new.md": b"changed by hand\n", "today.md": b"buy tea\n"}
    assert [s.id for s in await store.sessions()] == [parent]  # no fork was made
    assert "no turn 4" in await refused(client, {**rewind, "at": 4}, "fork_refused")

    (notes / "new.md").write_bytes(b"bye\n")
    await client.send(rewind)
    undone = (await client.until("undone"))[-1]
    assert undone["paths"] == [str(notes / "new.md"), str(notes / "today.md")]
    fork = (await client.until("welcome"))[-1]["session"]
    assert files_in(notes) == before
    header = store.read(fork)[0]
    assert (header.forked_from, header.at) == (parent, 1)
    assert (await client.turn("f1", "again"))[-1]["type"] == "turn_done"
    turn_1, forked = fake.bodies[0]["messages"], fake.bodies[-1]["messages"]
    assert forked[: len(turn_1)] == turn_1
    assert [m["content"] for m in forked[len(turn_1) :]] == ["answer-1", "again"]
    assert fake.prompts[-1].startswith(fake.prompts[0])
    assert [r.kind for r in records(d, parent)].count("undo") == 1
