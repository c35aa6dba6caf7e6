"""A turn waits for a llama-server that cannot take its request yet (it loads its model, it is
being restarted, it cannot be reached) and goes on once it can; clients see the wait. A real
`loopd serve` on a scripted server, and on its own real llama-server, killed under it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from acp import schema

from bxctl.acp_map import update_of
from bxctl.view import TurnView
from conftest import NO_SLOT_FILES
from loopd.server_proc import LaunchSpec, start_server
from loopd.turn.waiting import NEVER_REACHED_WAIT
from loopd.wire.events import WaitingForServer
from loopd.wire.proto import Event
from support.daemon import Daemon, LineClient, embedded
from support.fake_llama import FakeLlama, Reply
from support.replay import Exchange, ReplayServer
from test_bxctl import Tmux, bxctl

LOADING = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


@dataclass
class Loading:
    """A scripted llama-server that answers 503 "Loading model", as a real one does while it
    loads, until `loading` is set false; then `fake` answers."""

    fake: FakeLlama
    loading: bool = True
    refused: int = 0
    requests: list[Any] = field(default_factory=list)

    def __call__(self, request: Any) -> Exchange:
        self.requests.append(request)
        if not self.loading:
            return self.fake(request)
        self.refused += 1
        return Exchange({}, 503, [("content-type", "application/json")], LOADING, {})


@dataclass
class Scripted:
    daemon: Daemon
    server: ReplayServer
    loading: Loading


@pytest.fixture
async def scripted(
    tmp_path: Path, nursery: trio.Nursery
) -> AsyncIterator[Callable[..., Awaitable[Scripted]]]:
    started: list[Daemon] = []

    async def start(*replies: Reply, loop: str = "") -> Scripted:
        loading = Loading(FakeLlama(list(replies)))
        server = ReplayServer([loading] * 1000)
        await nursery.start(server.run)
        d = Daemon(tmp_path / "loopd", server.url, slots=NO_SLOT_FILES)
        if loop:
            d.config.write_text(d.config.read_text() + f"[loop]\n{loop}\n")
        await d.start()
        started.append(d)
        return Scripted(d, server, loading)

    yield start
    for d in started:
        await d.end()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(proc.name))
    return found


def alive(pid: int) -> bool:
    """The process runs (a zombie does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def until_event(client: LineClient, kind: str) -> list[dict[str, Any]]:
    """Lines up to and including the first event of `kind`."""
    got = []
    with trio.fail_after(30):
        while (line := await client.receive()) is not None:
            got.append(line)
            if line["type"] == "event" and line["event"]["kind"] == kind:
                return got
    raise AssertionError(f"closed before a {kind!r} event; got {got}")


async def until_end(client: LineClient, turn: str, timeout: float = 60) -> list[dict[str, Any]]:
    got = []
    with trio.fail_after(timeout):
        while (line := await client.receive()) is not None:
            got.append(line)
            if line["type"] in ("turn_done", "turn_failed") and line["id"] == turn:
                return got
    raise AssertionError(f"closed before turn {turn} ended; got {got}")


def kinds(lines: list[dict[str, Any]]) -> list[str]:
    return [line["event"]["kind"] for line in lines if line["type"] == "event"]


async def test_a_turn_sent_while_the_server_loads_its_model_waits_and_answers(
    scripted: Callable[..., Awaitable[Scripted]],
) -> None:
    s = await scripted(Reply(content="back again"))
    client = await s.daemon.connect()
    await client.send({"type": "send", "id": "t1", "content": "hi"})
    seen = await until_event(client, "waiting_for_server")
    waiting = seen[-1]["event"]
    assert waiting["reason"] == "loading"
    assert "Loading model" in waiting["detail"]
    # More tries than the request's own retries (`attempts = 2` in the test config) would make.
    await s.server.wait_until(lambda: s.loading.refused >= 4)
    s.loading.loading = False
    rest = await until_end(client, "t1")
    assert rest[-1]["type"] == "turn_done"
    assert rest[-1]["content"] == "back again"
    assert kinds(rest).count("waiting_for_server") == 0  # said once, not on every try


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_a_message_sent_in_a_5_s_load_is_answered_and_bxctl_chat_shows_the_wait(
    scripted: Callable[..., Awaitable[Scripted]], tmp_path: Path
) -> None:
    """The server answers 503 "Loading model" for 5 s, longer than the request's own retries
    last: the chat says what it waits for, then the answer comes."""
    s = await scripted(Reply(content="loaded and here"))
    tmux = Tmux(f"wait-{id(s):x}")
    await tmux.chat(s.daemon, tmp_path / "state")
    try:
        await tmux.wait_for("/help for help")
        await tmux.keys("are you there?", "Enter")
        screen = await tmux.wait_for("waiting for the server")
        assert "it is loading its model" in screen
        await trio.sleep(5)
        s.loading.loading = False
        await tmux.wait_for("loaded and here")
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    assert s.loading.refused >= 4


async def test_a_request_that_fails_after_its_output_began_is_not_tried_again(
    scripted: Callable[..., Awaitable[Scripted]],
) -> None:
    s = await scripted(Reply(content="half an answer", kind="stream_error"))
    client = await s.daemon.connect()
    await client.send({"type": "send", "id": "t1", "content": "hi"})
    await until_event(client, "waiting_for_server")
    s.loading.loading = False
    rest = await until_end(client, "t1")
    assert "content" in kinds(rest)
    assert rest[-1]["type"] == "turn_failed"
    assert rest[-1]["kind"] == "infer"
    assert "reported an error in the stream" in rest[-1]["message"]
    answered = len(s.loading.requests) - s.loading.refused
    assert answered == 1  # the stream that failed, and no second try after its output


async def test_the_wait_ends_at_the_turns_deadline_with_a_turn_failed_saying_why(
    scripted: Callable[..., Awaitable[Scripted]],
) -> None:
    s = await scripted(loop="turn_timeout = 1")
    client = await s.daemon.connect()
    await client.send({"type": "send", "id": "t1", "content": "hi"})
    lines = await until_end(client, "t1")
    failed = lines[-1]
    assert failed["type"] == "turn_failed"
    assert failed["kind"] == "turn_limit"
    assert "the turn took longer than 1 s ([loop] turn_timeout)" in failed["message"]
    assert "while waiting for the server (loading)" in failed["message"]
    assert "Loading model" in failed["message"]
    assert kinds(lines).count("waiting_for_server") == 1
    assert s.loading.refused >= 2


async def test_a_cancel_ends_the_wait_at_once(
    scripted: Callable[..., Awaitable[Scripted]],
) -> None:
    s = await scripted()
    client = await s.daemon.connect()
    await client.send({"type": "send", "id": "t1", "content": "hi"})
    await until_event(client, "waiting_for_server")
    await client.send({"type": "cancel", "id": "t1"})
    failed = (await until_end(client, "t1", timeout=5))[-1]
    assert (failed["type"], failed["kind"]) == ("turn_failed", "cancelled")


def closed_port() -> int:
    """A port nothing listens on: bound, then closed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_chat_m_to_a_server_never_reached_fails_within_seconds_saying_why(
    tmp_path: Path,
) -> None:
    """A wrong `[server] url` (a closed port) is a failed turn soon, not a wait to the turn's
    deadline (900 s here), and a script reads the wait and the reason on stderr."""
    d = Daemon(tmp_path / "loopd", f"http://127.0.0.1:{closed_port()}", slots=NO_SLOT_FILES)
    d.config.write_text(d.config.read_text() + "[loop]\nturn_timeout = 900\n")
    await d.start()
    try:
        started = trio.current_time()
        code, out, err = await bxctl(d, "chat", "-m", "hi")
        waited = trio.current_time() - started
    finally:
        await d.end()
    assert (code, out) == (1, "")
    assert "bxctl: waiting for the server: it cannot be reached" in err
    assert "it has not answered once since loopd started: is [server] url right?" in err
    assert NEVER_REACHED_WAIT <= waited < 60  # the bound, not the turn's deadline


async def test_a_server_that_answered_once_is_waited_for_past_the_never_reached_bound(
    scripted: Callable[..., Awaitable[Scripted]],
) -> None:
    """A server loading its model (503) has answered: its wait is the turn's, not the bound."""
    s = await scripted(Reply(content="loaded"))
    client = await s.daemon.connect()
    await client.send({"type": "send", "id": "t1", "content": "hi"})
    await until_event(client, "waiting_for_server")
    await trio.sleep(NEVER_REACHED_WAIT + 1)
    s.loading.loading = False
    assert (await until_end(client, "t1"))[-1]["type"] == "turn_done"


@pytest.mark.llama
async def test_a_turn_sent_while_the_embedded_llama_server_is_killed_waits_for_its_restart(
    tmp_path: Path,
) -> None:
    """With exact history, whose prompt the server's template renders first, so that request
    waits too."""
    d = await embedded(tmp_path / "loopd")
    try:
        client = await d.connect()
        assert (await client.turn("t1", "Say hi."))[-1]["type"] == "turn_done"
        watchdogs = re.findall(r"llama-server is up at \S+ \(pid (\d+)\)", d.log.read_text())
        assert len(watchdogs) == 1
        server = children(int(watchdogs[0]))[0]
        os.kill(server, signal.SIGKILL)
        with trio.fail_after(10):
            while alive(server):  # noqa: ASYNC110 - no event tells of another's child
                await trio.sleep(0.01)
        lines = await client.turn("t2", "Say hi again.")
        assert lines[-1]["type"] == "turn_done", d.log.read_text()
        assert "waiting_for_server" in kinds(lines)
        assert "did not start" not in d.log.read_text()  # no old server left on the port
    finally:
        await d.end()


async def test_the_watchdog_exits_with_its_servers_status_when_the_server_ends(
    tmp_path: Path,
) -> None:
    """It used to abort at exit: its thread held stdin's lock ("_enter_buffered_busy")."""
    server = tmp_path / "short-lived-server"
    server.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    server.chmod(0o755)
    spec = LaunchSpec(binary=server, model=tmp_path / "model.gguf")
    running = await start_server(spec, 1, tmp_path / "server.log")
    with trio.fail_after(20):
        code = await running.process.wait()
    assert running.log_tail() == ""
    assert code == 3


def test_bxctl_chat_shows_the_wait_and_why() -> None:
    view = TurnView()
    wait = WaitingForServer(reason="loading", detail="llama-server answered HTTP 503")
    view.feed(Event(id="t1", event=wait))
    assert [note.plain for note in view.notes] == [
        "waiting for the server: it is loading its model (llama-server answered HTTP 503)"
    ]
    assert view.state == "waiting for the server"


def test_bxctl_acp_tells_the_wait_as_a_thought() -> None:
    wait = WaitingForServer(reason="restarting", detail="cannot connect")
    update = update_of(wait, "s1")
    assert isinstance(update, schema.AgentThoughtChunk)
    assert isinstance(update.content, schema.TextContentBlock)
    assert update.content.text == (
        "(waiting for the server: it is being restarted (cannot connect))\n"
    )
