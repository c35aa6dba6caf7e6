"""Many conversations at once on the slots of one llama-server: a real `loopd serve` on the
embedded llama-server (`[server] slots = 4`, SmolLM2) with clients in sessions of their own;
the figures are llama-server's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from conftest import StartLlama
from loopd.session.records import TurnEndRecord, UserRecord, conversation_problems
from support.daemon import Daemon, LineClient
from test_sessions import SHORT, assert_no_loss, embedded, log_says, losses, records, welcome

pytestmark = pytest.mark.llama


async def clients_in_new_sessions(d: Daemon, count: int) -> tuple[list[LineClient], list[str]]:
    clients = [await d.connect() for _ in range(count)]
    sessions = [await welcome(c, {"type": "hello", "session": "new"}) for c in clients]
    assert len(set(sessions)) == count
    return clients, sessions


async def at_once(clients: list[LineClient], turn: str, text: str) -> None:
    """Each client sends `text` at the same moment; each turn is answered."""
    ends: dict[int, str] = {}

    async def one(n: int, client: LineClient) -> None:
        ends[n] = (await client.turn(turn, text, timeout=120))[-1]["type"]

    async with trio.open_nursery() as nursery:
        for n, client in enumerate(clients):
            nursery.start_soon(one, n, client)
    assert ends == dict.fromkeys(range(len(clients)), "turn_done")


async def test_four_sessions_at_once_run_together_and_each_extends_its_own_cache(
    tmp_path: Path,
) -> None:
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        clients, sessions = await clients_in_new_sessions(d, 4)
        await at_once(clients, "t1", "Name a colour.")
        await at_once(clients, "t2", "Name a fruit.")
        await clients[0].send({"type": "status"})
        slots = (await clients[0].until("status"))[-1]["slots"]
    finally:
        await d.end()
    assert sorted(s["session"] for s in slots) == sorted(sessions)  # each kept its slot
    for session in sessions:
        assert_no_loss(d, session)
    # The first turns ran together: each began before any of them ended.
    starts, ends = [], []
    for session in sessions:
        log = records(d, session)
        starts.append(next(r.time for r in log if isinstance(r, UserRecord)))
        ends.append(next(r.time for r in log if isinstance(r, TurnEndRecord)))
    assert max(starts) < min(ends)


async def test_six_sessions_on_four_slots_come_back_from_their_files_with_no_loss(
    tmp_path: Path,
) -> None:
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        clients, sessions = await clients_in_new_sessions(d, 6)
        for n, client in enumerate(clients):
            assert (await client.turn("t1", f"Name colour number {n}."))[-1]["type"] == "turn_done"
        for n, client in enumerate(clients):
            assert (await client.turn("t2", f"Name fruit number {n}."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    text = d.log.read_text()
    # The first two gave their slots to the last two, and took them back from the next two.
    assert f" goes from session {sessions[0]} to {sessions[4]}" in text
    assert f" goes from session {sessions[1]} to {sessions[5]}" in text
    assert f"restored the slot of session {sessions[0]}" in text
    for session in sessions:
        assert_no_loss(d, session)


async def test_a_kill_9_with_four_turns_running_leaves_every_log_valid(tmp_path: Path) -> None:
    d = embedded(tmp_path / "loopd")
    long = d.config.read_text().replace("max_tokens = 12", "max_tokens = 400")
    d.config.write_text(long)
    await d.start()
    try:
        clients, sessions = await clients_in_new_sessions(d, 4)
        for client in clients:
            await client.send({"type": "send", "id": "t1", "content": "Tell me a long story."})
        for client in clients:
            await client.until("event")  # every turn is running
        await d.kill()  # SIGKILL: nothing is closed, nothing saved
        await d.start()
        clients = [await d.connect() for _ in sessions]
        for client, session in zip(clients, sessions, strict=True):
            assert await welcome(client, {"type": "hello", "session": session}) == session
        await at_once(clients, "t2", "Name a fruit.")
    finally:
        await d.end()
    for session in sessions:
        log = records(d, session)
        assert conversation_problems(log) == []
        ends = [r.reason for r in log if isinstance(r, TurnEndRecord)]
        assert ends == ["error", "answer"]  # the killed turn closed when its session opened
        assert [r.content for r in log if isinstance(r, UserRecord)][-1] == "Name a fruit."


async def turn_then_its_server_dies(
    llama: StartLlama, tmp_path: Path, *, shared: bool
) -> tuple[Daemon, str, str]:
    """Two llama-servers of one slot each in one loopd; a session's turn on the first, which
    is then killed, and its next turn. The daemon, the session and the second server's URL."""
    folders = (None, None) if shared else (tmp_path / "a", tmp_path / "b")
    for folder in folders:
        if folder:
            folder.mkdir()
    first, second = [await llama(slot_folder=folder) for folder in folders]
    d = Daemon(tmp_path / "loopd", first.url, history="exact")
    both = f'url = ["{first.url}", "{second.url}"]'
    d.config.write_text(d.config.read_text().replace(f'url = "{first.url}"', both) + SHORT)
    await d.start()
    try:
        client = await d.connect()
        session = await welcome(client, {"type": "hello", "session": "new"})
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        await log_says(d, f"saved the slot of session {session}")
        first.kill()
        await log_says(d, f"llama-server at {first.url} does not answer")
        assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
        await client.send({"type": "status"})
        status = (await client.until("status"))[-1]
    finally:
        await d.end()
    (slot,) = [s for s in status["slots"] if s["session"] == session]
    assert slot["server"] == second.url
    return d, session, second.url


async def test_a_session_whose_server_dies_goes_on_on_the_other_with_its_cache(
    llama: StartLlama, tmp_path: Path
) -> None:
    """The servers share their slot folder: the file the first saved, the second restores."""
    d, session, _ = await turn_then_its_server_dies(llama, tmp_path, shared=True)
    assert f"restored the slot of session {session}" in d.log.read_text()
    assert_no_loss(d, session)


async def test_without_a_shared_slot_folder_the_move_recomputes_and_records_it(
    llama: StartLlama, tmp_path: Path
) -> None:
    d, session, second = await turn_then_its_server_dies(llama, tmp_path, shared=False)
    assert f"could not restore slot 0 of {second}" in d.log.read_text()
    (loss,) = losses(d, session)
    assert loss.cached == 0
    assert conversation_problems(records(d, session)) == []
