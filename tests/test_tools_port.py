"""The tool-port actor: the policy first, approvals that wait for a decision, then the call
under its deadline; every answer. Only its handle is used: calls, decisions, the pending list."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import trio

from loopd.config import Config, Policy
from loopd.session.records import Decision, Mode
from loopd.supervise import ActorFailed, GaveUp, Restarts
from loopd.tools import (
    BUILTIN,
    Answered,
    Approval,
    Asking,
    Denied,
    Failed,
    PortHandle,
    PortStopped,
    Registry,
    Result,
    ToolEntry,
    ToolFailure,
    ToolOutput,
    ToolRequest,
    builtin_entries,
    read_only_refusal,
    run_tool_port,
)
from loopd.tools._port import _Decide, _ListPending, _PortActor
from support.bugs import plant_bug
from support.ports import never_asked, start_port


class Scripted:
    """An executor whose tools do what their names say."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.cancelled = False
        self.hanging = trio.Event()

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        arguments = request.arguments
        self.ran.append(entry.name)
        if entry.name == "hang":
            self.hanging.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                self.cancelled = True
                raise
        if entry.name == "explode":
            raise RuntimeError("the disk is on fire")
        if entry.name == "refuse":
            raise ToolFailure("no such note")
        if entry.name == "error":
            return ToolOutput("server-side trouble", is_error=True)
        return ToolOutput(f"ran {entry.name} with {arguments}")


async def port(
    nursery: trio.Nursery,
    timeout: float = 0.2,
    approval_timeout: float = math.inf,
    **policies: Policy,
) -> tuple[PortHandle, Scripted]:
    names = ["echo", "hang", "explode", "refuse", "error", *policies]
    registry = Registry(
        ToolEntry(n, n, n, {"type": "object"}, "test", policies.get(n, Policy())) for n in names
    )
    executor = Scripted()
    handle = await start_port(
        nursery, registry, {"test": executor}, timeout=timeout, approval_timeout=approval_timeout
    )
    return handle, executor


def request(tool: str, call: int = 1, granted: frozenset[str] = frozenset()) -> ToolRequest:
    return ToolRequest(session="s", call=call, tool=tool, arguments={"x": 1}, granted=granted)


async def cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def answer(p: PortHandle, tool: str) -> object:
    return (await p.call(request(tool), never_asked)).answer


async def test_allow_runs_the_tool_and_gives_its_result_with_the_policy(
    nursery: trio.Nursery,
) -> None:
    p, executor = await port(nursery, mail=Policy(data_class="private", untrusted=True))
    assert await answer(p, "echo") == Result("ran echo with {'x': 1}", "public", False)
    assert await answer(p, "mail") == Result("ran mail with {'x': 1}", "private", True)
    assert executor.ran == ["echo", "mail"]


async def test_deny_refuses_before_anything_runs(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery, wipe=Policy(action="deny"))
    assert await answer(p, "wipe") == Denied("the policy for wipe is deny")
    assert executor.ran == []


async def asked_then_decided(
    nursery: trio.Nursery, p: PortHandle, decision: Decision, call: int = 1
) -> tuple[Answered, list[Asking]]:
    """Call `buy`; once it asks, check it is pending, then decide."""
    asked: list[Asking] = []

    async def on_asking(asking: Asking) -> None:
        asked.append(asking)
        assert [a.call for a in await p.pending("s")] == [call]
        assert await p.pending("another session") == []
        nursery.start_soon(p.decide, "s", call, decision)

    answered = await p.call(request("buy", call), on_asking)
    assert await p.pending("s") == []
    return answered, asked


async def test_ask_waits_for_approval_then_runs(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery, buy=Policy(action="ask", data_class="secret"))
    answered, asked = await asked_then_decided(nursery, p, "once")
    assert asked == [Asking(1, "buy", {"x": 1}, "secret", False, math.inf)]
    assert answered == Answered(
        Result("ran buy with {'x': 1}", "secret", False), Approval("buy", "once", "user")
    )
    assert executor.ran == ["buy"]


async def test_ask_denied_runs_nothing(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery, buy=Policy(action="ask"))
    answered, _ = await asked_then_decided(nursery, p, "deny")
    assert answered == Answered(
        Denied("the user did not approve it"), Approval("buy", "deny", "user")
    )
    assert executor.ran == []


async def test_ask_for_a_tool_granted_for_the_session_runs_without_asking(
    nursery: trio.Nursery,
) -> None:
    p, executor = await port(nursery, buy=Policy(action="ask"))
    answered = await p.call(request("buy", granted=frozenset({"buy"})), never_asked)
    assert answered == Answered(Result("ran buy with {'x': 1}", "public", False))
    assert executor.ran == ["buy"]


async def test_ask_nobody_answers_is_denied_at_the_timeout(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery, approval_timeout=0.1, buy=Policy(action="ask"))
    asked: list[Asking] = []

    async def on_asking(asking: Asking) -> None:
        asked.append(asking)

    answered = await p.call(request("buy"), on_asking)
    assert answered == Answered(
        Denied("nobody approved it within 0.1 s"), Approval("buy", "deny", "timeout")
    )
    assert len(asked) == 1
    assert executor.ran == []


async def test_a_decision_for_no_waiting_call_is_refused(nursery: trio.Nursery) -> None:
    p, _ = await port(nursery)
    assert not await p.decide("s", 7, "once")


async def test_cancelling_the_caller_while_it_waits_ends_the_wait(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery, buy=Policy(action="ask"))
    asked: list[Asking] = []

    with trio.CancelScope() as scope:

        async def on_asking(asking: Asking) -> None:
            asked.append(asking)
            scope.cancel()  # the caller goes away while the port waits for a decision

        await p.call(request("buy"), on_asking)
    assert len(asked) == 1
    assert scope.cancelled_caught
    assert await p.pending("s") == []
    assert not await p.decide("s", 1, "once")
    assert executor.ran == []


async def test_a_tool_that_hangs_is_stopped_at_the_timeout(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery)
    assert await answer(p, "hang") == Failed("hang did not finish within 0.2 s and was stopped")
    assert executor.cancelled


async def test_a_tool_that_raises_is_failed_not_a_crash(nursery: trio.Nursery) -> None:
    p, _ = await port(nursery)
    assert await answer(p, "explode") == Failed("RuntimeError: the disk is on fire")


async def test_a_tools_own_failure_is_passed_on_as_it_is(nursery: trio.Nursery) -> None:
    p, _ = await port(nursery)
    assert await answer(p, "refuse") == Failed("no such note")


async def test_a_result_marked_as_an_error_is_failed(nursery: trio.Nursery) -> None:
    p, _ = await port(nursery)
    assert await answer(p, "error") == Failed("server-side trouble")


async def test_a_tool_gone_from_the_registry_is_failed(nursery: trio.Nursery) -> None:
    p, _ = await port(nursery)
    assert await answer(p, "vanished") == Failed("the tool vanished is no longer there")


async def test_cancelling_the_caller_cancels_the_call(nursery: trio.Nursery) -> None:
    p, executor = await port(nursery, timeout=60)
    async with trio.open_nursery() as caller:
        with trio.CancelScope() as scope:
            caller.start_soon(cancel_when_set, executor.hanging, scope)
            await p.call(request("hang"), never_asked)
    assert scope.cancelled_caught
    await trio.testing.wait_all_tasks_blocked()
    assert executor.cancelled


async def test_a_call_to_a_port_that_has_stopped_says_so() -> None:
    registry = Registry([ToolEntry("echo", "echo", "echo", {"type": "object"}, "test", Policy())])
    async with run_tool_port(registry, {"test": Scripted()}, timeout=1) as handle:
        pass  # the block ends: the port stops
    with pytest.raises(PortStopped, match="the tool port has stopped"):
        await handle.call(request("echo"), never_asked)


async def test_a_bug_in_the_port_fails_the_message_it_held_and_the_calls_in_flight_go_on(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    p, executor = await port(nursery, buy=Policy(action="ask"))
    plant_bug(monkeypatch, _PortActor, _Decide)
    asked, answered = trio.Event(), trio.Event()
    answers: list[Answered] = []

    async def on_asking(_: Asking) -> None:
        asked.set()

    async def buy() -> None:
        answers.append(await p.call(request("buy"), on_asking))
        answered.set()

    nursery.start_soon(buy)
    await asked.wait()
    lost = "the tool port failed (KeyError: 'a bug') while it held this request: send it again"
    with pytest.raises(ActorFailed) as failed:
        await p.decide("s", 1, "once")
    assert str(failed.value) == lost
    assert await answer(p, "echo") == Result("ran echo with {'x': 1}", "public", False)
    assert [a.call for a in await p.pending("s")] == [1]  # the waiting call still waits
    assert await p.decide("s", 1, "once")
    with trio.fail_after(5):
        await answered.wait()
    assert answers == [
        Answered(Result("ran buy with {'x': 1}", "public", False), Approval("buy", "once", "user"))
    ]
    assert executor.ran == ["echo", "buy"]
    assert "the tool port failed, and starts again (1 of 5 restarts within 60 s)" in caplog.text


async def test_a_port_that_keeps_failing_gives_up_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant_bug(monkeypatch, _PortActor, _ListPending, math.inf)
    registry = Registry([ToolEntry("echo", "echo", "echo", {"type": "object"}, "test", Policy())])
    why = r"^the tool port failed 3 times within 60 s, the last time with KeyError: 'a bug'$"
    with pytest.RaisesGroup(pytest.RaisesExc(GaveUp, match=why), flatten_subgroups=True):
        async with run_tool_port(
            registry, {"test": Scripted()}, timeout=1, restarts=Restarts(most=2)
        ) as p:
            for _ in range(2):
                with pytest.raises(ActorFailed):
                    await p.pending("s")
            with contextlib.suppress(ActorFailed):
                await p.pending("s")
            await trio.sleep_forever()  # the port stops


# -- a session's mode ------------------------------------------------------------------------


async def outcome_in_mode(
    nursery: trio.Nursery,
    tools: dict[str, object],
    mode: Mode,
    tool: str,
    granted: frozenset[str] = frozenset(),
) -> tuple[str, object]:
    """Call a built-in tool in a session of `mode` under `[tools]` as `tools` says: whether
    it ran, asked (and was approved) or was refused without asking, and its answer."""
    config = Config.model_validate({"tools": {"roots": ["/tmp"], **tools}}).tools  # noqa: S108
    executor = Scripted()
    p = await start_port(nursery, Registry(builtin_entries(config)), {BUILTIN: executor})
    asked: list[Asking] = []

    async def on_asking(asking: Asking) -> None:
        asked.append(asking)
        nursery.start_soon(p.decide, "s", 1, "once")

    call = replace(request(tool, granted=granted), mode=mode)
    answered = (await p.call(call, on_asking)).answer
    what = "asked" if asked else "ran" if executor.ran else "refused"
    return what, answered


EXPLICIT_ASK: dict[str, object] = {"policies": {"write_file": {"action": "ask"}}}


@pytest.mark.parametrize(
    ("tools", "mode", "tool", "expected"),
    [
        ({}, "ask", "write_file", "asked"),
        ({}, "ask", "read_file", "ran"),
        ({}, "accept_edits", "write_file", "ran"),
        ({}, "accept_edits", "edit_file", "ran"),
        ({}, "accept_edits", "run_command", "asked"),
        ({}, "read_only", "read_file", "ran"),
        ({}, "read_only", "write_file", "refused"),
        ({}, "read_only", "edit_file", "refused"),
        ({}, "read_only", "run_command", "refused"),
        # What the user configured holds: a mode only drops the built-in default.
        ({"policies": {"write_file": {"action": "deny"}}}, "accept_edits", "write_file", "refused"),
        (EXPLICIT_ASK, "accept_edits", "write_file", "asked"),
        ({"policies": {"builtin": {"action": "ask"}}}, "accept_edits", "edit_file", "asked"),
        (
            {"policies": {"write_file": {"class": "secret"}}, "class_actions": {"secret": "ask"}},
            "accept_edits",
            "write_file",
            "asked",
        ),
        ({"policies": {"write_file": {"action": "allow"}}}, "read_only", "write_file", "refused"),
        ({"policies": {"read_file": {"action": "ask"}}}, "read_only", "read_file", "refused"),
    ],
)
async def test_a_sessions_mode_decides_with_the_configured_policies(
    nursery: trio.Nursery, tools: dict[str, object], mode: Mode, tool: str, expected: str
) -> None:
    what, answered = await outcome_in_mode(nursery, tools, mode, tool)
    assert what == expected
    if what == "refused" and mode == "read_only" and "deny" not in str(tools):
        assert answered == Denied(read_only_refusal(tool))


async def test_read_only_refuses_a_tool_approved_for_the_session(nursery: trio.Nursery) -> None:
    """A grant from before the session went read-only lets nothing through."""
    granted = frozenset({"write_file", "run_command"})
    for tool in granted:
        what, answered = await outcome_in_mode(nursery, {}, "read_only", tool, granted)
        assert (what, answered) == ("refused", Denied(read_only_refusal(tool)))
