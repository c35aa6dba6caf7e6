"""Approvals that wait for a person: a real `loopd serve` on a scripted llama-server, real
files, raw socket clients and the real bxctl. A call of `read_file` asks (`policy = ask`)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import StartDaemon
from loopd.session.records import ApprovalRecord, Record, ToolResultRecord, conversation_problems
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from test_bxctl import Tmux
from test_tools_write import eventually, processes

EXIT_APPROVAL = 6


def read_file(path: str = "today.md", call_id: str = "c1") -> Reply:
    arguments = json.dumps({"name": "read_file", "arguments": {"path": path}})
    return Reply(tool_calls=((call_id, "call_tool", arguments),))


async def asking(
    daemon: StartDaemon, tmp_path: Path, *replies: Reply, timeout: float = 60
) -> Daemon:
    notes = tmp_path / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "today.md").write_text("buy milk")
    tools = (
        f'roots = ["{notes}"]\napproval_timeout = {timeout}\n'
        '[tools.policies.read_file]\naction = "ask"\nclass = "private"'
    )
    return await daemon(FakeLlama(list(replies)), tools=tools)


def log(d: Daemon, session: str | None = None) -> list[Record]:
    store = Store(d.home / "sessions")
    return list(store.read(session or store.latest() or "")[1])


def results(d: Daemon, session: str | None = None) -> list[str]:
    return [r.content for r in log(d, session) if isinstance(r, ToolResultRecord)]


def approvals(d: Daemon, session: str | None = None) -> list[tuple[int, str, str, str]]:
    records = log(d, session)
    return [(r.call, r.tool, r.decision, r.by) for r in records if isinstance(r, ApprovalRecord)]


async def event(client: LineClient, kind: str) -> dict[str, Any]:
    """The next event of `kind`."""
    while True:
        line = (await client.until("event"))[-1]
        if line["event"]["kind"] == kind:
            return line


async def approve(client: LineClient, call: int, decision: str) -> dict[str, Any]:
    await client.send({"type": "approve", "call": call, "decision": decision})
    return (await client.until("approved"))[-1]


async def ended(client: LineClient, turn: str = "t1") -> dict[str, Any]:
    while True:
        line = await client.receive()
        assert line is not None
        if line["type"] in ("turn_done", "turn_failed") and line["id"] == turn:
            return line


async def bxctl(d: Daemon, *args: str) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "bxctl", "--config", str(d.config), *args]
    with trio.fail_after(60):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_approve_once_runs_the_call_and_the_log_says_so(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="Milk."))
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    needed = (await event(client, "approval_needed"))["event"]
    assert needed == {
        "kind": "approval_needed",
        "call": 1,
        "session": None,  # the turn's own session: not a sub-agent's call
        "tool": "read_file",
        "arguments": {"path": "today.md"},
        "class": "private",
        "untrusted": False,
        "timeout": 60.0,
        "preview": None,  # reading a file: its arguments say all it will do
        "change": None,  # no file changes
    }
    approved = {"type": "approved", "call": 1, "session": None, "decision": "once"}
    assert await approve(client, 1, "once") == approved
    decided = (await event(client, "approval_decided"))["event"]
    assert (decided["decision"], decided["by"]) == ("once", "user")
    assert (await ended(client))["type"] == "turn_done"
    assert results(d) == ["buy milk"]
    assert approvals(d) == [(1, "read_file", "once", "user")]
    assert conversation_problems(log(d)) == []
    code, out, _ = await bxctl(d, "log")
    assert code == 0
    assert "read_file asked for approval (call 1) [private]" in out
    assert "approved once: read_file (call 1)" in out


async def test_approve_for_the_session_stops_asking_for_that_tool(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(
        daemon, tmp_path, read_file(), read_file("today.md ", "c2"), Reply(content="Milk, twice.")
    )
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "read it twice"})
    await event(client, "approval_needed")
    await approve(client, 1, "session")
    done = await ended(client)
    assert done["type"] == "turn_done"
    assert approvals(d) == [(1, "read_file", "session", "user")]
    assert len(results(d)) == 2
    assert [r.kind for r in log(d)].count("approval_request") == 1


async def test_deny_runs_nothing_and_tells_the_model_why(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="I could not read it."))
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    await event(client, "approval_needed")
    await approve(client, 1, "deny")
    assert (await ended(client))["type"] == "turn_done"
    assert results(d) == ["The call was denied: the user did not approve it"]
    assert approvals(d) == [(1, "read_file", "deny", "user")]


async def test_nobody_answers_the_call_is_denied_at_the_timeout(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="ok"), timeout=0.5)
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    decided = (await event(client, "approval_decided"))["event"]
    assert (decided["decision"], decided["by"]) == ("deny", "timeout")
    assert (await ended(client))["type"] == "turn_done"
    assert results(d) == ["The call was denied: nobody approved it within 0.5 s"]


async def test_cancelling_the_turn_while_a_call_waits_denies_it(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file())
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    await event(client, "approval_needed")
    await client.send({"type": "cancel", "id": "t1"})
    assert (await ended(client))["kind"] == "cancelled"
    assert results(d) == ["Not run: the turn ended (cancelled) while it waited for approval."]
    assert approvals(d) == [(1, "read_file", "deny", "turn_end")]
    assert conversation_problems(log(d)) == []
    await client.send({"type": "approve", "call": 1, "decision": "once"})
    error = (await client.until("error"))[-1]
    assert (error["code"], error["message"]) == ("unknown_call", "call 1 waits for no approval")


async def test_a_second_client_sees_the_waiting_call_and_approves_it(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="Milk."))
    first = await d.connect()
    await first.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    needed = await event(first, "approval_needed")
    # A client that connects while the call waits: status lists it, subscribe replays it.
    second = await d.connect()
    await second.send({"type": "status"})
    status = (await second.until("status"))[-1]
    assert status["pending"] == [needed]
    await second.send({"type": "subscribe"})
    assert await event(second, "approval_needed") == needed
    await approve(second, 1, "once")
    decided = (await event(first, "approval_decided"))["event"]
    assert (decided["decision"], decided["by"]) == ("once", "user")
    assert (await ended(first))["type"] == "turn_done"
    assert (await ended(second))["type"] == "turn_done"  # it watches every turn now
    assert results(d) == ["buy milk"]


async def test_kill_9_while_a_call_waits_then_restart_closes_it_not_approved(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="after the restart"))
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "what do I buy?"})
    await event(client, "approval_needed")
    await d.kill()
    assert [r.kind for r in log(d)][-1] == "approval_request"  # on disk before the event
    await d.start()
    client = await d.connect()
    await client.send({"type": "hello"})
    await client.until("welcome")  # the session is open, and its interrupted turn closed
    records = log(d)
    assert conversation_problems(records) == []
    assert approvals(d) == [(1, "read_file", "deny", "turn_end")]
    assert results(d) == ["Not run: the turn ended (error) while it waited for approval."]
    assert (await client.turn("t2", "and now?"))[-1]["type"] == "turn_done"
    _, out, _ = await bxctl(d, "log")
    assert "denied (the turn ended first): read_file (call 1)" in out


def run_command(command: str, call_id: str = "c1") -> Reply:
    arguments = json.dumps({"name": "run_command", "arguments": {"command": command}})
    return Reply(tool_calls=((call_id, "call_tool", arguments),))


async def test_kill_9_after_an_approval_keeps_it_as_given_and_its_grant(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """The approval is a record the moment it is given: loopd killed while the approved call
    runs keeps it (it was written only with the call's result, and the restart closed the call
    as denied), and a `session` grant holds after the restart."""
    d = await asking(
        daemon,
        tmp_path,
        run_command("sleep 60"),
        run_command("echo again", "c2"),
        Reply(content="ok"),
    )
    client = await d.connect()
    await client.send({"type": "send", "id": "t1", "content": "wait a minute"})
    await event(client, "approval_needed")
    await approve(client, 1, "session")
    with trio.fail_after(10):
        decided = (await event(client, "approval_decided"))["event"]  # before the call ends
    assert (decided["decision"], decided["by"]) == ("session", "user")
    await d.kill()
    assert approvals(d) == [(1, "run_command", "session", "user")]

    async def command_gone() -> bool:
        return "sleep 60" not in await processes()

    assert await eventually(command_gone)  # the sandbox dies with loopd, however it ends
    await d.start()
    client = await d.connect()
    await client.send({"type": "hello"})
    await client.until("welcome")
    assert approvals(d) == [(1, "run_command", "session", "user")]
    assert results(d) == ["Interrupted: the turn ended (error) while this approved call ran."]
    lines = await client.turn("t2", "once more")
    assert lines[-1]["type"] == "turn_done"
    assert not [x for x in lines if x.get("event", {}).get("kind") == "approval_needed"]
    assert results(d)[-1] == "exit status 0\nagain\n"
    assert conversation_problems(log(d)) == []


async def test_bxctl_chat_m_exits_6_on_an_approval_and_bxctl_approve_answers_it(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="Milk."))
    code, _, err = await bxctl(d, "chat", "-m", "what do I buy?")
    assert code == EXIT_APPROVAL
    (session,) = re.findall(r"bxctl approve 1 --once\|--session\|--deny --in (\S+)`", err)
    newer = await d.connect()  # a session made after it is the latest now
    await newer.send({"type": "hello", "session": "new"})
    await newer.until("welcome")
    code, out, _ = await bxctl(d, "status", "--in", session)
    assert "call 1: read_file" in out
    code, _, err = await bxctl(d, "approve", "9", "--once", "--in", session)
    assert (code, err.strip()) == (1, "bxctl: call 9 waits for no approval")
    code, _, _ = await bxctl(d, "approve", "1", "--session", "--in", session)
    assert code == 0
    client = await d.connect()
    await client.send({"type": "status"})
    with trio.fail_after(10):
        while (await client.until("status"))[-1]["busy"]:
            await trio.sleep(0.05)
            await client.send({"type": "status"})
    assert approvals(d, session) == [(1, "read_file", "session", "user")]
    assert results(d, session) == ["buy milk"]


async def test_bxctl_chat_m_yes_approves_each_call_once(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await asking(daemon, tmp_path, read_file(), Reply(content="Milk."))
    code, out, _ = await bxctl(d, "chat", "-m", "what do I buy?", "--yes")
    assert (code, out.strip()) == (0, "Milk.")
    assert approvals(d) == [(1, "read_file", "once", "user")]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_the_chat_asks_and_y_n_a_answer(daemon: StartDaemon, tmp_path: Path) -> None:
    d = await asking(
        daemon,
        tmp_path,
        read_file(),
        Reply(content="Milk, you said yes."),
        read_file(),
        Reply(content="Not read, you said no."),
        read_file(),
        read_file("./today.md", "c2"),
        Reply(content="Read twice, asked once."),
    )
    tmux = Tmux(f"approve-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", rows=40, columns=100)
    try:
        await tmux.wait_for("/help for help")
        await tmux.keys("what do I buy?", "Enter")
        screen = await tmux.wait_for("approve call 1?")
        assert '"path": "today.md"' in screen
        assert "result: private" in screen
        await tmux.keys("y")
        screen = await tmux.wait_for("Milk, you said yes.")
        assert "approved once: read_file (call 1)" in screen
        await tmux.keys("and again?", "Enter")
        await tmux.wait_for("approve call 2?")
        await tmux.keys("n")
        screen = await tmux.wait_for("Not read, you said no.")
        assert "denied: read_file (call 2)" in screen
        await tmux.keys("twice then", "Enter")
        await tmux.wait_for("approve call 3?")
        await tmux.keys("a")
        screen = await tmux.wait_for("Read twice, asked once.")
        assert "approve call 4?" not in screen
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    assert approvals(d) == [
        (1, "read_file", "once", "user"),
        (2, "read_file", "deny", "user"),
        (3, "read_file", "session", "user"),
    ]
    assert results(d)[-2:] == ["buy milk", "buy milk"]


async def test_a_call_id_an_earlier_answer_used_for_an_approved_call_is_not_taken_for_it(
    tmp_path: Path,
) -> None:
    """Ids repeat across answers (a raw stream numbers them afresh each time): closing a turn
    says a call of the last answer ran approved only if that answer's call was approved."""
    from loopd.infer import ToolCall  # noqa: PLC0415
    from loopd.session.baseline import make_baseline  # noqa: PLC0415 - this test alone
    from loopd.session.closing import close_turn  # noqa: PLC0415
    from loopd.session.records import (  # noqa: PLC0415
        ApprovalRequestRecord,
        AssistantRecord,
        UserRecord,
    )

    call = ToolCall(id="call00001", name="call_tool", arguments="{}")
    with await Store(tmp_path / "sessions").create(make_baseline()) as session:
        await session.append(UserRecord(content="go"))
        await session.append(AssistantRecord(content=None, tool_calls=(call,)))
        number = session.next_call()
        await session.append(
            ApprovalRequestRecord(
                call=number, tool_call_id=call.id, tool="run_command", arguments={}
            )
        )
        await session.append(
            ApprovalRecord(call=number, tool="run_command", decision="once", by="user")
        )
        await session.append(
            ToolResultRecord(call=number, tool_call_id=call.id, name=call.name, content="ran")
        )
        await session.append(AssistantRecord(content=None, tool_calls=(call,)))
        await close_turn(session, "cancelled")
        last = [r for r in session.records if isinstance(r, ToolResultRecord)][-1]
    assert last.content == "Not run: the turn ended first (cancelled)."
    assert last.call != number
