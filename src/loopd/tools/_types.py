"""The types every part of the tools shares: a tool's entry in the registry, a call's request
and its answers, a tool's output and failure, and what an executor (a tool source) is.

The port (`_port`) decides on calls with these; the built-in tools, the MCP sources and the
callers that run a tool themselves produce and read them. They live apart from the port's
actor so that a tool needs nothing of the actor to say what it returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from loopd.config import Policy
from loopd.session.records import DataClass, Decision, Mode
from loopd.wire.events import FileChange

__all__ = [
    "MESSAGE_LIMIT",
    "Answered",
    "Approval",
    "Asking",
    "Denied",
    "Executor",
    "Failed",
    "Judges",
    "Judgment",
    "OnAsking",
    "OnDecided",
    "OnOutput",
    "PortAnswer",
    "PortStopped",
    "Preview",
    "Previews",
    "Result",
    "Runner",
    "ToolEntry",
    "ToolFailure",
    "ToolOutput",
    "ToolPort",
    "ToolRequest",
    "for_the_model",
]


# An exception's text is for the model; a traceback is for the log.
MESSAGE_LIMIT = 500


@dataclass(frozen=True)
class ToolEntry:
    name: str
    """The name the model passes to `call_tool`."""
    summary: str
    """One line: what it does."""
    description: str
    """The full description (often the same as the summary)."""
    schema: dict[str, Any]
    """JSON schema of the arguments object."""
    source: str
    """`builtin`, or the MCP server's name."""
    policy: Policy
    available: bool = True
    timeout: float | None = None
    """Seconds a call may take, when not `[tools] timeout` (a command's own bound)."""
    accepting: Policy | None = None
    """Its policy in a session whose mode is `accept_edits`; None: as `policy`."""

    def policy_in(self, mode: Mode) -> Policy:
        """Its policy in a session of mode `mode` (`read_only` is the port's to apply)."""
        if mode == "accept_edits" and self.accepting is not None:
            return self.accepting
        return self.policy


OnOutput = Callable[[str], None]
"""Hears a running call's output as it comes (`run_command`'s; other tools send none)."""


@dataclass(frozen=True)
class ToolRequest:
    session: str
    call: int
    """The session's number for this call."""
    tool: str
    arguments: dict[str, Any]
    granted: frozenset[str] = frozenset()
    """Tools a person approved for the rest of this session (from its log)."""
    cwd: Path | None = None
    """The session's own folder, the only one its file tools work in; None: all roots."""
    mode: Mode = "ask"
    """The session's mode when the call was made (`loopd.session.records.Mode`)."""
    on_output: OnOutput | None = field(default=None, compare=False, repr=False)
    """Hears its output while it runs, for the people watching; None: nobody listens."""


@dataclass(frozen=True)
class Result:
    content: str
    data_class: DataClass
    untrusted: bool
    change: FileChange | None = None
    """What a write made of its file (`ToolOutput.change`)."""


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Denied:
    reason: str


PortAnswer = Result | Failed | Denied


@dataclass(frozen=True)
class Asking:
    """The call waits for a person's approval; sent to its caller before the answer."""

    call: int
    tool: str
    arguments: dict[str, Any]
    data_class: DataClass
    untrusted: bool
    timeout: float
    preview: str | None = None
    """What the call would do (a diff, a command), as its tool's source says."""
    basis: str | None = None
    """What a write's preview was planned on (`Preview.basis`); None for other calls."""
    change: FileChange | None = None
    """A write's texts, before and after (`Preview.change`)."""


@dataclass(frozen=True)
class Approval:
    """How a call's approval ended."""

    tool: str
    decision: Decision
    by: Literal["user", "timeout"]


@dataclass(frozen=True)
class Answered:
    answer: PortAnswer
    approval: Approval | None = None
    """Set when the call waited for approval."""


def for_the_model(answer: PortAnswer) -> tuple[str, DataClass, bool]:
    """What the model reads for an answer (its content, or why there is none), its data class
    and whether it is untrusted."""
    if isinstance(answer, Result):
        return answer.content, answer.data_class, answer.untrusted
    if isinstance(answer, Failed):
        return f"The tool failed: {answer.message}", "public", False
    return f"The call was denied: {answer.reason}", "public", False


OnAsking = Callable[[Asking], Awaitable[None]]
OnDecided = Callable[["Approval"], Awaitable[None]]
"""Hears a person's answer (or its timeout) the moment it is given, before the call runs."""
Runner = Callable[[Asking | None], Awaitable["ToolOutput"]]
"""A tool the caller runs itself (a sub-agent, a write), under the port's policy and approvals;
given the `Asking` the call waited on (what the person approved), None when it did not wait."""


class ToolPort(Protocol):
    async def call(
        self,
        request: ToolRequest,
        on_asking: OnAsking,
        run: Runner | None = None,
        on_decided: OnDecided | None = None,
    ) -> Answered: ...


class PortStopped(Exception):
    """The tool-port actor is gone (loopd is stopping): the call got no answer."""


class ToolFailure(Exception):
    """A tool's own, expected failure; its message is shown to the model as it is."""


@dataclass(frozen=True)
class ToolOutput:
    text: str
    is_error: bool = False
    change: FileChange | None = None
    """What a write made of its file (the model reads `text` alone)."""


class Executor(Protocol):
    """Runs the tools of one source."""

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        """Run `request` (its arguments checked against `entry`'s schema)."""
        ...


@dataclass(frozen=True)
class Preview:
    """What a call would do, for the person asked to approve it."""

    text: str
    basis: str | None = None
    """What a write was planned on (the file's SHA-256, or that it did not exist): the write
    runs only while the file still matches it."""
    change: FileChange | None = None
    """A write's texts, before and after, where both are short text."""


@dataclass(frozen=True)
class Judgment:
    """A tool's own say on one call, by its arguments (`Judges`)."""

    action: Literal["allow", "deny"]
    reason: str = ""
    """Why a call is denied: the model reads it."""


@runtime_checkable
class Judges(Protocol):
    """An executor with a say on each call by its arguments, before its policy asks
    (`fetch_url`'s domain lists): `deny` refuses the call and `allow` runs it, both without
    asking; None leaves it to the policy. A policy of `deny` refuses it whatever this says."""

    def judge(self, entry: ToolEntry, request: ToolRequest) -> Judgment | None: ...


@runtime_checkable
class Previews(Protocol):
    """An executor that can say what a call would do, for the person asked to approve it."""

    async def preview(self, entry: ToolEntry, request: ToolRequest) -> Preview | None: ...
