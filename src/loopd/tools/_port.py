"""The tool port: the policy, the deadline, and the one place where tools actually run.

`ToolRequest` in; `Result`, `Failed`, `Denied` or `PendingApproval` out. The policy decides
before anything runs. Each call runs in the caller's task under its own cancel scope, so
`tools.timeout` ends a call that hangs, and cancelling the turn cancels the call. A tool that
raises becomes `Failed` with a short message; the daemon never goes down with a tool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from loopd.records import DataClass

from ._entry import ToolEntry
from ._registry import Registry

__all__ = [
    "APPROVAL_TEXT",
    "Denied",
    "Executor",
    "Failed",
    "LocalToolPort",
    "PendingApproval",
    "PortAnswer",
    "Result",
    "ToolFailure",
    "ToolOutput",
    "ToolPort",
    "ToolRequest",
    "for_the_model",
]

log = logging.getLogger(__name__)

# An exception's text is for the model; a traceback is for the log.
MESSAGE_LIMIT = 500


@dataclass(frozen=True)
class ToolRequest:
    session: str
    call: int
    """The session's number for this call."""
    tool: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Result:
    content: str
    data_class: DataClass
    untrusted: bool


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Denied:
    reason: str


@dataclass(frozen=True)
class PendingApproval:
    """The policy says ask; the call waits for the user's approval."""


PortAnswer = Result | Failed | Denied | PendingApproval

APPROVAL_TEXT = "Not run: this call needs the user's approval, and this version cannot wait for it."


def for_the_model(answer: PortAnswer) -> tuple[str, DataClass, bool]:
    """What the model reads for an answer (its content, or why there is none), its data class
    and whether it is untrusted."""
    if isinstance(answer, Result):
        return answer.content, answer.data_class, answer.untrusted
    if isinstance(answer, Failed):
        return f"The tool failed: {answer.message}", "public", False
    if isinstance(answer, Denied):
        return f"The call was denied: {answer.reason}", "public", False
    return APPROVAL_TEXT, "public", False


class ToolPort(Protocol):
    async def call(self, request: ToolRequest) -> PortAnswer: ...


class ToolFailure(Exception):
    """A tool's own, expected failure; its message is shown to the model as it is."""


@dataclass(frozen=True)
class ToolOutput:
    text: str
    is_error: bool = False


class Executor(Protocol):
    """Runs the tools of one source."""

    async def run_tool(self, entry: ToolEntry, arguments: dict[str, Any]) -> ToolOutput: ...


class LocalToolPort:
    """The port over a registry and the executors of its sources."""

    def __init__(self, registry: Registry, executors: dict[str, Executor], timeout: float) -> None:
        self.registry = registry
        self.executors = executors
        self.timeout = timeout

    async def call(self, request: ToolRequest) -> PortAnswer:  # noqa: PLR0911 - one per answer
        entry = self.registry.get(request.tool)
        if entry is None:
            return Failed(f"the tool {request.tool} is no longer there")
        policy = entry.policy
        if policy.action == "deny":
            return Denied(f"the policy for {entry.name} is deny")
        if policy.action == "ask":
            return PendingApproval()
        executor = self.executors[entry.source]
        with trio.move_on_after(self.timeout) as deadline:
            try:
                output = await executor.run_tool(entry, request.arguments)
            except ToolFailure as e:
                return Failed(str(e)[:MESSAGE_LIMIT])
            except Exception as e:
                log.exception(
                    "tool %s raised (session %s, call %d)",
                    entry.name,
                    request.session,
                    request.call,
                )
                return Failed(f"{type(e).__name__}: {e}"[:MESSAGE_LIMIT])
        if deadline.cancelled_caught:
            return Failed(f"{entry.name} did not finish within {self.timeout:g} s and was stopped")
        if output.is_error:
            return Failed(output.text[:MESSAGE_LIMIT] or f"{entry.name} reported an error")
        return Result(output.text, policy.data_class, policy.untrusted)
