"""Sub-agents: a `delegate` call runs a new session, on a slot of its own, for one turn whose
first message is the task; its answer is the call's result.

A sub-agent runs in the task of the call that started it, under the port's cancel scope for
that call: cancelling the delegating turn, or its deadline, ends the sub-agent with it (its own
log closed as `cancelled`). Nothing runs it again after a crash: the registry closes its log
as interrupted when the delegating session opens (`_registry.close_interrupted`), when the
sub-agent's own session opens, or when loopd lists the sessions, whichever comes first.

Bounds: how deep delegation goes, how many sub-agents run at once in all of loopd, how many
one turn may start, a slot idle for it, and each sub-agent's own limits (`[agents]`). A
sub-agent refused by a bound (it then has no session), or ended by a limit or an error (its
session named), is a failed call whose text says why; never an empty answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from loopd.config import AgentsConfig
from loopd.session.instructions import carried
from loopd.session.records import Baseline, UsageRecord
from loopd.session.store import ParentCall, Session, Store
from loopd.tools import ToolFailure, ToolOutput
from loopd.turn import Runtime, TurnError, run_turn
from loopd.turn.calls import OnEvent
from loopd.wire.events import (
    AgentState,
    AgentUpdate,
    ApprovalDecided,
    ApprovalNeeded,
    ToolCallStarted,
    TurnEvent,
)

from ._pool import Lease, PoolHandle
from ._slots import SlotFiles

__all__ = ["AGENTS", "Agents"]

log = logging.getLogger(__name__)

AGENTS = "agents"
"""The registry source of the `delegate` tool (its policy: `[tools.policies.delegate]`)."""


class Agents:
    """The sub-agents of a running loopd: which run, for whom, and how to start one."""

    def __init__(  # noqa: PLR0913 - what a sub-agent needs
        self,
        config: AgentsConfig,
        *,
        at_once: int,
        store: Store,
        pool: PoolHandle,
        files: SlotFiles,
        baseline: Callable[[], Baseline],
    ) -> None:
        self.config, self.at_once = config, at_once
        self.store, self.pool, self.files, self.baseline = store, pool, files, baseline
        self.running: dict[str, str] = {}
        """Each running sub-agent's session, and the session that started it."""
        self.live = 0
        """Sub-agents running or being started (counted before their logs exist)."""

    def for_turn(self, session: Session, runtime: Runtime) -> _Delegation:
        """What runs the `delegate` calls of one turn of `session` (on `runtime`, less its slot);
        a session that is a sub-agent's, continued by a person, counts as one level deep."""
        return _Delegation(self, session, runtime, depth=0 if session.header.parent is None else 1)

    def root(self, session: str) -> str:
        """The session at the top of the sub-agent `session` (itself, when it is none)."""
        while session in self.running:
            session = self.running[session]
        return session

    def under(self, root: str) -> list[str]:
        """The running sub-agents started, at any depth, from session `root`."""
        return [child for child in self.running if child != root and self.root(child) == root]

    async def run(
        self, lease: Lease, child: Session, task: str, runtime: Runtime, news: _News
    ) -> ToolOutput:
        """The sub-agent's one turn on the slot `lease` lends: its answer, or a `ToolFailure`
        that says why there is none."""
        await self.pool.prepare(lease, self.files, None)
        exact = runtime.exact
        runtime = replace(
            runtime,
            inference=lease.slot,
            slot=lease.slot.number,
            exact=exact.on(lease.slot.client) if exact else None,
            elsewhere=None,  # the parent's move is its own: a sub-agent waits for its server
        )
        try:
            outcome = await run_turn(child, runtime, task, news)
        except TurnError as e:
            news.end("failed", str(e))
            raise ToolFailure(
                f"the sub-agent in session {child.id} stopped without an answer "
                f"({e.reason.replace('_', ' ')}): {e}"
            ) from e
        news.end("answered")
        if not outcome.content.strip():
            return ToolOutput(f"The sub-agent in session {child.id} gave an empty answer.")
        return ToolOutput(f"The sub-agent in session {child.id} answered:\n\n{outcome.content}")


@dataclass
class _Delegation:
    """Runs the sub-agents of one turn's `delegate` calls (a `calls.Delegate`)."""

    agents: Agents
    session: Session
    runtime: Runtime
    depth: int
    started: int = 0

    async def __call__(self, call: ParentCall, task: str, on_event: OnEvent) -> ToolOutput:
        agents = self.agents
        self._check_bounds()
        # Counted before the first await: the calls of one round start side by side.
        self.started += 1
        agents.live += 1
        try:
            # A slot idle now, or none: a sub-agent never waits for one, since the turns that
            # hold the others may be waiting for sub-agents themselves. Leased for no session:
            # its cache is of no use once it has answered, so nothing is saved when another
            # session takes the slot.
            async with agents.pool.lease(None, wait=False) as lease:
                if lease is None:
                    self.started -= 1
                    raise ToolFailure(
                        "no slot is free for a sub-agent: every slot runs a turn now; do the "
                        "task yourself, or delegate it later"
                    )
                return await self._run(lease, call, task, on_event)
        finally:
            agents.live -= 1

    async def _run(
        self, lease: Lease, call: ParentCall, task: str, on_event: OnEvent
    ) -> ToolOutput:
        agents = self.agents
        parent = self.session.header  # its AGENTS.md files, as they were when it was made
        baseline, instructions = carried(parent.baseline, parent.instructions, agents.baseline())
        child = await agents.store.create(
            baseline,
            grants=self.session.granted,
            parent=call,
            cwd=self.session.cwd,
            instructions=instructions,
            mode=self.session.mode,
            thinking=self.session.thinking,
            follows=self.session,  # a mode set while it runs holds for it too
        )
        log.info("session %s: call %d starts sub-agent %s", call.session, call.call, child.id)
        agents.running[child.id] = self.session.id
        news = _News(child, call, on_event)
        runtime = replace(self.runtime, loop=agents.config.loop(self.runtime.loop), limits="agents")
        runtime = replace(runtime, delegate=_Delegation(agents, child, runtime, self.depth + 1))
        try:
            return await agents.run(lease, child, task, runtime, news)
        except BaseException as e:
            if not news.ended:  # cancelled, or a bug (the port logs it, the model reads it)
                news.end("failed" if isinstance(e, Exception) else "cancelled")
            raise
        finally:
            del agents.running[child.id]
            child.close()

    def _check_bounds(self) -> None:
        agents, config = self.agents, self.agents.config
        if self.depth >= config.depth:
            if config.depth == 0:
                raise ToolFailure("delegation is off ([agents] depth = 0)")
            raise ToolFailure(
                f"a sub-agent {self.depth} level{'s' * (self.depth > 1)} deep cannot delegate "
                f"([agents] depth = {config.depth}); do the task yourself"
            )
        if self.started >= config.per_turn:
            raise ToolFailure(
                "this turn has started as many sub-agents as one turn may "
                f"([agents] per_turn = {config.per_turn}); do the rest yourself"
            )
        if agents.at_once == 0:
            raise ToolFailure(
                "loopd has one slot, and this turn holds it: a sub-agent needs a slot of its "
                "own (llama-server -np and [server] slots)"
            )
        if agents.live >= agents.at_once:
            raise ToolFailure(
                "as many sub-agents as loopd runs at once are running "
                f"([agents] at_once = {agents.at_once}); wait for their answers, or do it "
                "yourself"
            )


class _News:
    """What the delegating turn's clients hear of a sub-agent: an `agent` event when it starts,
    calls a tool and ends, and its approvals, named by its session. Its text and reasoning stay
    in its own log."""

    def __init__(self, child: Session, call: ParentCall, on_event: OnEvent) -> None:
        self.child, self.call, self.on_event = child, call, on_event
        self.tool_calls, self.tool = 0, ""
        self.running = self.ended = False

    def __call__(self, event: TurnEvent) -> None:
        if isinstance(event, ApprovalNeeded | ApprovalDecided):
            named = event if event.session else event.model_copy(update={"session": self.child.id})
            self.on_event(named)
        elif isinstance(event, AgentUpdate):
            self.on_event(event)  # one of its own sub-agents
        elif isinstance(event, ToolCallStarted):
            self.tool_calls += 1
            self.tool = event.tool or event.name
            self._tell("running")
        elif not self.running:
            self.running = True
            self._tell("running")

    def end(self, state: AgentState, detail: str | None = None) -> None:
        self.ended = True
        self._tell(state, detail)

    def _tell(self, state: AgentState, detail: str | None = None) -> None:
        tokens = sum(
            r.timings.predicted_n
            for r in self.child.records
            if isinstance(r, UsageRecord) and r.timings
        )
        self.on_event(
            AgentUpdate(
                session=self.child.id,
                parent=self.call.session,
                call=self.call.call,
                state=state,
                tool_calls=self.tool_calls,
                tokens=tokens,
                tool=self.tool or None,
                detail=detail,
            )
        )
