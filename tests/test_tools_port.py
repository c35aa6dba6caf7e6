"""The port: the policy first, then the call under its deadline; every answer."""

from __future__ import annotations

from typing import Any

import trio

from loopd.config import Policy
from loopd.tools import (
    Denied,
    Failed,
    LocalToolPort,
    PendingApproval,
    Registry,
    Result,
    ToolEntry,
    ToolFailure,
    ToolOutput,
    ToolRequest,
)


class Scripted:
    """An executor whose tools do what their names say."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.cancelled = False

    async def run_tool(self, entry: ToolEntry, arguments: dict[str, Any]) -> ToolOutput:
        self.ran.append(entry.name)
        if entry.name == "hang":
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


def port(**policies: Policy) -> tuple[LocalToolPort, Scripted]:
    names = ["echo", "hang", "explode", "refuse", "error", *policies]
    registry = Registry(
        ToolEntry(n, n, n, {"type": "object"}, "test", policies.get(n, Policy())) for n in names
    )
    executor = Scripted()
    return LocalToolPort(registry, {"test": executor}, timeout=0.2), executor


def request(tool: str) -> ToolRequest:
    return ToolRequest(session="s", call=1, tool=tool, arguments={"x": 1})


async def test_allow_runs_the_tool_and_gives_its_result_with_the_policy() -> None:
    p, executor = port(mail=Policy(data_class="private", untrusted=True))
    assert await p.call(request("echo")) == Result("ran echo with {'x': 1}", "public", False)
    assert await p.call(request("mail")) == Result("ran mail with {'x': 1}", "private", True)
    assert executor.ran == ["echo", "mail"]


async def test_deny_refuses_before_anything_runs() -> None:
    p, executor = port(wipe=Policy(action="deny"))
    assert await p.call(request("wipe")) == Denied("the policy for wipe is deny")
    assert executor.ran == []


async def test_ask_is_pending_approval_and_nothing_runs() -> None:
    p, executor = port(buy=Policy(action="ask"))
    assert await p.call(request("buy")) == PendingApproval()
    assert executor.ran == []


async def test_a_tool_that_hangs_is_stopped_at_the_timeout() -> None:
    p, executor = port()
    answer = await p.call(request("hang"))
    assert answer == Failed("hang did not finish within 0.2 s and was stopped")
    assert executor.cancelled


async def test_a_tool_that_raises_is_failed_not_a_crash() -> None:
    p, _ = port()
    assert await p.call(request("explode")) == Failed("RuntimeError: the disk is on fire")


async def test_a_tools_own_failure_is_passed_on_as_it_is() -> None:
    p, _ = port()
    assert await p.call(request("refuse")) == Failed("no such note")


async def test_a_result_marked_as_an_error_is_failed() -> None:
    p, _ = port()
    assert await p.call(request("error")) == Failed("server-side trouble")


async def test_a_tool_gone_from_the_registry_is_failed() -> None:
    p, _ = port()
    assert await p.call(request("vanished")) == Failed("the tool vanished is no longer there")


async def test_cancelling_the_caller_cancels_the_call() -> None:
    p, executor = port()
    p.timeout = 60
    with trio.move_on_after(0.05) as scope:
        await p.call(request("hang"))
    assert scope.cancelled_caught
    assert executor.cancelled
