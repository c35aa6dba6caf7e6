"""One turn: a user message in, an answer out, tool calls in between, a limit on every runaway.

    TurnError
     ├── SessionFull   the prompt no longer fits the slot's context
     ├── TurnLimit     too many tool rounds, a call repeated twice, or the turn's deadline
     └── InferFailed   the server could not answer (the InferError is `.error`)

A server that cannot take a request yet (loading, restarting, unreachable) is waited for
(`loopd.turn.waiting`), up to the turn's deadline (seconds, for one never reached since loopd
started), unless another can take it now: the turn goes on there (`Runtime.elsewhere`). A
`StoreError` from the session passes through as it is. Whatever ends a turn (an answer, a limit,
an error, a cancellation), the log is left a valid conversation: every tool call of the last
answer has a result (saying why it was not run, if it was not), and a `turn_end` record gives
the reason. Each record is on disk before the event that reports it is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import trio

from loopd.config import LoopConfig
from loopd.groups import only_cancelled
from loopd.hooks import NO_HOOKS, Hooks
from loopd.infer import (
    ChatEvent,
    Completion,
    Generation,
    InferError,
    Loss,
    ToolCallDelta,
    cache_outcome,
    is_context_full,
    is_output,
)
from loopd.session.closing import close_turn
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    PromptRecord,
    Record,
    TurnEndReason,
    UnreadRecord,
    UsageRecord,
    UserRecord,
)
from loopd.session.store import Session
from loopd.tools import Registry, ToolPort
from loopd.turn.calls import Delegate, RepeatedCall, ToolCalls
from loopd.turn.changes import Hands
from loopd.turn.cut import CutAnswers, Inference
from loopd.turn.exact import ExactHistory, next_request
from loopd.turn.guess import send
from loopd.turn.waiting import Elsewhere, ServerWait, wait_reason
from loopd.wire.events import CacheLoss, TurnEvent

__all__ = ["InferFailed", "Inference", "Runtime", "SessionFull", "TurnError", "TurnLimit"]
__all__ += ["TurnOutcome", "run_turn"]


class TurnError(Exception):
    """A turn ended without an answer; the log says why in its `turn_end` record."""

    reason: Literal["turn_limit", "session_full", "error"] = "error"
    """Both its `turn_end` reason and, but for `InferFailed`, its failure kind to clients."""


class SessionFull(TurnError):
    reason = "session_full"


class TurnLimit(TurnError):
    reason = "turn_limit"


class InferFailed(TurnError):
    def __init__(self, error: InferError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Runtime:
    """What a turn needs besides the session."""

    loop: LoopConfig
    inference: Inference
    port: ToolPort
    registry: Registry
    slot: int = 0
    find_limit: int = 5
    sampling: dict[str, Any] = field(default_factory=dict)
    """Extra request fields such as `temperature` (`[server] sampling`)."""
    exact: ExactHistory | None = None
    """Token-exact prompts (`[session] history = "exact"`); None sends history as messages."""
    limits: str = "loop"
    """The config table of `loop`'s limits, as errors name it (`agents` for a sub-agent)."""
    delegate: Delegate | None = None
    """Runs the sub-agents of the turn's `delegate` calls; None: there are none."""
    hands: Hands | None = None
    """Makes the changes of `write_file` and `edit_file` calls; None: there are no roots."""
    prefill: Callable[[list[Record]], tuple[str, str]] | None = None
    """For tests on a real server: an answer's first text and a GBNF grammar for the rest, given
    the log (a model too small to call tools is made to: the tool path runs for real)."""
    elsewhere: Elsewhere[Runtime] | None = None
    """Moves the turn to another server that can take the request its own cannot: the
    runtime there; None: there is none (one server, or a sub-agent's turn)."""
    uncached: str | None = None
    """Why the slot does not hold the session's cache (its slot file could not be restored):
    the reason a cache loss of the next request is recorded with."""
    hooks: Hooks = NO_HOOKS
    """The user's commands at a turn's points (`[hooks]`, `loopd.hooks`)."""


@dataclass(frozen=True)
class TurnOutcome:
    content: str
    usage: UsageRecord


OnEvent = Callable[[TurnEvent], None]


async def run_turn(
    session: Session,
    rt: Runtime,
    content: str,
    on_event: OnEvent,
    *,
    thinking: bool | None = None,
) -> TurnOutcome:
    """One turn; `thinking`, where given, overrides the session's and `[loop] thinking`."""
    content, refused = await rt.hooks.prompt(session, content)
    if refused is not None:
        raise TurnError(refused)  # before the turn began: nothing of it is in the log to close
    await session.add(UserRecord(content=content))  # durable while its request goes (`first`)
    reason: TurnEndReason = "error"
    turn: _Turn | None = None
    try:
        think = next(t for t in (thinking, session.thinking, rt.loop.thinking) if t is not None)
        turn = _Turn(session, rt, on_event, think)
        with trio.move_on_after(rt.loop.turn_timeout):
            outcome = await turn.run()
            reason = "answer"
            return outcome
        reason = "turn_limit"
        waited = turn.wait.why() if turn.wait else ""
        raise TurnLimit(
            f"the turn took longer than {rt.loop.turn_timeout:g} s ([{rt.limits}] turn_timeout)"
            + waited
        )
    except TurnError as e:
        reason = e.reason
        raise
    except (trio.Cancelled, BaseExceptionGroup) as e:
        if only_cancelled(e):  # raw, or from a nursery of the request as a group
            reason = "cancelled"
        raise
    finally:
        with trio.CancelScope(shield=True):
            if turn is not None:  # an answer cut short is kept before the turn is closed
                await turn.answers.keep(session, reason, shown=turn.output)
            await close_turn(session, reason)


class _Turn:
    def __init__(self, session: Session, rt: Runtime, on_event: OnEvent, thinking: bool) -> None:
        self.session, self.rt, self.on_event = session, rt, on_event
        self.thinking = thinking
        self.wait: ServerWait | None = None
        """The waits of the request under way, if it had to wait for the server."""
        self.output = False
        """The try under way passed part of an answer on: it is not tried again."""
        self.answers = CutAnswers()
        """The request under way, watched: its answer as far as it came, if it is cut."""
        self.calls = ToolCalls(
            session, rt.loop, rt.port, rt.registry, rt.find_limit, on_event, rt.delegate, rt.hands
        )
        self.calls.hooks = rt.hooks

    async def run(self) -> TurnOutcome:
        rounds = 0
        while True:
            completion, usage = await self._request()
            if completion.finish_reason == "repetition":
                raise TurnLimit(  # cut by loopd: what it said is in the log
                    f"the model said the same text over and over for "
                    f"{self.rt.loop.repetition_cap} characters; its answer was cut there "
                    f"([{self.rt.limits}] repetition_cap)"
                )
            if not completion.tool_calls:
                if completion.finish_reason == "thinking_cap" and not completion.content:
                    raise TurnLimit(  # cut by loopd: the server ignored its reasoning budget
                        f"the model thought past {self.rt.loop.thinking_cap} tokens without an "
                        f"answer ([{self.rt.limits}] thinking_cap); its reasoning is in the log"
                    )
                if not await self.rt.hooks.stop(self.session, completion.content):
                    return TurnOutcome(completion.content or "", usage)  # else a round more
            rounds += 1
            if rounds > self.rt.loop.tool_iterations:
                raise TurnLimit(
                    f"more than {self.rt.loop.tool_iterations} rounds of tool calls "
                    f"in one turn ([{self.rt.limits}] tool_iterations)"
                )
            try:
                await self.calls.answer_round(completion.tool_calls)
            except RepeatedCall as e:
                raise TurnLimit(str(e)) from e

    async def _request(self) -> tuple[Completion, UsageRecord]:
        session, rt = self.session, self.rt
        previous = session.last_usage()
        generation = Generation(
            slot=rt.slot,
            thinking=self.thinking,
            thinking_cap=rt.loop.thinking_cap,
            repetition_cap=rt.loop.repetition_cap or None,
            max_tokens=rt.loop.max_tokens,
            sampling=rt.sampling,
            affinity=session.id,
        )
        completion, prompt = await self._send(generation)
        if (rt := self.rt).uncached is not None:  # said once, by the first request on the slot
            self.rt = replace(rt, uncached=None)
        c = completion
        if prompt is not None:
            await session.append(prompt)
        await session.append(AssistantRecord.of(c))
        if c.unread is not None:
            await session.append(UnreadRecord(text=c.unread.text, error=c.unread.error))
        usage = UsageRecord(
            timings=c.timings,
            reasoning_tokens=c.reasoning_tokens,
            thinking_capped=c.thinking_capped,
        )
        await session.append(usage)
        if previous and previous.timings and completion.timings:
            outcome = cache_outcome(previous.timings, completion.timings)
            if isinstance(outcome, Loss):
                await session.append(
                    CacheLossRecord(
                        expected=outcome.expected, cached=outcome.cached, reason=rt.uncached
                    )
                )
                self.on_event(CacheLoss(expected=outcome.expected, cached=outcome.cached))
        return completion, usage

    async def _send(self, generation: Generation) -> tuple[Completion, PromptRecord | None]:
        """The completion, tried again while the server cannot take the request yet (on
        another server, where one can take it now); and the `prompt` record to append with
        it, if any."""
        session = self.session
        prefill, grammar = self.rt.prefill(list(session.records)) if self.rt.prefill else ("", "")
        wait = self.wait = ServerWait(self.rt.inference.retry, self.on_event)
        while True:
            self.output, rt = False, self.rt
            try:
                nxt = await next_request(  # built anew each try: it may ask the server
                    rt.exact, session, generation, prefill=prefill, grammar=grammar
                )
                watched = self.answers.on(rt.inference)
                nxt = self.answers.expect(nxt)
                answered = await send(watched, nxt, self._pass_on, first=session.sync)
            except InferError as e:
                if is_context_full(e):
                    raise SessionFull(str(e)) from e
                if self.output or (why := wait_reason(e)) is None:
                    raise InferFailed(e) from e
                if never := wait.never_reached(
                    why, e, rt.inference.reached
                ):  # a wrong URL, most likely: said soon
                    raise InferFailed(never) from e
                await session.sync()  # the question is on disk while the turn waits
                if moved := await wait.after(why, e, rt.elsewhere):
                    self.rt = moved  # tried there at once, its slot pinned by its `inference`
            else:
                if wait.last is not None:  # it was away: what it held may have gone with it
                    self.rt = replace(self.rt, uncached=self.rt.uncached or wait.gone())
                self.wait = None
                return answered

    def _pass_on(self, event: ChatEvent) -> None:
        self.output = self.output or is_output(event)
        # Deltas are dropped: clients hear of a call once it is whole, as ToolCallStarted.
        if not isinstance(event, ToolCallDelta):
            self.on_event(event)
