"""A session's turns on the slots the pool lends, as one object its actor starts for each
message: the lease (and the client told while every slot is busy), the session's cache
restored from its slot file where another session had the slot, the turn (or a compaction),
and the slot left holding the session's cache as far as the session knows it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from loopd.infer import InferError, Queued, slot_tokens
from loopd.session.compact import SummaryFailed
from loopd.session.records import UsageRecord
from loopd.session.store import Session, StoreError
from loopd.supervise import ActorFailed
from loopd.turn import InferFailed, Runtime, TurnError, TurnOutcome, run_turn
from loopd.wire.events import TurnEvent

from ._agents import Agents
from ._compaction import Compaction
from ._errors import SessionFailed
from ._pool import Lease, PoolHandle
from ._session_inbox import TurnDone, TurnFailed
from ._slots import SlotFiles

__all__ = ["Message", "SlotTurns"]

log = logging.getLogger(__name__)

OnEvent = Callable[[TurnEvent], None]


@dataclass
class Message:
    turn: str
    content: str | None
    """The user's message; None: a compaction."""
    thinking: bool | None = None


@dataclass
class SlotTurns:
    session: Session
    """The session the turns run in: a compaction replaces it with the one that continues it."""
    runtime: Runtime
    pool: PoolHandle
    files: SlotFiles
    compaction: Compaction
    agents: Agents | None
    renamed: Callable[[str, str], None]
    """Told the old and the new session's id when one continues another."""

    async def ended(self, message: Message, on_event: OnEvent) -> TurnDone | TurnFailed:
        """The message's turn (or compaction) on a slot of the pool, and how it ended. A turn
        fails alone, even for a bug (its log closed as `error`, the traceback logged); a log
        that cannot be written raises `SessionFailed`: the session cannot go on."""
        try:
            async with self._slot(on_event) as lease:
                return TurnDone(await self._on(lease, message, on_event))
        except TurnError as e:
            return TurnFailed("infer" if isinstance(e, InferFailed) else e.reason, str(e))
        except InferError as e:  # a compaction a client asked for
            return TurnFailed("infer", str(e))
        except SummaryFailed as e:
            return TurnFailed("error", str(e))
        except StoreError as e:
            raise SessionFailed.of(self.session.id, e) from e
        except ActorFailed as e:  # the pool failed on its lease; the pool's log has the bug
            return TurnFailed("error", str(e))
        except Exception as e:
            log.exception("turn %s failed", message.turn)
            return TurnFailed("error", f"loopd failed: {type(e).__name__}: {e}")

    async def save(self) -> None:
        """The session's cache in its slot file, if a slot still holds it."""
        try:
            async with self.pool.lease(self.session.id, hot_only=True) as lease:
                if lease is not None:
                    await self.files.save(lease.slot, self.session.id)
        except ActorFailed as e:  # a cache not saved is only recomputed
            log.warning("session %s: its cache was not saved: %s", self.session.id, e)

    def _continued(self, new: Session) -> None:
        old, self.session = self.session, new
        self.renamed(old.id, new.id)

    @asynccontextmanager
    async def _slot(self, on_event: OnEvent) -> AsyncIterator[Lease]:
        """A slot for the turn; while every slot runs a turn, the client hears it waits."""
        # Which server saved its slot file: a read of the note, worth it only with several.
        prefer = self.files.server_of(self.session.id) if self.pool.servers > 1 else None
        async with self.pool.lease(self.session.id, prefer=prefer, wait=False) as lease:
            if lease is not None:
                yield lease
                return
        on_event(Queued())
        async with self.pool.lease(self.session.id, prefer=prefer) as lease:
            assert lease is not None  # noqa: S101 - a waiting lease always comes
            yield lease

    async def _on(self, lease: Lease, message: Message, on_event: OnEvent) -> TurnOutcome:
        """The slot is left holding the session's cache, as far as the session knows it."""
        session, start = self.session, len(self.session.records)
        try:
            await self.pool.prepare(lease, self.files, session)
            if message.content is None:
                return await self.compaction.continued(session, lease, on_event, self._continued)
            return await self._answer(lease, message.content, message.thinking, on_event)
        finally:
            if lease.tokens and not lease.hot:
                _check_restore(session, start, lease.tokens)
            usage = self.session.last_usage()
            lease.owner = self.session.id
            lease.tokens = slot_tokens(usage.timings) if usage and usage.timings else None

    async def _answer(
        self, lease: Lease, content: str, thinking: bool | None, on_event: OnEvent
    ) -> TurnOutcome:
        exact = self.runtime.exact
        runtime = replace(
            self.runtime,
            inference=lease.slot,
            slot=lease.slot.number,
            exact=exact.on(lease.slot.client) if exact else None,  # the templates of its server
        )

        async def answer(session: Session) -> TurnOutcome:
            delegating = runtime  # its `delegate` calls start sub-agents of the session now
            if self.agents is not None:
                delegating = replace(runtime, delegate=self.agents.for_turn(session, runtime))
            return await run_turn(session, delegating, content, on_event, thinking=thinking)

        return await self.compaction.answered(
            self.session, lease, answer, on_event, self._continued
        )


def _check_restore(session: Session, start: int, restored: int) -> None:
    """Say why, when the first request after a restore found less than the file held (its
    loss is recorded by the turn)."""
    usage = next((r for r in session.records[start:] if isinstance(r, UsageRecord)), None)
    if usage and usage.timings and usage.timings.cache_n < restored:
        log.warning(
            "session %s: its slot file restored %d tokens, and llama-server reused %d of them. "
            "A model with a sliding window (Gemma 3 and 4, gpt-oss) keeps only the window "
            "unless llama-server runs with --swa-full (the embedded one does)",
            session.id,
            restored,
            usage.timings.cache_n,
        )
