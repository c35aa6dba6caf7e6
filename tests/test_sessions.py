"""Sessions people live in: switching and resuming with the cache, no cache lost to a crash,
and slot files that do not fit detected, not trusted. A real `loopd serve` on the real
llama-server and model; the figures are llama-server's own."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import NO_SLOT_FILES, StartDaemon, StartLlama, asset
from loopd.infer import slot_tokens
from loopd.session.records import CacheLossRecord, Record, UsageRecord, conversation_problems
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_bxctl import Tmux

SHORT = "[loop]\nmax_tokens = 12\n[server.sampling]\ntemperature = 0\n"


def records(d: Daemon, session: str) -> list[Record]:
    return Store(d.home / "sessions").read(session)[1]


def assert_no_loss(d: Daemon, session: str) -> None:
    """Every request found all the slot held after the one before (the corrected figure)."""
    log = records(d, session)
    assert conversation_problems(log) == []
    assert not [r for r in log if isinstance(r, CacheLossRecord)]
    usages = [r.timings for r in log if isinstance(r, UsageRecord) and r.timings]
    for before, after in itertools.pairwise(usages):
        assert after.cache_n == slot_tokens(before)


def losses(d: Daemon, session: str) -> list[CacheLossRecord]:
    return [r for r in records(d, session) if isinstance(r, CacheLossRecord)]


async def welcome(client: LineClient, message: dict[str, Any]) -> str:
    await client.send(message)
    line = (await client.until("welcome"))[-1]
    session: str = line["session"]
    return session


async def log_says(d: Daemon, text: str, times: int = 1, timeout: float = 60) -> None:
    with trio.fail_after(timeout):
        while d.log.read_text().count(text) < times:  # noqa: ASYNC110 - another process writes it
            await trio.sleep(0.05)


def embedded(home: Path, slots: str = "", session: str = "") -> Daemon:
    """loopd with its own llama-server (the bundled one), history token-exact; `slots` and
    `session`: more lines of those tables."""
    d = Daemon(home, "", history="exact", slots=slots, session=session)
    d.config.write_text(d.config.read_text().replace('url = ""\n', "") + SHORT)
    return d


async def turn_kill_9_turn(d: Daemon, meanwhile: Callable[[], Awaitable[object]]) -> str:
    """A turn, `meanwhile`, a kill -9 of loopd, a new start and a second turn; the session."""
    await d.start()
    try:
        client = await d.connect()
        session = await welcome(client, {"type": "hello"})
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        await meanwhile()
        await d.end()
        await d.start()
        client = await d.connect()
        assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    return session


@pytest.mark.llama
async def test_switching_a_b_a_keeps_each_sessions_cache(llama: StartLlama, tmp_path: Path) -> None:
    server = await llama()
    d = Daemon(tmp_path / "loopd", server.url, history="exact")
    d.config.write_text(d.config.read_text() + SHORT)
    await d.start()
    try:
        client = await d.connect()
        a = await welcome(client, {"type": "hello"})
        assert (await client.turn("a1", "Name a colour."))[-1]["type"] == "turn_done"
        b = await welcome(client, {"type": "new_session"})
        assert (await client.turn("b1", "Name a fruit."))[-1]["type"] == "turn_done"
        assert await welcome(client, {"type": "open_session", "id": a}) == a
        assert (await client.turn("a2", "Name another colour."))[-1]["type"] == "turn_done"
        assert await welcome(client, {"type": "open_session", "id": "latest"}) == b
        assert (await client.turn("b2", "Name another fruit."))[-1]["type"] == "turn_done"
        await client.send({"type": "open_session", "id": "no-such-session"})
        error = (await client.until("error"))[-1]
        assert error["code"] == "unknown_session"
    finally:
        await d.end()
    assert_no_loss(d, a)
    assert_no_loss(d, b)
    assert len([r for r in records(d, a) if isinstance(r, UsageRecord)]) == 2


@pytest.mark.llama
async def test_a_kill_9_of_loopd_loses_no_cache(tmp_path: Path) -> None:
    """loopd's watchdog stops its llama-server with it; the slot saved after the turn comes
    back with the next start."""
    d = embedded(tmp_path / "loopd")
    session = await turn_kill_9_turn(d, partial(log_says, d, "saved the slot of session"))
    assert "restored the slot of session" in d.log.read_text()
    assert_no_loss(d, session)


@pytest.mark.llama
async def test_a_llama_server_that_died_comes_back_with_the_cache(tmp_path: Path) -> None:
    d = embedded(tmp_path / "loopd")
    await d.start()
    try:
        client = await d.connect()
        session = await welcome(client, {"type": "hello"})
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        await log_says(d, "saved the slot of session")
        pid = re.findall(r"llama-server is up at \S+ \(pid (\d+)\)", d.log.read_text())[-1]
        os.kill(int(pid), signal.SIGKILL)
        await log_says(d, "llama-server is up at", times=2)
        assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    assert "restored the slot of session" in d.log.read_text()  # when it took a slot again
    assert_no_loss(d, session)


LONG = (
    "Here is a note to keep in mind while we talk: the garden has {n} rows of beans, each row "
    "watered at dawn, weeded on Sundays, and picked when the pods are as long as a finger. "
    "The shed holds rakes, hoes, a wheelbarrow with a flat tyre and seeds for next spring. "
    "Name one vegetable."
)


async def past_the_window_then_restart(d: Daemon) -> tuple[LineClient, str]:
    """Four long turns in a new session (past Gemma 3's window), then a loopd restart; a
    client back in that session, and the session."""
    client = await d.connect()
    session = await welcome(client, {"type": "hello", "session": "new"})
    for n in range(4):
        assert (await client.turn(f"t{n}", LONG.format(n=n)))[-1]["type"] == "turn_done"
    await d.stop()
    await d.close_clients()
    await d.start()
    client = await d.connect()
    await welcome(client, {"type": "hello", "session": session})
    return client, session


@pytest.mark.llama
async def test_a_sliding_window_model_restores_everything_it_saved(tmp_path: Path) -> None:
    """Gemma 3 keeps only a 512-token window of most layers' cache unless llama-server runs
    with --swa-full (the embedded one does): a history past the window comes back whole
    after a loopd restart and after a llama-server kill."""
    model = asset("LOOPD_SWA_MODEL", ".cache/models/gemma-3-270m-q4_k_m.gguf")
    d = embedded(tmp_path / "loopd")
    d.config.write_text(d.config.read_text() + f'[server.managed]\nmodel = "{model}"\n')
    await d.start()
    try:
        client, session = await past_the_window_then_restart(d)
        saved = d.log.read_text().count("saved the slot of session")
        assert (await client.turn("after-restart", "And a fruit?"))[-1]["type"] == "turn_done"
        await log_says(d, "saved the slot of session", times=saved + 1)  # once it is idle
        pid = re.findall(r"llama-server is up at \S+ \(pid (\d+)\)", d.log.read_text())[-1]
        os.kill(int(pid), signal.SIGKILL)
        await log_says(d, "llama-server is up at", times=3)
        assert (await client.turn("after-kill", "And a nut?"))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    usages = [r.timings for r in records(d, session) if isinstance(r, UsageRecord) and r.timings]
    assert slot_tokens(usages[3]) > 512  # past the window
    assert d.log.read_text().count(f"restored the slot of session {session}") == 2
    assert_no_loss(d, session)


@pytest.mark.llama
async def test_a_sliding_window_server_without_swa_full_loses_the_restore_and_says_why(
    llama: StartLlama, tmp_path: Path
) -> None:
    """An external llama-server started without --swa-full on Gemma 3: after a loopd restart
    the slot file restores tokens the server cannot reuse; the loss is recorded, and the log
    says what to do. (The same test with the embedded server, which has --swa-full, loses
    nothing: above.)"""
    model = asset("LOOPD_SWA_MODEL", ".cache/models/gemma-3-270m-q4_k_m.gguf")
    server = await llama(n_ctx=4096, other_model=model)
    d = Daemon(tmp_path / "loopd", server.url, history="exact")
    d.config.write_text(d.config.read_text() + SHORT)
    await d.start()
    try:
        client, session = await past_the_window_then_restart(d)
        assert (await client.turn("after", "And a fruit?"))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    # Each turn loses a few tokens even before (llama-server's own SWA cache at work); the
    # restore gives none of the file's.
    assert losses(d, session)[-1].cached == 0
    assert "unless llama-server runs with --swa-full" in d.log.read_text()


@pytest.mark.llama
async def test_with_slots_saved_only_at_stop_a_kill_9_loses_the_cache_and_says_so(
    tmp_path: Path,
) -> None:
    d = embedded(tmp_path / "loopd", slots='save = "stop"')
    # A save after the turn would have happened within a second.
    session = await turn_kill_9_turn(d, partial(trio.sleep, 1))
    assert "saved the slot" not in d.log.read_text()
    (loss,) = losses(d, session)
    assert loss.cached < loss.expected


@pytest.mark.llama
async def test_a_stale_or_foreign_slot_file_is_detected_not_trusted(tmp_path: Path) -> None:
    d = embedded(tmp_path / "loopd")
    slot_file = d.home / "slots"
    await d.start()
    try:
        client = await d.connect()
        session = await welcome(client, {"type": "hello"})
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        await log_says(d, "saved the slot of session")
        stale = tmp_path / "stale.bin"
        shutil.copy(slot_file / f"{session}.bin", stale)
        assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
        assert await d.stop() == 0  # saves the slot as it is now
        await d.close_clients()
        # A stale file: the session grew since it was saved.
        shutil.copy(stale, slot_file / f"{session}.bin")
        await d.start()
        client = await d.connect()
        assert (await client.turn("t3", "Name a tree."))[-1]["type"] == "turn_done"
        assert await d.stop() == 0
        await d.close_clients()
        # Not a slot file of this model at all.
        (slot_file / f"{session}.bin").write_bytes(b"not a slot file" * 100)
        await d.start()
        client = await d.connect()
        assert (await client.turn("t4", "Name a bird."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    text = d.log.read_text()
    assert "it is stale or not this session's" in text
    assert "could not restore slot 0 of http:" in text
    stale_loss, foreign_loss = losses(d, session)
    assert 0 < stale_loss.cached < stale_loss.expected
    assert foreign_loss.cached < foreign_loss.expected
    assert conversation_problems(records(d, session)) == []


async def test_bxctl_chat_goes_on_with_the_session_it_is_given(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await daemon(FakeLlama([Reply(content="one"), Reply(content="two"), Reply(content="3")]))
    client = await d.connect()
    first = await welcome(client, {"type": "hello"})
    await client.turn("t1", "first")
    second = await welcome(client, {"type": "new_session"})
    command = [sys.executable, "-m", "bxctl", "--config", str(d.config), "chat"]
    done = await trio.run_process(
        [*command, "--session", first, "-m", "back to the first"], capture_stdout=True
    )
    assert done.stdout.decode().strip() == "two"
    assert [r.kind for r in records(d, first)].count("user") == 2
    assert [r.kind for r in records(d, second)].count("user") == 0
    done = await trio.run_process(
        [*command, "--session", "nope", "-m", "hello"], capture_stderr=True, check=False
    )
    assert done.returncode == 2
    assert "no session" in done.stderr.decode().lower()
    assert NO_SLOT_FILES in d.config.read_text()  # a scripted server keeps no slot files


def listed(screen: str, start: str, title: str) -> bool:
    """A line of the screen starts with `start`, then the time of its last activity, then
    ends with `title`."""
    at = rf"^{re.escape(start)}  \d{{4}}-\d\d-\d\d \d\d:\d\d  {re.escape(title)}$"
    return re.search(at, screen, re.MULTILINE) is not None


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_sessions_and_resume_in_the_chat(daemon: StartDaemon, tmp_path: Path) -> None:
    """`/sessions` lists the sessions with their titles, the most recent first, and `/resume N`
    takes session N as that list showed it, whatever was active since."""
    replies = ["in one", "in two", "back in one", "from a script"]
    d = await daemon(FakeLlama([Reply(content=r) for r in replies]))
    tmux = Tmux(f"resume-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", rows=40, columns=120)
    try:
        screen = await tmux.wait_for("/help for help")
        first = re.findall(r"session (\S+)", screen)[0]
        await tmux.keys("hello one", "Enter")
        await tmux.wait_for("in one")
        await tmux.keys("/new", "Enter")
        second = re.findall(r"new session (\S+)", await tmux.wait_for("new session"))[0]
        await tmux.keys("hello two", "Enter")
        await tmux.wait_for("in two")
        await tmux.keys("/sessions", "Enter")
        screen = await tmux.wait_for("  2. ")
        assert listed(screen, f"  2.   {first}     1 turn ", "hello one")
        await tmux.keys("/resume 2", "Enter")
        screen = await tmux.wait_for("you: hello one")
        assert screen.count(f"session {first}") == 2  # the greeting, and the resume
        await tmux.keys("and again", "Enter")
        await tmux.wait_for("back in one")
        await tmux.keys("/sessions", "Enter")
        screen = await tmux.wait_for(f"2.   {second}")
        assert listed(screen, f"  1. * {first}     2 turns", "hello one")
        assert listed(screen, f"  2.   {second}     1 turn ", "hello two")
        command = [sys.executable, "-m", "bxctl", "--config", str(d.config), "chat"]
        await trio.run_process([*command, "--session", second, "-m", "meanwhile"])
        await tmux.keys("/resume 2", "Enter")  # the second as listed, now the most recent
        await tmux.wait_for("you: meanwhile")
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    assert [r.kind for r in records(d, first)].count("user") == 2
