"""A session's turns on the slots the pool lends, as one object its actor starts for each
message: the lease (and the client told while every slot is busy), the session's cache
restored from its slot file where another session had the slot, the turn (or a compaction),
and the slot left holding the session's cache as far as the session knows it. A turn whose
server cannot take a request moves to a slot of another server that can, where there is one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from loopd.infer import InferError, Queued, slot_tokens
from loopd.session.compact import SummaryFailed
from loopd.session.fork import cache_source
from loopd.session.records import UsageRecord
from loopd.session.store import Session, StoreError
from loopd.supervise import ActorFailed
from loopd.turn import InferFailed, Runtime, TurnError, TurnOutcome, run_turn
from loopd.wire.events import MovedToServer, TurnEvent, WaitReason

from ._agents import Agents
from ._compaction import Compaction
from ._errors import SessionFailed
from ._models import Models
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
    models: Models = field(default_factory=Models)
    """The models loopd serves: the session's turns take slots of its own."""
    _restored: tuple[Session, int, int] | None = field(default=None, init=False)
    """The session a restore was for, its records' count then, and the tokens restored: the
    next request tells how many were reused."""
    _uncached: str | None = field(default=None, init=False)
    """Why the slot does not hold the session's cache, where its file could not be restored:
    the next request's cache loss says so."""

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
            model = self.models.of(self.session)
            async with self.pool.lease(self.session.id, hot_only=True, model=model) as lease:
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
        source = await cache_source(self.compaction.store, self.session)
        model = self.models.of(self.session)
        async with self.pool.lease(
            self.session.id, prefer=prefer, wait=False, source=source, model=model
        ) as lease:
            if lease is not None:
                yield lease
                return
        on_event(Queued())
        async with self.pool.lease(
            self.session.id, prefer=prefer, source=source, model=model
        ) as lease:
            assert lease is not None  # noqa: S101 - a waiting lease always comes
            yield lease

    async def _on(self, lease: Lease, message: Message, on_event: OnEvent) -> TurnOutcome:
        """The slot is left holding the session's cache, as far as the session knows it."""
        session = self.session
        try:
            await self._prepare(lease, session)
            if message.content is None:
                return await self.compaction.continued(session, lease, on_event, self._continued)
            return await self._answer(lease, message.content, message.thinking, on_event)
        finally:
            self._check_last_restore()
            usage = self.session.last_usage()
            lease.owner = self.session.id
            lease.tokens = slot_tokens(usage.timings) if usage and usage.timings else None

    async def _prepare(self, lease: Lease, session: Session) -> None:
        """`lease`'s slot made ready for `session`; what a restore loaded is checked once the
        next request tells what was reused."""
        self._check_last_restore()  # of the slot the turn left, if it moved
        source = await cache_source(self.compaction.store, session)
        self._uncached = await self.pool.prepare(lease, self.files, session, source)
        if lease.tokens and not lease.hot:
            # A fork's parent's file may hold more than the fork's history: that is not lost.
            usage = session.last_usage()
            held = slot_tokens(usage.timings) if usage and usage.timings else lease.tokens
            self._restored = (session, len(session.records), min(lease.tokens, held))

    def _check_last_restore(self) -> None:
        if self._restored is not None:
            _check_restore(*self._restored)
            self._restored = None

    async def _answer(
        self, lease: Lease, content: str, thinking: bool | None, on_event: OnEvent
    ) -> TurnOutcome:
        def here() -> Runtime:
            """The turn's runtime on the slot `lease` lends now (a move changes it)."""
            exact = self.models.exact.get(lease.model or "", self.runtime.exact)
            return replace(
                self.runtime,
                inference=lease.slot,
                slot=lease.slot.number,
                exact=exact.on(lease.slot.client) if exact else None,  # its server's templates
                elsewhere=elsewhere if self.pool.servers > 1 else None,
                uncached=self._uncached,
            )

        async def elsewhere(reason: WaitReason, error: InferError) -> Runtime | None:
            return here() if await self._move(lease, reason, error, on_event) else None

        async def answer(session: Session) -> TurnOutcome:
            runtime = delegating = here()  # its `delegate` calls start sub-agents of it now
            if self.agents is not None:
                delegating = replace(runtime, delegate=self.agents.for_turn(session, runtime))
            return await run_turn(session, delegating, content, on_event, thinking=thinking)

        return await self.compaction.answered(
            self.session, lease, answer, on_event, self._continued
        )

    async def _move(
        self, lease: Lease, reason: WaitReason, error: InferError, on_event: OnEvent
    ) -> bool:
        """`lease` moved to a slot of another server that can take the turn's request, the
        session's cache restored there where that server can read its file (else the prompt
        is computed anew, a loss the turn records); False where no other server can."""
        left = lease.slot.client.base_url
        if not await self.pool.move(lease):
            return False
        server = lease.slot.client.base_url
        log.warning(
            "llama-server at %s could not take a request of session %s (%s): it goes on on %s",
            left,
            self.session.id,
            error,
            server,
        )
        on_event(MovedToServer(previous=left, server=server, reason=reason, detail=str(error)))
        await self._prepare(lease, self.session)
        return True


def _check_restore(session: Session, start: int, restored: int) -> None:
    """Say why, when the first request after a restore found less than the file held (its
    loss is recorded by the turn)."""
    usage = next((r for r in session.records[start:] if isinstance(r, UsageRecord)), None)
    if usage and usage.timings and usage.timings.cached < restored:
        log.warning(
            "session %s: its slot file restored %d tokens, and llama-server reused %d of them. "
            "A model with a sliding window (Gemma 3 and 4, gpt-oss) keeps only the window "
            "unless llama-server runs with --swa-full (the embedded one does)",
            session.id,
            restored,
            usage.timings.cache_n,
        )
