"""The tool-port actor decides whether a call runs: the policy, the session's grants, and a
person's answer. It runs nothing: the call then runs in its caller's task (`PortHandle.call`,
one executor for every tool, under the call's deadline), so cancelling a turn ends its tools
and sub-agents inside the turn's own scope.

A call's question is a message in the actor's inbox; each waits in a task of the actor's own,
under a cancel scope its caller holds, so a cancelled turn ends its wait at once. `deny`
answers at once, `ask` makes the call wait for a person. The actor owns the approvals calls
wait for; a decision is a message too. A tool that raises becomes `Failed` with a short
message; the daemon never goes down with a tool.

    caller ── Call(request) ──▶ port ── Asking ──▶ caller      (only for `ask`)
    client ── Decide(call) ───▶ port
                                port ── Verdict ──▶ caller ── runs the tool

A session's mode (`ToolRequest.mode`) is applied here, so no client gets more than it allows:
`accept_edits` takes each tool's `ToolEntry.policy_in` that mode; `read_only` refuses the
tools that change the world, and every call that would ask, without asking. `deny` always
wins.

A call its caller runs itself (a `Runner`) is handed the `Asking` it waited on: what the
person approved, so that a write applies only the change they were shown.

A bug in the inbox loop (an error in `_PortActor.take`) restarts the loop on the same inbox
(`supervised`); the message it held is answered `ActorFailed`. The calls in flight go on: each
waits in a task of the port's nursery, which outlives the loop, and owns its pending approval.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial

import outcome
import trio

from loopd.inbox import Reply, answer, ask, reply_error, reply_value, run_for
from loopd.session.records import Decision
from loopd.supervise import RESTARTS, ActorFailed, Restarts, supervised

from ._registry import Registry, read_only_refuses
from ._types import (
    MESSAGE_LIMIT,
    Answered,
    Approval,
    Asking,
    Denied,
    Executor,
    Failed,
    Judges,
    OnAsking,
    OnDecided,
    PortAnswer,
    PortStopped,
    Previews,
    Result,
    Runner,
    ToolEntry,
    ToolFailure,
    ToolOutput,
    ToolRequest,
)

__all__ = ["PortHandle", "Verdict", "read_only_refusal", "run_tool_port"]

log = logging.getLogger(__name__)

# -- the inbox -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """The port's decision on a call: its tool runs, or `refusal` is its answer."""

    entry: ToolEntry | None
    refusal: Failed | Denied | None = None
    approval: Approval | None = None
    """How its approval ended, when it waited for one."""
    asking: Asking | None = None
    """What the person was shown, when it waited."""


_Note = Asking | outcome.Outcome[Verdict]


@dataclass
class _Call:
    request: ToolRequest
    reply: trio.MemorySendChannel[_Note]
    registry: Registry
    """The tools its caller sees (a session's own MCP servers' too): the call is decided on
    these."""
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass(frozen=True)
class _Decide:
    session: str
    call: int
    decision: Decision
    reply: Reply[bool]


@dataclass(frozen=True)
class _ListPending:
    session: str
    reply: Reply[list[Asking]]


_PortMessage = _Call | _Decide | _ListPending


@dataclass
class _Pending:
    asking: Asking
    scope: trio.CancelScope
    """The call's: once its caller cancels it, it waits for nothing, even before its task
    has unwound."""
    decided: trio.Event = field(default_factory=trio.Event)
    decision: Decision = "deny"

    @property
    def waiting(self) -> bool:
        return not (self.decided.is_set() or self.scope.cancel_called)


class PortHandle:
    """The side of the tool-port actor that turns and the session actor hold."""

    def __init__(
        self,
        inbox: trio.MemorySendChannel[_PortMessage],
        registry: Registry,
        executors: dict[str, Executor],
        timeout: float,
    ) -> None:
        self._inbox = inbox
        self.registry = registry
        """Read by `find_tool` and the dispatch checks; only the port's sources change it."""
        self._executors, self._timeout = executors, timeout

    def scoped(self, registry: Registry, executors: dict[str, Executor]) -> PortHandle:
        """The same port, for a caller that sees `registry` (laid over this one's) and whose
        calls of its sources run on `executors`: a session's own MCP servers, which no other
        caller's call can reach."""
        every = {**self._executors, **executors}
        return PortHandle(self._inbox, registry, every, self._timeout)

    async def call(
        self,
        request: ToolRequest,
        on_asking: OnAsking,
        run: Runner | None = None,
        on_decided: OnDecided | None = None,
    ) -> Answered:
        """Decide one call and run it, in the caller's task: `on_asking` hears first if it must
        wait for approval, `on_decided` the answer as soon as it is given. Cancelling the caller
        ends the call (and its wait) at once. `run`: what runs once the policy lets the call
        go, instead of its source's executor, with no `[tools] timeout` (it keeps its own
        deadlines)."""
        verdict = await self.approve(request, on_asking)
        if verdict.approval is not None and on_decided is not None:
            await on_decided(verdict.approval)
        if verdict.entry is None or verdict.refusal is not None:
            refusal = verdict.refusal or Failed(f"the tool {request.tool} is no longer there")
            return Answered(refusal, verdict.approval)
        runner = run and partial(run, verdict.asking)
        answer = await self._execute(verdict.entry, request, runner)
        return Answered(answer, verdict.approval)

    async def approve(self, request: ToolRequest, on_asking: OnAsking) -> Verdict:
        """The port's decision on `request`; `on_asking` hears first if it waits for a
        person."""
        send, receive = trio.open_memory_channel[_Note](2)
        job = _Call(request, send, self.registry)
        try:
            try:
                await self._inbox.send(job)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise PortStopped("the tool port has stopped: loopd is shutting down") from e
            async with receive:
                async for note in receive:
                    if isinstance(note, Asking):
                        await on_asking(note)
                    else:
                        return note.unwrap()
        finally:
            job.scope.cancel()  # a no-op once decided; ends the wait if we were cancelled
        raise PortStopped("the tool port stopped before it answered: loopd is shutting down")

    async def _execute(
        self,
        entry: ToolEntry,
        request: ToolRequest,
        run: Callable[[], Awaitable[ToolOutput]] | None,
    ) -> PortAnswer:
        """The one place a tool runs, whoever its source: under its deadline, its failures
        turned into `Failed`."""
        timeout = math.inf if run else entry.timeout or self._timeout
        if run is None:
            if (executor := self._executors.get(entry.source)) is None:
                return Failed(f"{entry.name} is run by whoever calls it, and this caller cannot")
            run = partial(executor.run_tool, entry, request)
        with trio.move_on_after(timeout) as deadline:
            try:
                output = await run()
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
            return Failed(f"{entry.name} did not finish within {timeout:g} s and was stopped")
        if output.is_error:
            return Failed(output.text[:MESSAGE_LIMIT] or f"{entry.name} reported an error")
        policy = entry.policy
        return Result(output.text, policy.data_class, policy.untrusted, output.change)

    async def decide(self, session: str, call: int, decision: Decision) -> bool:
        """Answer a waiting approval; False when no call of `session` by that number waits."""
        return await ask(self._inbox, partial(_Decide, session, call, decision))

    async def pending(self, session: str) -> list[Asking]:
        """The calls of `session` waiting for approval, oldest first."""
        return await ask(self._inbox, partial(_ListPending, session))


PORT = "the tool port"


class _PortActor:
    def __init__(
        self, executors: dict[str, Executor], approval_timeout: float, restarts: Restarts
    ) -> None:
        self.executors = executors
        """The executors: here for their previews only."""
        self.approval_timeout, self.restarts = approval_timeout, restarts
        self._pending: dict[tuple[str, int], _Pending] = {}

    async def run(self, inbox: trio.MemoryReceiveChannel[_PortMessage]) -> None:
        async with inbox, trio.open_nursery() as calls:

            async def life() -> None:
                async for message in inbox:
                    try:
                        self.take(message, calls)
                    except Exception as e:
                        self.lost(message, ActorFailed.of(PORT, e))
                        raise

            await supervised(PORT, life, self.restarts)

    @staticmethod
    def lost(message: _PortMessage, error: ActorFailed) -> None:
        """Answer `error` to a message whose handling failed (nothing, if it was answered)."""
        if isinstance(message, _Call):
            answer(message.reply, outcome.Error(error))
        elif isinstance(message, _Decide):
            reply_error(message.reply, error)
        else:
            reply_error(message.reply, error)

    def take(self, message: _PortMessage, calls: trio.Nursery) -> None:
        if isinstance(message, _Call):
            calls.start_soon(self._serve, message)
        elif isinstance(message, _Decide):
            pending = self._pending.get((message.session, message.call))
            found = pending is not None and pending.waiting
            if pending is not None and found:
                pending.decision = message.decision
                pending.decided.set()
            reply_value(message.reply, found)
        else:
            mine = [
                p.asking
                for (s, _), p in self._pending.items()
                if s == message.session and p.waiting
            ]
            reply_value(message.reply, mine)

    async def _serve(self, job: _Call) -> None:
        async with job.reply:
            await run_for(job.scope, partial(self._decide, job), partial(answer, job.reply))

    async def _decide(self, job: _Call) -> Verdict:
        request = job.request
        entry = job.registry.get(request.tool)
        if entry is None:
            return Verdict(None, Failed(f"the tool {request.tool} is no longer there"))
        if (unasked := self._unasked(entry, request)) is not None:
            return unasked
        policy = entry.policy_in(request.mode)
        if policy.action == "ask" and entry.name not in request.granted:
            asking = await self._asking(entry, request)
            approval = await self._approval(job, asking)
            if approval.decision == "deny":
                refusal = Denied(_refusal(approval, self.approval_timeout))
                return Verdict(entry, refusal, approval, asking)
            return Verdict(entry, None, approval, asking)
        return Verdict(entry)

    def _unasked(self, entry: ToolEntry, request: ToolRequest) -> Verdict | None:
        """The verdict on a call that no person is asked for, if it has one: a policy of
        `deny`, its executor's say (`Judges`), a `read_only` session's refusal."""
        if entry.policy_in(request.mode).action == "deny":
            return Verdict(entry, Denied(f"the policy for {entry.name} is deny"))
        executor = self.executors.get(entry.source)
        judged = executor.judge(entry, request) if isinstance(executor, Judges) else None
        if judged is not None:
            return Verdict(entry, Denied(judged.reason) if judged.action == "deny" else None)
        if request.mode == "read_only" and read_only_refuses(entry):
            return Verdict(entry, Denied(read_only_refusal(entry.name)))
        return None

    async def _asking(self, entry: ToolEntry, request: ToolRequest) -> Asking:
        policy = entry.policy_in(request.mode)
        asking = Asking(
            request.call,
            entry.name,
            request.arguments,
            policy.data_class,
            policy.untrusted,
            self.approval_timeout,
        )
        if isinstance(executor := self.executors.get(entry.source), Previews):
            shown = await executor.preview(entry, request)
            if shown is not None:
                asking = replace(asking, preview=shown.text, basis=shown.basis, change=shown.change)
        return asking

    async def _approval(self, job: _Call, asking: Asking) -> Approval:
        request = job.request
        key = (request.session, request.call)
        waiting = self._pending[key] = _Pending(asking, job.scope)
        try:
            await job.reply.send(asking)
            with trio.move_on_after(self.approval_timeout):
                await waiting.decided.wait()
        finally:
            del self._pending[key]
        if not waiting.decided.is_set():
            return Approval(asking.tool, "deny", "timeout")
        return Approval(asking.tool, waiting.decision, "user")


def read_only_refusal(tool: str) -> str:
    """Why a session in mode `read_only` does not run `tool`: the model reads it."""
    return (
        f"this session is read-only (its mode is read_only), so {tool} is refused: you may "
        "read and search files, not change them or run commands; say what you would change "
        "instead"
    )


def _refusal(approval: Approval, timeout: float) -> str:
    if approval.by == "timeout":
        return f"nobody approved it within {timeout:g} s"
    return "the user did not approve it"


@asynccontextmanager
async def run_tool_port(
    registry: Registry,
    executors: dict[str, Executor],
    *,
    timeout: float,
    approval_timeout: float = math.inf,
    restarts: Restarts = RESTARTS,
) -> AsyncIterator[PortHandle]:
    """The tool-port actor, running until the block ends, restarted on a bug within
    `restarts`."""
    # Unbounded, and safe so: every message is a call or a question whose sender waits for the
    # answer, so at most one per turn, sub-agent or client task waits in it.
    send, receive = trio.open_memory_channel[_PortMessage](math.inf)
    actor = _PortActor(executors, approval_timeout, restarts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run, receive)
        async with send:
            yield PortHandle(send, registry, executors, timeout)
        nursery.cancel_scope.cancel()
