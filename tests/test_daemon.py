"""`loopd serve` as a real process, with raw socket clients: the protocol, bad input, signals,
kill -9, and a second daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from conftest import NO_SLOT_FILES, StartDaemon, StartLlama, Unstarted
from loopd.actors import SAVE_AT_STOP
from loopd.infer import ToolCall, slot_tokens
from loopd.locations import default_socket
from loopd.server_proc import STOP_GRACE
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    TurnEndRecord,
    UsageRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from support.daemon import Daemon, LineClient, by_systemd, embedded
from support.fake_engine import Answer, fake_engine
from support.fake_llama import FakeLlama, Reply
from test_tools_mcp import SERVER as MCP_SERVER


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


async def run(command: list[str]) -> Ran:
    with trio.fail_after(60):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    return Ran(done.returncode, done.stdout.decode(), done.stderr.decode())


async def test_hello_send_events_and_turn_done(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "hello", "protocol": 2, "client": "test"})
    welcome = (await client.until("welcome"))[-1]
    assert welcome["protocol"] == 2
    got = await client.turn("t1", "hello")
    assert got[0] == {"type": "accepted", "id": "t1", "position": 0}
    kinds = [line["event"]["kind"] for line in got if line["type"] == "event"]
    assert "waiting" in kinds
    assert "content" in kinds
    done = got[-1]
    assert done["type"] == "turn_done"
    assert done["content"]
    assert done["usage"]["prompt_n"] > 0


async def test_a_subscribed_client_sees_another_clients_turn(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    alice, bob = await d.connect(), await d.connect()
    await bob.send({"type": "subscribe"})
    await bob.send({"type": "status"})
    await bob.until("status")  # the subscription is in place
    await alice.turn("a1", "hello")
    seen = await bob.until("turn_done")
    assert seen[-1]["id"] == "a1"
    assert any(line["type"] == "event" for line in seen)


async def test_sends_queue_in_order_up_to_the_bound_then_busy(daemon: StartDaemon) -> None:
    d = await daemon("plain", "plain", channel="queue_limit = 1\n", event_delay=0.05)
    client = await d.connect()
    for n in range(3):
        await client.send({"type": "send", "id": f"t{n}", "content": "hi"})
    lines = [await client.receive() for _ in range(3)]
    assert lines[0] == {"type": "accepted", "id": "t0", "position": 0}
    assert lines[1] == {"type": "accepted", "id": "t1", "position": 1}
    assert lines[2] is not None
    assert (lines[2]["type"], lines[2]["code"], lines[2]["id"]) == ("error", "busy", "t2")
    done = [line["id"] for line in await client.until("turn_done") if line["type"] == "turn_done"]
    done += [line["id"] for line in await client.until("turn_done") if line["type"] == "turn_done"]
    assert done == ["t0", "t1"]


BAD_LINES = [
    (b"\xff\xfe", "bad_utf8"),
    (b"{not json", "bad_json"),
    (b"[1, 2]", "not_object"),
    (b'"text"', "not_object"),
    (b'{"type": "dance"}', "unknown_type"),
    (b'{"content": "no type"}', "bad_message"),
    (b'{"type": "send", "content": "no id"}', "bad_message"),
    (b'{"type": "send", "id": 5, "content": "x"}', "bad_message"),
    (b'{"type": "cancel", "id": "nothing-runs"}', "unknown_turn"),
]


async def test_each_bad_line_gets_an_error_and_another_clients_turn_goes_on(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain", event_delay=0.02)
    good, bad = await d.connect(), await d.connect()
    await good.send({"type": "send", "id": "g1", "content": "hello"})
    for line, code in BAD_LINES:
        await bad.send(line)
        answer = await bad.receive()
        assert answer is not None
        assert (answer["type"], answer["code"]) == ("error", code), line
    await bad.send({"type": "status"})
    assert (await bad.until("status"))[-1]["busy"] in (True, False)  # still served
    assert (await good.until("turn_done"))[-1]["id"] == "g1"


async def test_a_line_over_the_cap_is_refused_and_the_connection_closed(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain", channel="max_line = 1000\n")
    client = await d.connect()
    await client.send(b'{"type": "send", "id": "x", "content": "' + b"a" * 5000 + b'"}')
    answer = await client.receive()
    assert answer is not None
    assert (answer["type"], answer["code"]) == ("error", "line_too_long")
    assert await client.receive() is None
    other = await d.connect()
    assert (await other.turn("o1", "hi"))[-1]["type"] == "turn_done"


async def test_garbage_without_end_closes_the_connection(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    client = await d.connect()
    for _ in range(25):
        await client.send(b"garbage")
    lines = []
    while (line := await client.receive()) is not None:
        lines.append(line)
    assert lines[-1]["type"] == "bye"
    assert sum(line["type"] == "error" for line in lines) == 20


async def test_half_a_line_then_gone_disturbs_nobody(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    half = await d.connect()
    await half.stream.send_all(b'{"type": "send", "id": "h", "con')
    await half.aclose()
    client = await d.connect()
    assert (await client.turn("c1", "hello"))[-1]["type"] == "turn_done"


async def test_a_client_that_stops_reading_is_dropped_and_disturbs_nobody(
    daemon: StartDaemon,
) -> None:
    # Paced like a fast model, and long enough to fill a deaf client's socket and outbox.
    long = Reply(content=" ".join(f"word{n}" for n in range(6000)), delay=0.0002)
    d = await daemon(FakeLlama([long]), FakeLlama([Reply(content="short")]))
    deaf = await d.connect()
    await deaf.send({"type": "subscribe"})  # then never reads while the turn streams
    client = await d.connect()
    first = await client.turn("c1", "talk a lot")
    assert first[-1]["type"] == "turn_done"
    assert sum(line["type"] == "event" for line in first) > 6000
    assert (await client.turn("c2", "again"))[-1]["type"] == "turn_done"
    heard = 0
    with trio.fail_after(30):
        while await deaf.receive() is not None:
            heard += 1
    assert heard < 6000  # cut off, then closed


async def test_a_client_that_subscribes_mid_turn_sees_the_rest(daemon: StartDaemon) -> None:
    d = await daemon("plain", event_delay=0.05)
    alice = await d.connect()
    await alice.send({"type": "send", "id": "a1", "content": "hello"})
    await alice.until("event")
    late = await d.connect()
    await late.send({"type": "subscribe"})
    seen = await late.until("turn_done")
    assert seen[-1]["id"] == "a1"


async def test_a_second_daemon_on_a_live_socket_refuses(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    second = await run(d.command("serve"))
    assert second.returncode == 3
    assert f"a loopd daemon already runs at {d.socket}" in second.stderr
    client = await d.connect()
    assert (await client.turn("t", "hi"))[-1]["type"] == "turn_done"


async def test_a_stale_socket_is_replaced(daemon: StartDaemon) -> None:
    d = await daemon("plain", "plain")
    await d.kill()  # leaves its socket behind
    assert d.socket.exists()
    await d.start()
    client = await d.connect()
    assert (await client.turn("t", "hi"))[-1]["type"] == "turn_done"


async def test_sigterm_says_bye_removes_the_socket_and_leaves_a_valid_log(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain", event_delay=0.2)
    client = await d.connect()
    await client.send({"type": "send", "id": "t", "content": "hello"})
    await client.until("event")
    assert await d.stop(signal.SIGTERM) == 0
    lines = []
    while (line := await client.receive()) is not None:
        lines.append(line)
    assert lines[-1] == {"type": "bye", "reason": "loopd is shutting down"}
    assert not d.socket.exists()
    store = Store(d.home / "sessions")
    latest = store.latest()
    assert latest is not None
    _, records, torn = store.read(latest)
    assert torn == 0
    assert [r.kind for r in records] == ["user", "turn_end"]
    assert conversation_problems(records) == []


async def test_kill_9_mid_turn_then_a_new_daemon_goes_on(daemon: StartDaemon) -> None:
    d = await daemon("plain", "plain", event_delay=0.2)
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "hello"})
    await client.until("event")
    await d.kill()
    await d.start()
    client = await d.connect()
    assert (await client.turn("t2", "again"))[-1]["type"] == "turn_done"
    store = Store(d.home / "sessions")
    latest = store.latest()
    assert latest is not None
    _, records, _ = store.read(latest)
    assert conversation_problems(records) == []
    assert [r.kind for r in records][:2] == ["user", "turn_end"]  # the interrupted turn, closed
    assert "interrupted" in d.log.read_text()


async def test_sessions_and_replay_commands(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.turn("t", "hello")
    listed = await run(d.command("sessions"))
    assert "1 turns" in listed.stdout
    replay = await run(d.command("replay", "latest"))
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.startswith("you: hello\nmodel: ")


@pytest.mark.llama
async def test_kill_9_mid_turn_on_a_real_server_loses_no_cache(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama()
    d = Daemon(tmp_path / "loopd", server.url, history="exact")
    (d.home / "loopd.toml").write_text(
        d.config.read_text() + "[loop]\nmax_tokens = 64\n[server.sampling]\ntemperature = 0\n"
    )
    await d.start()
    try:
        client = await d.connect()
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        await client.send({"type": "send", "id": "t2", "content": "Count to fifty."})
        await client.until("event")
        await d.kill()
        await d.start()
        client = await d.connect()
        assert (await client.turn("t3", "Name a fruit."))[-1]["type"] == "turn_done"
        store = Store(d.home / "sessions")
        latest = store.latest()
        assert latest is not None
        _, records, _ = store.read(latest)
        assert conversation_problems(records) == []
        assert "cache_loss" not in [r.kind for r in records]
        usages = [r for r in records if r.kind == "usage"]
        assert len(usages) >= 2
    finally:
        await d.end()


@pytest.mark.llama
async def test_the_embedded_llama_server_is_started_and_restarted(tmp_path: Path) -> None:
    """No [server] url: loopd starts the bundled server, and starts it again when it dies."""
    d = await embedded(tmp_path / "loopd")
    try:
        client = await d.connect()
        assert (await client.turn("t1", "Say hi."))[-1]["type"] == "turn_done"
        pids = re.findall(r"llama-server is up at \S+ \(pid (\d+)\)", d.log.read_text())
        assert len(pids) == 1
        os.kill(int(pids[0]), signal.SIGKILL)
        with trio.fail_after(60):
            while len(re.findall(r"llama-server is up", d.log.read_text())) < 2:  # noqa: ASYNC110
                await trio.sleep(0.1)
        assert (await client.turn("t2", "Say hi again."))[-1]["type"] == "turn_done"
        assert await d.stop() == 0
        assert not d.socket.exists()
    finally:
        await d.end()


async def test_a_stop_signal_while_llama_server_starts_stops_loopd_cleanly(tmp_path: Path) -> None:
    """SIGTERM is heard from the first moment, not only once loopd serves."""
    never_ready = tmp_path / "slow-llama-server"
    never_ready.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    never_ready.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    d = Daemon(tmp_path / "loopd", "")
    d.config.write_text(
        d.config.read_text().replace('url = ""\n', "")
        + f'[server.managed]\nbinary = "{never_ready}"\nmodel = "{model}"\n'
    )
    with d.log.open("ab") as log:
        d.process = await trio.lowlevel.open_process(d.command("serve"), stdout=log, stderr=log)
    try:
        with trio.fail_after(30):
            while not (await run(["pgrep", "-f", str(never_ready)])).stdout:  # noqa: ASYNC110
                await trio.sleep(0.05)
        d.process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await d.process.wait() == 0
        assert "SIGTERM: shutting down" in d.log.read_text()
        assert not d.socket.exists()
        assert not (await run(["pgrep", "-f", str(never_ready)])).stdout  # stopped with loopd
    finally:
        await d.kill()
        await run(["pkill", "-f", str(never_ready)])


def test_the_systemd_unit_waits_longer_than_a_stop_can_take() -> None:
    unit = (Path(__file__).parent.parent / "docs" / "loopd.service").read_text()
    (stop_seconds,) = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)
    assert int(stop_seconds) > SAVE_AT_STOP + STOP_GRACE


def test_the_systemd_socket_is_where_clients_look_and_the_service_needs_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = Path(__file__).parent.parent / "docs"
    socket_unit = (docs / "loopd.socket").read_text()
    (listen,) = re.findall(r"^ListenStream=(.+)$", socket_unit, re.MULTILINE)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # what a user unit's %t is
    assert Path(listen.replace("%t", str(tmp_path))) == default_socket()
    service = (docs / "loopd.service").read_text()
    assert re.search(r"^Requires=loopd\.socket$", service, re.MULTILINE)
    assert re.search(r"^Also=loopd\.socket$", service, re.MULTILINE)


async def test_a_second_daemon_on_the_same_store_refuses(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    other = Daemon(d.home.parent / "other", d.server_url, slots=NO_SLOT_FILES)
    other.config.write_text(
        other.config.read_text().replace(str(other.home / "sessions"), str(d.home / "sessions"))
    )
    ran = await run(other.command("serve"))
    assert ran.returncode == 1
    assert "is open for writing by another process" in ran.stderr
    assert not other.socket.exists()


async def test_replay_fails_on_a_log_that_is_not_a_valid_conversation(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "loopd", "http://127.0.0.1:9")
    with await Store(d.home / "sessions").create(make_baseline()) as session:
        await session.append(UserRecord(content="hello"))
        call = ToolCall(id="c1", name="find_tool", arguments="{}")
        await session.append(AssistantRecord(content=None, tool_calls=(call,)))
        await session.append(TurnEndRecord(reason="answer"))  # the call was never answered
    ran = await run(d.command("replay", session.id))
    assert ran.returncode == 1
    assert "calls left without results: ['c1']" in ran.stderr
    assert ran.stdout.startswith("you: hello\n⚙ find_tool {}\n")


@pytest.mark.llama
async def test_a_restart_of_loopd_keeps_its_own_llama_servers_cache(tmp_path: Path) -> None:
    """The embedded llama-server stops with loopd; the slot is saved and restored around it."""
    d = Daemon(tmp_path / "loopd", "", history="exact")
    text = d.config.read_text().replace('url = ""\n', "")
    d.config.write_text(text + "[loop]\nmax_tokens = 16\n[server.sampling]\ntemperature = 0\n")
    await d.start()
    try:
        client = await d.connect()
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        assert await d.stop() == 0
        await d.close_clients()
        await d.start()
        client = await d.connect()
        assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
    finally:
        await d.end()
    assert "restored the slot of session" in d.log.read_text()
    store = Store(d.home / "sessions")
    _, records, _ = store.read(store.latest() or "")
    usages = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    assert len(usages) == 2
    assert usages[1].cache_n == slot_tokens(usages[0])
    assert "cache_loss" not in [r.kind for r in records]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().split()[2]
        except (OSError, IndexError):
            continue
        if text in cmdline and "llama-server" in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


@pytest.mark.llama
async def test_a_killed_loopd_leaves_no_llama_server_behind(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "loopd", "", history="exact")
    d.config.write_text(d.config.read_text().replace('url = ""\n', ""))
    await d.start()
    try:
        # The socket answers before llama-server is up; wait for it to run.
        with trio.fail_after(60):
            while not processes_mentioning(str(d.home)):  # noqa: ASYNC110 - other processes
                await trio.sleep(0.1)
        await d.kill()  # SIGKILL: loopd cannot clean up after itself
        with trio.fail_after(20):
            while processes_mentioning(str(d.home)):  # noqa: ASYNC110 - other processes
                await trio.sleep(0.1)
    finally:
        await d.kill()


NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a folder away needs root")


@needs_root
async def test_a_socket_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "loopd", "http://127.0.0.1:9")
    d.socket.parent.mkdir(parents=True)
    os.chown(d.socket.parent, NOBODY, NOBODY)  # made first by someone else, as in a shared /tmp
    done = await run(d.command("serve"))
    assert done.returncode == 1
    assert f"loopd: {d.socket.parent} belongs to another user (uid {NOBODY})" in done.stderr
    assert not d.socket.exists()


async def test_a_socket_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "loopd", "http://127.0.0.1:9")
    (tmp_path / "elsewhere").mkdir()
    d.socket.parent.symlink_to(tmp_path / "elsewhere")
    done = await run(d.command("serve"))
    assert done.returncode == 1
    assert "is a symbolic link" in done.stderr


async def test_an_open_socket_folder_of_ours_is_made_private(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700
    await d.stop()
    d.socket.parent.chmod(0o755)
    await d.start()
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700


async def test_a_client_that_asks_and_never_reads_is_dropped_by_bytes(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain", channel="outbox_bytes = 20000\n")
    alice = await d.connect()
    await alice.turn("t1", "hello")
    lazy = await d.connect()
    # Fewer lines than the outbox holds, far more bytes than it may: each is the whole history.
    with contextlib.suppress(trio.BrokenResourceError):  # dropped while still asking
        for _ in range(500):
            await lazy.send({"type": "history"})
    with trio.fail_after(10):
        while "stopped reading; dropping it" not in d.log.read_text():  # noqa: ASYNC110
            await trio.sleep(0.05)
    await alice.send({"type": "status"})
    status = (await alice.until("status"))[-1]
    assert status["turns"] == 1
    assert status["context_size"] == 8192  # as the server's `GET /slots` said at start-up


async def served(d: Daemon) -> LineClient:
    """A connection the daemon serves (one it refused a moment ago may be served now)."""
    with trio.fail_after(10):
        while True:
            client = await d.connect()
            with contextlib.suppress(trio.BrokenResourceError):
                await client.send({"type": "status"})
                if (await client.receive() or {}).get("type") == "status":
                    return client
            await trio.sleep(0.05)


async def test_connections_beyond_the_cap_are_told_and_closed(daemon: StartDaemon) -> None:
    d = await daemon("plain", channel="max_clients = 2\n")
    first, _second = await served(d), await served(d)
    third = await d.connect()
    with trio.fail_after(5):
        refused = await third.receive()
    assert refused == {
        "type": "error",
        "code": "too_many_clients",
        "message": "loopd serves at most 2 clients at once ([channel] max_clients)",
        "id": None,
    }
    assert await third.receive() is None
    await first.aclose()
    await served(d)  # the first one's place is free again


async def test_a_hello_in_another_protocol_is_answered_with_an_error(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "hello", "protocol": 4, "client": "future"})
    error = (await client.until("error"))[-1]
    assert error["code"] == "protocol"
    assert (
        error["message"]
        == "this loopd speaks protocols 2 to 3, the client 4: update the older of the two"
    )


async def test_each_session_error_reaches_the_client_as_its_code(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """What the sessions refuse is an `error` line with its code, and the connection goes on."""
    d = await daemon(FakeLlama([]), session="max_live = 2\n")
    first, second = await d.connect(), await d.connect()
    refusals = [
        (first, {"type": "hello", "session": "new"}, None, ""),
        (first, {"type": "open_session", "id": "nope"}, "unknown_session", "nope"),
        (first, {"type": "new_session", "cwd": "/"}, "folder_refused", "root of the file system"),
        (second, {"type": "hello", "session": "new"}, None, ""),
        (second, {"type": "new_session"}, "too_many_sessions", "[session] max_live"),
    ]
    for client, message, code, says in refusals:
        await client.send(message)
        line = (await client.until("welcome" if code is None else "error"))[-1]
        assert (line.get("code"), says in line.get("message", "")) == (code, True), line
    await first.send({"type": "undo"})
    error = (await first.until("error"))[-1]
    assert error["code"] == "undo_refused"
    assert error["message"] == (
        "loopd changes no files in this session ([tools] roots is empty, and the session has "
        "no folder of its own)"
    )


async def test_a_duplicate_id_and_a_log_that_does_not_read_are_answered_with_their_codes(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([Reply(content="word " * 60, delay=0.05)]))
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "talk"})
    await client.until("accepted")
    await client.send({"type": "send", "id": "t1", "content": "again"})
    error = (await client.until("error"))[-1]
    assert (error["code"], error["id"]) == ("duplicate_id", "t1")
    broken = d.home / "sessions" / "20260101T000000000Z-abcdef.jsonl"
    broken.write_text("not a log\n")
    await client.send({"type": "open_session", "id": broken.stem})
    error = (await client.until("error"))[-1]
    assert error["code"] == "session_unavailable"
    assert broken.stem in error["message"]
    why = "line 1: not a record: Invalid JSON: expected ident at line 1 column 2"
    # loopd's own log says which log, which line and why, when it is opened and when listed.
    assert (
        f"session {broken.stem} cannot be opened: {broken}:1: not a record: " in d.log.read_text()
    )
    await client.send({"type": "sessions"})
    listed = (await client.until("sessions"))[-1]
    assert broken.stem not in [s["id"] for s in listed["sessions"]]
    assert listed["unreadable"] == [{"id": broken.stem, "reason": why}]
    assert f"{broken} is left out of the list of sessions: {why}" in d.log.read_text()
    by_loopd = await run(d.command("sessions"))
    assert f"{broken.stem}  does not read: {why}" in by_loopd.stdout.splitlines()
    by_bxctl = await run([sys.executable, "-m", "bxctl", "--config", str(d.config), "sessions"])
    assert f"! {broken.stem}  does not read: {why}" in by_bxctl.stdout.splitlines()


async def test_set_mode_is_answered_with_the_mode_and_a_bad_one_changes_nothing(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([]), loop="thinking = false")
    client = await d.connect()
    await client.send({"type": "hello", "session": "new"})
    session = (await client.until("welcome"))[-1]["session"]
    await client.send({"type": "set_mode"})
    asked = (await client.until("mode"))[-1]
    assert asked == {
        "type": "mode",
        "session": session,
        "mode": "ask",
        "thinking": False,
        "model": None,
        "models": [],
    }
    await client.send({"type": "set_mode", "mode": "yolo"})
    assert (await client.until("error"))[-1]["code"] == "bad_message"
    await client.send({"type": "set_mode", "mode": "accept_edits"})
    assert (await client.until("mode"))[-1]["mode"] == "accept_edits"
    await client.send({"type": "set_mode", "thinking": True})
    assert (await client.until("mode"))[-1] == {
        "type": "mode",
        "session": session,
        "mode": "accept_edits",
        "thinking": True,
        "model": None,
        "models": [],
    }
    logged = [r for r in Store(d.home / "sessions").read(session)[1] if r.kind == "mode"]
    assert len(logged) == 2  # asking, and the bad one, wrote nothing


# -- systemd's socket activation ------------------------------------------------------------


def systemd_listener(path: Path) -> socket.socket:
    """A listening socket at `path`, as a .socket unit's `ListenStream=` makes one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen()
    return sock


async def welcomed(d: Daemon) -> bool:
    """A hello on `d`'s socket is welcomed."""
    client = await d.connect()
    await client.send({"type": "hello", "protocol": 2, "client": "test"})
    welcome: dict[str, object] = (await client.until("welcome", timeout=10))[-1]
    return welcome["protocol"] == 2


async def test_a_socket_from_systemd_is_served_and_stays_for_the_next_start(
    unstarted: Unstarted,
) -> None:
    """loopd listens on the socket systemd passes (a loopd that bound its own would find this
    one live and refuse), leaves its file in place when it stops, and a second start serves
    on it again."""
    d = await unstarted(FakeLlama([]))
    with systemd_listener(d.socket) as listening:
        inode = d.socket.stat().st_ino
        by_systemd(d, listening.fileno())
        for _ in range(2):
            await d.start()
            assert await welcomed(d)
            assert await d.stop() == 0
            assert d.socket.stat().st_ino == inode
        await d.close_clients()
    assert d.log.read_text().count(f"listening on {d.socket} (systemd's socket)") == 2
    assert stat.S_IMODE(d.socket.stat().st_mode) == 0o600


async def test_a_socket_systemd_passed_to_another_process_is_ignored(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    """A `LISTEN_PID` not loopd's: the variables were meant for another process (sd_listen_fds
    ignores them too), and loopd binds its own socket."""
    d = await unstarted(FakeLlama([]))
    elsewhere = tmp_path / "elsewhere" / "other.sock"
    with systemd_listener(elsewhere) as listening:
        by_systemd(d, listening.fileno(), pid=str(os.getpid()))
        await d.start()
        assert await welcomed(d)
        assert await d.stop() == 0
        await d.close_clients()
    assert not d.socket.exists()  # its own, removed as it stops
    assert elsewhere.exists()
    assert "systemd's socket" not in d.log.read_text()


async def test_no_child_of_an_activated_loopd_sees_the_socket_or_its_variables(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    """An MCP server, started with loopd's environment, finds no `LISTEN_` variable and no
    fd 3."""
    seen = tmp_path / "seen"
    probe = (
        f"{{ env | grep ^LISTEN_; [ -e /proc/$$/fd/3 ] && echo fd 3; }} > {seen}.part; "
        f'mv {seen}.part {seen}; exec "{sys.executable}" "{MCP_SERVER}"'
    )
    tools = (
        f'roots = ["{tmp_path}"]\n[tools.mcp.probe]\ncommand = ["sh", "-c", {json.dumps(probe)}]'
    )
    d = await unstarted(FakeLlama([]), tools)
    with systemd_listener(d.socket) as listening:
        by_systemd(d, listening.fileno())
        await d.start()
        with trio.fail_after(30):
            while not seen.exists():  # noqa: ASYNC110 - another process's file
                await trio.sleep(0.05)
        assert await welcomed(d)  # it serves: "listening on" is said once start-up is done
        assert await d.stop() == 0
        await d.close_clients()
    assert "listening on" in d.log.read_text()
    assert seen.read_text() == ""


BAD_ACTIVATIONS = [
    ("two", "systemd passed LISTEN_FDS=2; loopd listens on one socket"),
    ("file", "systemd's fd 3 is not a socket"),
    ("bound", "systemd's fd 3 is not a listening Unix stream socket"),
    ("tcp", "systemd's fd 3 is not a listening Unix stream socket"),
]


@pytest.mark.parametrize(("passed", "said"), BAD_ACTIVATIONS)
async def test_a_socket_from_systemd_that_loopd_cannot_use_is_refused_saying_why(
    unstarted: Unstarted, tmp_path: Path, passed: str, said: str
) -> None:
    d = await unstarted(FakeLlama([]))
    with contextlib.ExitStack() as stack:
        if passed == "file":
            fd = stack.enter_context((tmp_path / "a-file").open("w")).fileno()
        else:
            family = socket.AF_INET if passed == "tcp" else socket.AF_UNIX
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            if passed == "tcp":
                sock.bind(("127.0.0.1", 0))
                sock.listen()
            elif passed == "bound":
                sock.bind(str(tmp_path / "not-listening.sock"))
            else:
                sock.bind(str(tmp_path / "two.sock"))
                sock.listen()
            fd = sock.fileno()
        by_systemd(d, fd, count="2" if passed == "two" else "1")
        with pytest.raises(RuntimeError, match="loopd exited"):
            await d.start()
    assert d.process is not None
    assert d.process.returncode == 1
    assert f"loopd: {said}" in d.log.read_text()
    assert not d.socket.exists()


@pytest.mark.parametrize(
    ("server", "why"),
    [
        ("no engine at [server] url", "is neither llama-server"),
        ("a llama-server that exits", "llama-server did not start"),
    ],
)
async def test_a_loopd_that_cannot_start_never_says_it_listens(
    tmp_path: Path, server: str, why: str
) -> None:
    """Its socket is bound first (a client that started it waits on it), but "listening on"
    comes only once start-up has succeeded: here it never does."""
    exits = tmp_path / "llama-server"
    exits.write_text("#!/bin/sh\nexit 1\n")
    exits.chmod(0o755)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    page = Answer(200, b"<html>a web page</html>", "text/html")
    with fake_engine({"/": page}) as web:
        d = Daemon(tmp_path / "loopd", web.url, history="exact")
        if server == "a llama-server that exits":
            text = d.config.read_text().replace(f'url = "{web.url}"\n', "")
            managed = f'[server.managed]\nbinary = "{exits}"\nmodel = "{tmp_path / "model.gguf"}"\n'
            d.config.write_text(text + managed)
        with d.log.open("ab") as log:
            process = await trio.lowlevel.open_process(d.command("serve"), stdout=log, stderr=log)
        with trio.fail_after(60):
            status = await process.wait()
    said = d.log.read_text()
    assert status == 1, said
    assert why in said
    assert "listening on" not in said
