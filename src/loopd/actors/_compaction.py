"""Continuing a session in a new one from a summary of it: when a client asks (`compact`), and
when a turn finds the context full and `[session] on_full = "continue"` (the message is then
answered in the session that continues it).

The summary runs on a slot of no session where one is idle, so the old session's slot keeps
its cache; on the session's own slot otherwise, once that cache is saved. Either is of the
model the old session runs on (`[models.NAME]`): that model writes the summary, and the new
session runs on it too (a `mode` record after its summary). The new session is made whole or
not at all (shielded): its header, the summary record, its model, and the old session closed,
its log ending with a `continued` record that names the new one (what an editor reopening the old
id follows).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from loopd.infer import InferError
from loopd.session.compact import Compactor, SummaryFailed, continued_baseline
from loopd.session.continued import record_went_on
from loopd.session.instructions import carried
from loopd.session.records import Baseline, ContinuedRecord, ModeRecord, UsageRecord
from loopd.session.store import Session, Store
from loopd.turn import SessionFull, TurnOutcome
from loopd.wire.events import Compacting, SessionContinued, TurnEvent

from ._models import Models
from ._pool import Lease, PoolHandle
from ._slots import SlotFiles

__all__ = ["Compaction"]

log = logging.getLogger(__name__)

OnEvent = Callable[[TurnEvent], None]
OnContinued = Callable[[Session], None]
"""Hears the new session the moment it exists, before anything can cancel its caller."""


@dataclass(frozen=True)
class Compaction:
    store: Store
    baseline: Callable[[], Baseline]
    pool: PoolHandle
    files: SlotFiles
    compactor: Compactor
    models: Models = field(default_factory=Models)

    async def continued(
        self, old: Session, lease: Lease, on_event: OnEvent, on_continued: OnContinued
    ) -> TurnOutcome:
        """Summarise `old` and go on in a new session that continues it; `lease`: the slot
        that holds `old`'s cache."""
        model = self.models.of(old)
        async with self.pool.lease(None, wait=False, model=model) as side:
            if side is not None:
                await self.pool.prepare(side, self.files, None)
            else:
                log.info(
                    "no slot is free for session %s: the summary is written on its own slot, "
                    "its cache saved first",
                    old.id,
                )
                await self.files.save(lease.slot, old.id)
            slot = (side or lease).slot
            on_event(Compacting(session=old.id, slot=slot.number))
            summary = await self.compactor.summarize(old.records, slot, on_event)
        with trio.CancelScope(shield=True):  # the new session whole, or not at all
            # The AGENTS.md files of the session it continues, as they were when that was made.
            baseline, instructions = carried(old.baseline, old.header.instructions, self.baseline())
            new = await self.store.create(
                continued_baseline(baseline, summary.text),
                continues=old.id,
                grants=old.granted,
                cwd=old.cwd,
                instructions=instructions,
                mode=old.mode,
                thinking=old.thinking,
            )
            on_continued(new)
            await record_went_on(old, ContinuedRecord(session=new.id, by="compact"))
            old.close()
            await new.append(summary.record(old.id, slot.number))
            if model is not None:  # after the summary, which opens the session's records
                await new.append(ModeRecord(mode=new.own_mode, thinking=new.thinking, model=model))
            if side is not None:  # the old session's cache, for a return to it
                await self.files.save(lease.slot, old.id)
        log.info("session %s continues %s from a summary", new.id, old.id)
        on_event(SessionContinued(previous=old.id, session=new.id, summary=summary.text))
        return TurnOutcome(summary.text, UsageRecord(timings=summary.completion.timings))

    async def answered(
        self,
        session: Session,
        lease: Lease,
        answer: Callable[[Session], Awaitable[TurnOutcome]],
        on_event: OnEvent,
        on_continued: OnContinued,
    ) -> TurnOutcome:
        """`answer(session)`; where the context is full and `on_full = "continue"`, the
        session is continued in a new one and the message answered there."""
        try:
            return await answer(session)
        except SessionFull as full:
            # A session holding nothing but this message has nothing to compact.
            if self.compactor.on_full != "continue" or session.turns <= 1:
                raise
            continued: list[Session] = []

            def keep(new: Session) -> None:
                continued.append(new)
                on_continued(new)

            try:
                await self.continued(session, lease, on_event, keep)
            except (InferError, SummaryFailed) as e:
                raise SessionFull(f"{full}; continuing in a new session failed: {e}") from e
        return await answer(continued[0])
