"""Forks: a new session with another's history up to one of its turns, served from that
session's cache (its hot slot, or its slot file), the session forked left as it was. The
cache figures are the real llama-server's (SmolLM2, 4 slots), each equal to the physical limit
computed from the real tokens; the refusals come from a scripted one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from conftest import StartDaemon
from loopd.infer import PromptPiece, slot_tokens
from loopd.infer._prompt_json import one_prompt
from loopd.session.baseline import make_baseline
from loopd.session.fork import cache_source, fork
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    Record,
    TurnEndRecord,
    UsageRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import ParentCall, Store
from loopd.session.trail import PromptTrail
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_hands import edit, notes_folder, write
from test_sessions import assert_no_loss, embedded, losses, records, welcome

QUESTIONS = ("Name a colour.", "Name a fruit.", "Name a tree.", "Name a bird.")


def usages(d: Daemon, session: str) -> list[UsageRecord]:
    return [r for r in records(d, session) if isinstance(r, UsageRecord)]


async def answered(client: LineClient, turn: str, message: str) -> None:
    assert (await client.turn(turn, message))[-1]["type"] == "turn_done"


@asynccontextmanager
async def four_turns(tmp_path: Path) -> AsyncIterator[tuple[Daemon, LineClient, str]]:
    """A loopd with its own llama-server, a client, and the client's session of four turns
    (one request each); loopd ends with the block."""
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        client = await d.connect()
        session = await welcome(client, {"type": "hello", "session": "new"})
        for n, question in enumerate(QUESTIONS):
            await answered(client, f"p{n}", question)
        yield d, client, session
    finally:
        await d.end()


def requests(log: Sequence[Record]) -> list[tuple[list[PromptPiece], AssistantRecord]]:
    """Each request of a token-exact log: its whole prompt, and its answer."""
    trail, found = PromptTrail(), []
    for record in log:
        trail.add(record)
        if isinstance(record, AssistantRecord) and (last := trail.last()) and last[1] is record:
            found.append((list(last[0]), record))
    return found


async def tokens(client: LineClient, pieces: list[PromptPiece]) -> list[int]:
    """The tokens of a prompt of `pieces`, as the llama-server loopd runs reads it."""
    await client.send({"type": "status"})
    server = (await client.until("status"))[-1]["server"]
    async with httpx.AsyncClient(base_url=server) as http:
        body = {"content": one_prompt(pieces), "add_special": True, "parse_special": True}
        found: list[int] = (await http.post("/tokenize", json=body)).json()["tokens"]
        return found


async def held(client: LineClient, d: Daemon, session: str, request: int) -> list[int]:
    """What `session`'s slot held after its request number `request` (from 0): its prompt
    and the tokens generated, less the last (never evaluated)."""
    prompt, answer = requests(records(d, session))[request]
    timings = usages(d, session)[request].timings
    assert timings is not None
    assert len(await tokens(client, prompt)) == timings.prompt_tokens
    return (await tokens(client, [*prompt, *(answer.tokens or ())]))[: slot_tokens(timings)]


async def shared(client: LineClient, d: Daemon, source: str, fork: str, request: int) -> int:
    """The physical limit of `fork`'s request number `request` served from `source`'s
    cache: the tokens its prompt shares with what `source`'s slot held after its last
    request (a hot slot's, or the slot file saved from it)."""
    slot = await held(client, d, source, len(usages(d, source)) - 1)
    prompt = await tokens(client, requests(records(d, fork))[request][0])
    pairs = zip(slot, prompt, strict=False)
    return next((n for n, (a, b) in enumerate(pairs) if a != b), min(len(slot), len(prompt)))


async def assert_fork(
    client: LineClient, d: Daemon, parent: str, fork: str, *, at: int, source: str | None = None
) -> None:
    """`fork`'s history is `parent`'s up to turn `at`, and its first request found in the
    cache all it shares with what the slot of `source` (the parent, by default) held: the
    rest of the parent's last message's opening included, nothing recomputed before it. To
    be called while `source` has made no request since `fork`'s."""
    header = Store(d.home / "sessions").read(fork)[0]
    assert (header.forked_from, header.at) == (parent, at)
    first = usages(d, fork)[at].timings
    assert first is not None
    assert first.cache_n == await shared(client, d, source or parent, fork, at)
    assert not losses(d, fork)
    assert conversation_problems(records(d, fork)) == []


@pytest.mark.llama
async def test_a_fork_at_turn_2_is_served_from_the_parents_hot_slot(tmp_path: Path) -> None:
    async with four_turns(tmp_path) as (d, client, parent):
        before = Store(d.home / "sessions").path_of(parent).read_bytes()
        fork = await welcome(client, {"type": "fork_session", "at": 2})
        assert fork != parent
        await answered(client, "f1", "Name a river.")
        assert Store(d.home / "sessions").path_of(parent).read_bytes() == before
        await assert_fork(client, d, parent, fork, at=2)
        # The parent goes on from its slot file: its slot went to the fork.
        assert await welcome(client, {"type": "open_session", "id": parent}) == parent
        await answered(client, "p5", "Name a fish.")
    assert_no_loss(d, parent)


@pytest.mark.llama
async def test_a_fork_whose_parent_lost_its_slot_is_restored_from_its_slot_file(
    tmp_path: Path,
) -> None:
    async with four_turns(tmp_path) as (d, client, parent):
        for n in range(4):  # every slot taken by another session: the parent's saved
            await welcome(client, {"type": "new_session"})
            await answered(client, f"o{n}", QUESTIONS[n])
        fork = await welcome(client, {"type": "fork_session", "session": parent})
        await answered(client, "f1", "Name a river.")
        await assert_fork(client, d, parent, fork, at=4)
    assert f"restored the slot of session {parent} for its fork {fork}" in d.log.read_text()


@pytest.mark.llama
async def test_two_forks_of_one_point_at_once_are_each_served_from_the_cache(
    tmp_path: Path,
) -> None:
    async with four_turns(tmp_path) as (d, client, parent):
        forks: list[str] = []

        async def fork_and_turn(name: str) -> None:
            other = await d.connect()
            forks.append(await welcome(other, {"type": "fork_session", "session": parent}))
            await answered(other, name, "Name a river.")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fork_and_turn, "a")
            nursery.start_soon(fork_and_turn, "b")
        await client.send({"type": "status"})
        slots = (await client.until("status"))[-1]["slots"]
        for fork in forks:
            await assert_fork(client, d, parent, fork, at=4)
    held_by = {s["session"]: s["slot"] for s in slots if s["session"] in forks}
    assert len(set(held_by.values())) == 2  # each on a slot of its own


@pytest.mark.llama
async def test_a_fork_of_a_fork_that_ran_no_turn_is_served_from_the_cache_up_the_chain(
    tmp_path: Path,
) -> None:
    """Only the parent's cache holds the tokens a fork of its fork shares with it."""
    async with four_turns(tmp_path) as (d, client, parent):
        fork = await welcome(client, {"type": "fork_session", "at": 3})
        of_fork = await welcome(client, {"type": "fork_session", "at": 2})
        await answered(client, "ff1", "Name a river.")
        await assert_fork(client, d, fork, of_fork, at=2, source=parent)
        await welcome(client, {"type": "open_session", "id": fork})
        await answered(client, "f1", "Name a fish.")  # its parent's slot file serves it
        await assert_fork(client, d, parent, fork, at=3)


@pytest.mark.llama
async def test_a_rewind_goes_on_from_turn_1_served_from_the_cache(tmp_path: Path) -> None:
    async with four_turns(tmp_path) as (d, client, parent):
        await client.send({"type": "rewind", "at": 1})
        rewound = (await client.until("welcome"))[-1]["session"]
        await answered(client, "r1", "Name a river.")
        await assert_fork(client, d, parent, rewound, at=1)
        turn_1 = await held(client, d, parent, 0)
        again = await tokens(client, requests(records(d, rewound))[1][0])
        assert again[: len(turn_1)] == turn_1  # it extends turn 1's request exactly


async def test_the_cache_of_a_fork_of_a_fork_is_sought_up_the_chain(tmp_path: Path) -> None:
    """Up to the nearest session that has made a request; one whose log is gone is taken
    as it is."""
    store = Store(tmp_path)
    with await store.create(make_baseline()) as parent:
        for turn in ("one", "two"):
            for record in (
                UserRecord(content=turn),
                AssistantRecord(content=turn),
                UsageRecord(timings=None),
                TurnEndRecord(reason="answer"),
            ):
                await parent.append(record)
        assert await cache_source(store, parent) is None
    first = await fork(store, parent.id, 2)
    of_first = await fork(store, first, 1)
    with await store.open(of_first) as session:
        assert await cache_source(store, session) == parent.id
        with await store.open(first) as forked:
            assert await cache_source(store, forked) == parent.id
            await forked.append(UserRecord(content="three"))
            await forked.append(UsageRecord(timings=None))
        assert await cache_source(store, session) == first
        store.path_of(first).unlink()
        assert await cache_source(store, session) == first
        await session.append(UserRecord(content="two again"))
        await session.append(UsageRecord(timings=None))
        assert await cache_source(store, session) is None


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
    made = {p.stem for p in store.directory.glob("*.jsonl")}
    assert made <= {parent, child, empty}  # no fork was written (empty goes, as nobody is in it)


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
