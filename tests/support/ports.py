"""A tool-port actor for tests, running in the test's nursery until the test ends."""

from __future__ import annotations

import math
from functools import partial

import trio

from loopd.tools import (
    Answered,
    Asking,
    Executor,
    OnAsking,
    OnDecided,
    PortHandle,
    Registry,
    Runner,
    ToolRequest,
    run_tool_port,
)


async def _hold(
    registry: Registry,
    executors: dict[str, Executor],
    timeout: float,
    approval_timeout: float,
    *,
    task_status: trio.TaskStatus[PortHandle],
) -> None:
    async with run_tool_port(
        registry, executors, timeout=timeout, approval_timeout=approval_timeout
    ) as port:
        task_status.started(port)
        await trio.sleep_forever()


async def start_port(
    nursery: trio.Nursery,
    registry: Registry,
    executors: dict[str, Executor] | None = None,
    *,
    timeout: float = 5,
    approval_timeout: float = math.inf,
) -> PortHandle:
    """Errors of the code under test then reach the test as they are, not in a group."""
    hold = partial(_hold, registry, executors or {}, timeout, approval_timeout)
    port: PortHandle = await nursery.start(hold)
    return port


async def never_asked(asking: Asking) -> None:
    """For calls whose policy never asks: an approval there is a bug."""
    raise AssertionError(f"asked for an approval: {asking}")


class NoTools:
    """The port of a runtime with no tools: every call the model makes is answered by the
    dispatch ("no tool named ..."), so nothing may reach a port."""

    registry = Registry()

    async def call(
        self,
        request: ToolRequest,
        _: OnAsking,
        __: Runner | None = None,
        ___: OnDecided | None = None,
    ) -> Answered:
        raise AssertionError(f"a call reached the port of an empty registry: {request}")
