"""The tool calls of one turn: each answered in order, its approval (when its policy asks)
and its result written to the log before the event that reports them. `delegate` calls are
the exception: those of one answer start at once and run side by side with the others (each
is a sub-agent on a slot of its own); results still go to the log in call order. The turn
runs `update_plan` itself: the session's plan is its last `plan` record.

A call repeated with the same arguments in one turn is answered from the log once, and ends
the turn the third time (`[loop] repeat_detection`). The `pre_tool_use` and `post_tool_use`
hooks run around each call that runs (`loopd.hooks`), not around a repeat.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, TypeVar

import trio

from loopd.config import LoopConfig
from loopd.groups import leaf
from loopd.hooks import NO_HOOKS, Hooks, Tool
from loopd.infer import ToolCall
from loopd.session.baseline import untrusted_envelope
from loopd.session.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    PlanRecord,
    ToolResultRecord,
)
from loopd.session.store import ParentCall, Session, StoreError
from loopd.tools import (
    DELEGATE,
    PLAN,
    WRITE_TOOLS,
    Approval,
    Asking,
    CallOrigin,
    ModelAnswer,
    Registry,
    ToolOutput,
    ToolPort,
    answer_call,
    call_key,
    checked_plan,
    requested_tool,
)
from loopd.turn.changes import Hands
from loopd.wire.events import (
    ApprovalDecided,
    ApprovalNeeded,
    PlanUpdate,
    ToolCallStarted,
    ToolOutputChunk,
    ToolResult,
    TurnEvent,
)

__all__ = [
    "PLAN_TEXT",
    "REPEAT_TEXT",
    "Delegate",
    "RepeatedCall",
    "ToolCalls",
    "approval_needed",
    "cap_result",
    "loggable",
]

REPEAT_TEXT = (
    "Not run: this call was already made with these arguments in this turn; its result is above."
)
PREVIEW = 120
PLAN_TEXT = "Plan updated."
"""What the model reads back from `update_plan`: the plan is in its own call already."""


class RepeatedCall(Exception):
    """The same call a third time in one turn: the turn ends (a `TurnLimit` for the caller)."""


_STRAY = re.compile("[\ud800-\udc7f\udd00-\udfff]")
"""Lone surrogates that do not stand for a byte (`surrogateescape` uses U+DC80 to U+DCFF)."""


def loggable(text: str) -> str:
    """`text` as UTF-8 can hold it, for the log, the model and clients: a byte of a file name
    that is not UTF-8 (which Python reads as a lone surrogate) written as its escape, `\\xe9`;
    any other lone surrogate as U+FFFD. A record that holds one cannot be written."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raw = _STRAY.sub("\ufffd", text).encode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "backslashreplace")
    return text


def cap_result(text: str, cap: int) -> tuple[str, bool]:
    """At most `cap` characters: the head and the tail (where a command's summary and a
    read's "more from line N" are), with a marker saying how much of the middle was cut."""
    if len(text) <= cap:
        return text, False
    tail = cap // 2
    head = cap - tail
    cut = len(text) - cap
    return f"{text[:head]}\n[... {cut} characters cut here ...]\n{text[len(text) - tail :]}", True


OnEvent = Callable[[TurnEvent], None]
T = TypeVar("T")


class Delegate(Protocol):
    """Runs the sub-agent of one `delegate` call of a turn; its answer (or why there is none)
    is the call's result. The turn's events hear how it goes."""

    async def __call__(self, call: ParentCall, task: str, on_event: OnEvent) -> ToolOutput: ...


def approval_needed(asking: Asking, session: str | None = None) -> ApprovalNeeded:
    """The event that asks clients for an approval (of sub-agent `session`'s call)."""
    return ApprovalNeeded(
        call=asking.call,
        session=session,
        tool=asking.tool,
        arguments=asking.arguments,
        data_class=asking.data_class,
        untrusted=asking.untrusted,
        timeout=asking.timeout,
        preview=asking.preview,
        change=asking.change,
    )


@dataclass
class ToolCalls:
    """Answers the calls of one turn."""

    session: Session
    loop: LoopConfig
    port: ToolPort
    registry: Registry
    find_limit: int
    on_event: OnEvent
    delegate: Delegate | None = None
    hands: Hands | None = None
    hooks: Hooks = NO_HOOKS
    seen: Counter[tuple[str, str]] = field(default_factory=Counter)

    async def answer_round(self, calls: Sequence[ToolCall]) -> None:
        """Answer the calls of one answer; the results are in the log when this returns.

        Should the round end early (a repeated call, a cancel), the results of the calls
        before the first unanswered one are in the log, and no other."""
        answers: list[tuple[int, ModelAnswer] | None] = [None] * len(calls)
        written = 0

        async def answer(index: int, checked: tuple[ModelAnswer | None] | None = None) -> None:
            call = calls[index]
            number = self._started(call)
            (repeat,) = checked or (self._repeat(call),)
            answers[index] = (number, repeat or await self._run(call, number))

        # A nursery wraps what raises in it in a group: a repeat, or a record the log could not
        # take (which ends the turn and the session, in a call run beside others too), is
        # raised as itself.
        stopped: RepeatedCall | StoreError | None = None
        with _unwritten_as_itself():
            async with trio.open_nursery() as nursery:
                try:
                    together = [i for i, c in enumerate(calls) if self._delegates(c)]
                    for index in together:
                        # Checked here, so a third repeat ends the round before anything runs.
                        nursery.start_soon(answer, index, (self._repeat(calls[index]),))
                    for index in range(len(calls)):
                        if index not in together:
                            await answer(index)
                        while written < len(calls) and (done := answers[written]) is not None:
                            await self._write(calls[written], *done)
                            written += 1
                except (RepeatedCall, StoreError) as e:
                    stopped = e
                    nursery.cancel_scope.cancel()
        if stopped is not None:
            raise stopped
        for index in range(written, len(calls)):
            done = answers[index]
            assert done is not None  # noqa: S101 - the nursery ended with every call answered
            await self._write(calls[index], *done)

    def _delegates(self, call: ToolCall) -> bool:
        return self.delegate is not None and requested_tool(call.name, call.arguments) == DELEGATE

    def _started(self, call: ToolCall) -> int:
        number = self.session.next_call()
        self.on_event(
            ToolCallStarted(
                name=call.name, call=number, tool=requested_tool(call.name, call.arguments)
            )
        )
        return number

    async def _write(self, call: ToolCall, number: int, answer: ModelAnswer) -> None:
        text, truncated = cap_result(loggable(answer.text), self.loop.tool_result_cap)
        if answer.untrusted:
            text = untrusted_envelope(text)
        await self.session.append(
            ToolResultRecord(
                call=number,
                tool_call_id=call.id,
                name=call.name,
                content=text,
                data_class=answer.data_class,
                untrusted=answer.untrusted,
                truncated=truncated,
            )
        )
        self.on_event(
            ToolResult(
                name=call.name,
                call=number,
                data_class=answer.data_class,
                untrusted=answer.untrusted,
                truncated=truncated,
                preview=text.strip().split("\n", 1)[0][:PREVIEW],
                change=answer.change,
            )
        )

    def _repeat(self, call: ToolCall) -> ModelAnswer | None:
        """The answer to a call made before in this turn, which is not run again; raises
        `RepeatedCall` the third time."""
        key = call_key(call.name, call.arguments)
        self.seen[key] += 1
        if self.loop.repeat_detection and self.seen[key] > 1:
            if self.seen[key] > 2:
                raise RepeatedCall(
                    f"{call.name} was called a third time with the same arguments "
                    "in one turn ([loop] repeat_detection)"
                )
            return ModelAnswer(REPEAT_TEXT)
        return None

    async def _run(self, call: ToolCall, number: int) -> ModelAnswer:
        """The call's answer, its hooks run before and after it (`loopd.hooks`)."""
        tool, session = Tool.of(call.name, call.arguments), self.session
        if blocked := await self.hooks.before(session, number, call.id, tool):
            return ModelAnswer(blocked)
        answer = await self._answer(call, number)
        added = await self.hooks.after(session, number, call.id, tool, answer.text)
        return replace(answer, text=answer.text + added) if added else answer

    async def _answer(self, call: ToolCall, number: int) -> ModelAnswer:
        records = _CallRecords(self.session, call, number, self.on_event)
        session = self.session
        origin = CallOrigin(session.id, number, session.granted, session.cwd, session.mode)
        own: dict[str, Any] = {}
        if self.delegate is not None:
            parent = ParentCall(self.session.id, number, call.id)
            own[DELEGATE] = partial(self._delegate, self.delegate, parent)
        own[PLAN] = records.noted(partial(self._plan, number, call.id))
        if self.hands is not None:
            for tool in WRITE_TOOLS:  # the change goes to the log before the file
                own[tool] = records.noted(
                    partial(self.hands.write, self.session, number, call.id, tool)
                )
        answer = await answer_call(
            self.registry,
            self.port,
            call.name,
            call.arguments,
            origin,
            find_limit=self.find_limit,
            on_asking=records.on_asking,
            own=own,
            on_decided=records.on_decided,
            on_output=lambda text: self.on_event(ToolOutputChunk(call=number, text=text)),
        )
        if records.unwritten:
            raise records.unwritten[0]
        return answer

    async def _plan(
        self, number: int, call_id: str, arguments: dict[str, Any], _approved: Asking | None
    ) -> ToolOutput:
        """The session's plan, kept in its log (where status, a restart and a fork find it)
        before clients are told."""
        explanation, steps = checked_plan(arguments)
        record = PlanRecord(
            call=number,
            tool_call_id=call_id,
            explanation=None if explanation is None else loggable(explanation),
            steps=tuple(s.model_copy(update={"step": loggable(s.step)}) for s in steps),
        )
        await self.session.append(record)
        self.on_event(PlanUpdate.of(record))
        return ToolOutput(PLAN_TEXT)

    async def _delegate(
        self,
        delegate: Delegate,
        parent: ParentCall,
        arguments: dict[str, Any],
        _approved: Asking | None,
    ) -> ToolOutput:
        return await delegate(parent, arguments["task"], self.on_event)


@dataclass
class _CallRecords:
    """What one call writes to the log besides its result: its approval's request and
    decision, a write's `file_change`. A record the log could not take ends the turn (and the
    session): it is raised by `_run` after the call, not read by the model as a failed call,
    whatever the call's boundary made of it."""

    session: Session
    call: ToolCall
    number: int
    on_event: OnEvent
    unwritten: list[StoreError] = field(default_factory=list)

    def noted(self, run: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """`run`, its StoreError noted before it passes on."""

        async def noting(*args: Any) -> T:
            try:
                return await run(*args)
            except StoreError as e:
                self.unwritten.append(e)
                raise

        return noting

    async def on_asking(self, asking: Asking) -> None:
        record = ApprovalRequestRecord(
            call=self.number,
            tool_call_id=self.call.id,
            tool=asking.tool,
            arguments=asking.arguments,
            data_class=asking.data_class,
            untrusted=asking.untrusted,
            preview=asking.preview,
            basis=asking.basis,
        )
        await self.noted(self.session.append)(record)
        self.on_event(approval_needed(asking))

    async def on_decided(self, approval: Approval) -> None:
        # A record the moment it is given, before the call runs: a crash or a cancel while
        # the call runs keeps what the person said (and a `session` grant).
        tool, decision, by = approval.tool, approval.decision, approval.by
        record = ApprovalRecord(call=self.number, tool=tool, decision=decision, by=by)
        with trio.CancelScope(shield=True):
            await self.noted(self.session.append)(record)
        self.on_event(ApprovalDecided(call=self.number, tool=tool, decision=decision, by=by))


@contextmanager
def _unwritten_as_itself() -> Iterator[None]:
    """A record the log could not take, out of a nursery's group as itself."""
    try:
        yield
    except BaseExceptionGroup as group:
        if (unwritten := leaf(group, StoreError)) is None:
            raise
        raise unwritten from None
