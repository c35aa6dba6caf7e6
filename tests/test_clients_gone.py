"""A turn that no client follows any more does not hold its slot: once every client of its
session has gone, loopd cancels it (a `cancelled` turn in the log) and drops the messages that
wait, so the next user is not queued behind an answer nobody reads; `bxctl chat -m` told to
stop (SIGTERM, a hang-up) cancels its turn first. A turn that waits for a person's approval
is left to `bxctl approve` (tests/test_approvals.py). A real `loopd serve` on a scripted server
with one slot, and real bxctl processes."""

from __future__ import annotations

import signal
import subprocess
import sys

import trio

from conftest import StartDaemon
from loopd.session.records import TurnEndRecord, UserRecord
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_bxctl import bxctl

SLOW = Reply(content=" ".join(["word"] * 1000), delay=0.1)
"""An answer of 100 s: longer than any test here waits."""


def ends(d: Daemon, session: str) -> list[str]:
    """The `turn_end` reasons of the session's log, in order."""
    _, records, _ = Store(d.home / "sessions").read(session)
    return [r.reason for r in records if isinstance(r, TurnEndRecord)]


async def until_content(client: LineClient) -> str:
    """Wait until the turn's answer streams; its session's id."""
    with trio.fail_after(30):
        while (line := await client.receive()) is not None:
            if line["type"] == "event" and line["event"]["kind"] == "content":
                break
    await client.send({"type": "status"})
    session: str = (await client.until("status"))[-1]["session"]
    return session


async def test_a_turn_whose_every_client_left_is_cancelled_and_frees_the_slot(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([SLOW, Reply(content="Next in line.")]))
    leaving = await d.connect()
    await leaving.send({"type": "hello", "session": "new"})
    await leaving.until("welcome")
    await leaving.send({"type": "send", "id": "t1", "content": "write at length"})
    left = await until_content(leaving)
    await leaving.aclose()  # as a killed client's connection closes
    # The next user's turn is answered, long before the abandoned one would have ended.
    code, out, _ = await bxctl(d, "chat", "-m", "hello?")
    assert (code, out) == (0, "Next in line.\n")
    assert ends(d, left) == ["cancelled"]


async def test_a_turn_goes_on_while_another_client_of_its_session_stays(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([Reply(content="Still here for you.", delay=0.3)]))
    sender = await d.connect()
    await sender.send({"type": "hello", "session": "new"})
    session = (await sender.until("welcome"))[-1]["session"]
    watcher = await d.connect()
    await watcher.send({"type": "hello", "session": session})
    await watcher.until("welcome")
    await watcher.send({"type": "subscribe"})
    await sender.send({"type": "send", "id": "t1", "content": "hi"})
    await until_content(sender)
    await sender.aclose()
    done = (await watcher.until("turn_done"))[-1]
    assert done["content"] == "Still here for you."
    assert ends(d, session) == ["answer"]


async def test_messages_that_wait_behind_an_abandoned_turn_are_dropped(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([SLOW, Reply(content="never sent")]))
    leaving = await d.connect()
    await leaving.send({"type": "hello", "session": "new"})
    await leaving.until("welcome")
    await leaving.send({"type": "send", "id": "t1", "content": "first"})
    await leaving.send({"type": "send", "id": "t2", "content": "second, queued"})
    session = await until_content(leaving)
    await leaving.aclose()
    with trio.fail_after(10):
        while not ends(d, session):  # noqa: ASYNC110 - another process's log: polled
            await trio.sleep(0.05)
    _, records, _ = Store(d.home / "sessions").read(session)
    assert [r.content for r in records if isinstance(r, UserRecord)] == ["first"]
    assert ends(d, session) == ["cancelled"]


async def test_sigterm_of_chat_m_cancels_its_turn_and_the_next_chat_is_answered(
    daemon: StartDaemon,
) -> None:
    """`timeout 120 bxctl chat -m ...` as a script runs it: the SIGTERM leaves no turn behind."""
    d = await daemon(FakeLlama([SLOW, Reply(content="Your turn now.")]))
    command = [sys.executable, "-m", "bxctl", "--config", str(d.config), "chat", "-m", "long"]
    process = await trio.lowlevel.open_process(
        command, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    assert process.stderr is not None
    with trio.fail_after(30):
        assert b"word" in await process.stdout.receive_some()  # the answer streams
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        code = await process.wait()
    said = (await process.stderr.receive_some()).decode()
    assert code == 128 + signal.SIGTERM
    assert "bxctl: SIGTERM: the turn is cancelled" in said
    session = Store(d.home / "sessions").latest()
    assert session is not None
    code, out, _ = await bxctl(d, "status", "--in", session)
    assert "turn     idle, 0 waiting" in out
    assert " busy" not in out  # no slot held
    code, out, _ = await bxctl(d, "chat", "-m", "and now?")
    assert (code, out) == (0, "Your turn now.\n")
    assert ends(d, session) == ["cancelled"]
