"""The slot pool: owns every slot of loopd's llama-servers and lends them to sessions.

A session takes a slot for a turn (`PoolHandle.lease`) and gives it back after; the slot keeps
the session's cache while the session is idle, so its next turn finds it hot. A session that
needs a slot when none holds its cache gets a free one, else the least recently used idle one:
the lease then names the session whose cache must be saved first (`Lease.evicted`), and that
session waits for the save before it may take a slot again. A lease that is not `hot` holds
another cache: its holder restores its own from the slot file. Leases of no session (a
compaction's summary) leave their slot free.

The actor only decides; the work (requests, saves, restores) runs in the holder's task, on the
slot it was given, so nothing in its inbox loop waits. Leases that cannot be granted wait in
order and are granted as slots come back; one granted to an asker cancelled in the same pass
of trio's loop, which never reads it, is given back as the slot was (`ask`'s `orphan`).

With several servers, a session that needs a slot takes one on the server that saved its slot
file (`prefer`) where it can: another server restores it only from a folder the two share. A
server that stops answering (`health`) lends nothing until it answers again, and what its
slots held is forgotten; while no server answers, the slots are lent anyway, and requests fail
with the server's own error. A turn whose server cannot take its request moves its lease to
an idle slot of another server that answers (`PoolHandle.move`), and the pool then counts the
server it left as not answering until `health` says it answers.

With several models (`[models.NAME]`), each server is of one model, and a session is lent
only slots of the model it runs on (`lease`'s `model`; a request of no model takes the
default's). A session that ran on two models may have a slot holding its cache on each.

A bug in the pool (an error in `_Pool.take`) restarts it on the same inbox (`supervised`): the
request it held and those waiting for a slot are answered `ActorFailed`; the new pool keeps
which slots are lent (a running turn's slot is not lent twice, and its release still frees
it), whose caches are being saved, and which servers do not answer, and forgets which caches
the slots hold: a lost cache only costs its recomputation.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import outcome
import trio

from loopd.inbox import Reply, ask, reply_error, reply_value
from loopd.infer import Client, Slot
from loopd.session.store import Session
from loopd.supervise import RESTARTS, ActorFailed, Restarts, supervised

from ._slots import SlotFiles

__all__ = ["SAVE_AT_STOP", "Lease", "PoolHandle", "SlotView", "pool_actor"]

log = logging.getLogger(__name__)

SAVE_AT_STOP = 30.0
"""Seconds the slots' caches may take to save when loopd stops."""


@dataclass
class Lease:
    slot: Slot
    index: int
    """The slot's place in the pool."""
    hot: bool
    """The slot holds its owner's cache already."""
    evicted: str | None
    """The session whose cache the slot holds, to be saved before the slot is used."""
    owner: str | None
    """Whose cache the slot holds when it comes back; the holder sets it (a compaction's
    session goes on under a new id)."""
    tokens: int | None = None
    """Tokens it then holds, as far as the holder knows (for `status`)."""
    grant: int = 0
    """Which lending of the slot this is: a release frees only the lending it names."""
    model: str | None = None
    """The model of its server (`[models.NAME]`); None: loopd serves one unnamed model."""


@dataclass(frozen=True)
class SlotView:
    """One slot, as `status` shows it."""

    server: str
    number: int
    session: str | None
    tokens: int | None
    busy: bool
    model: str | None = None


@dataclass
class _State:
    slot: Slot
    index: int
    model: str | None = None
    """The model of its server."""
    owner: str | None = None
    tokens: int | None = None
    grant: int | None = None
    """The lending it is lent under (`Lease.grant`); None while it is idle."""
    used: float = -math.inf
    """When it was last given back: the least recently used idle slot is taken first."""

    @property
    def leased(self) -> bool:
        return self.grant is not None


@dataclass(frozen=True)
class _Acquire:
    owner: str | None
    hot_only: bool
    wait: bool
    prefer: str | None
    reply: Reply[Lease | None]
    avoid: str | None = None
    """A server not to lend from, nor from any that does not answer (a move)."""
    source: str | None = None
    """A fork's parent, while the fork holds no cache of its own: its slot serves the fork."""
    model: str | None = None
    """The model whose slots it may have; None: the default model."""


@dataclass(frozen=True)
class _Release:
    index: int
    grant: int
    owner: str | None
    tokens: int | None


@dataclass(frozen=True)
class _Saved:
    session: str


@dataclass(frozen=True)
class _Reset:
    """The server started anew: no idle slot holds anything."""

    server: str


@dataclass(frozen=True)
class _Health:
    server: str
    up: bool


@dataclass(frozen=True)
class _Views:
    reply: Reply[tuple[SlotView, ...]]


_Message = _Acquire | _Release | _Saved | _Reset | _Health | _Views


class PoolHandle:
    def __init__(self, inbox: trio.MemorySendChannel[_Message], servers: int) -> None:
        self._inbox = inbox
        self.servers = servers
        """How many servers the slots are of: with one, there is no server to prefer."""

    @asynccontextmanager
    async def lease(  # noqa: PLR0913 - what a lease may ask, each by name
        self,
        owner: str | None,
        *,
        hot_only: bool = False,
        wait: bool = True,
        prefer: str | None = None,
        source: str | None = None,
        model: str | None = None,
    ) -> AsyncIterator[Lease | None]:
        """A slot for `owner` (None: for a request of no session) while the block runs, on
        server `prefer` where one is idle there; None when `hot_only` and no slot holds its
        cache, or when not `wait` and none is idle. `source`: the session whose cache
        `owner`'s next request extends (a fork's parent), where no slot holds `owner`'s own:
        the idle slot that holds it is taken over (its cache saved to its file first).
        `model`: a slot of that model's servers only (None: of the default model)."""

        def acquire(reply: Reply[Lease | None]) -> _Acquire:
            return _Acquire(owner, hot_only, wait, prefer, reply, source=source, model=model)

        lease = await ask(self._inbox, acquire, orphan=self._unused)
        try:
            yield lease
        finally:
            if lease is not None:
                if lease.evicted is not None:  # the holder left before it saved it
                    self.saved(lease.evicted)
                release = _Release(lease.index, lease.grant, lease.owner, lease.tokens)
                self._inbox.send_nowait(release)

    async def move(self, lease: Lease) -> bool:
        """Move `lease`, whose server cannot take its holder's request, to an idle slot of
        another server that answers; False, and `lease` as it was, where none is idle. The
        slot it leaves is given back holding nothing the holder counts on, and its server is
        counted as not answering; the block that holds `lease` gives back the new slot."""
        server = lease.slot.client.base_url

        def acquire(reply: Reply[Lease | None]) -> _Acquire:
            return _Acquire(
                lease.owner,
                hot_only=False,
                wait=False,
                prefer=None,
                reply=reply,
                avoid=server,
                model=lease.model,
            )

        new = await ask(self._inbox, acquire, orphan=self._unused)
        if new is None:
            return False
        self._inbox.send_nowait(_Release(lease.index, lease.grant, None, None))
        self.health(server, up=False)
        lease.slot, lease.index, lease.hot, lease.grant = new.slot, new.index, new.hot, new.grant
        lease.evicted, lease.tokens = new.evicted, new.tokens
        return True

    def _unused(self, lease: Lease | None) -> None:
        """Give back a lease granted to an asker that was cancelled before it read it: the
        slot still holds what it held, the cache of the session it would have evicted (whose
        save is no longer waited for), or of the owner where it was hot."""
        if lease is None:
            return
        if lease.evicted is not None:
            self.saved(lease.evicted)
        held = lease.evicted or (lease.owner if lease.hot else None)
        tokens = lease.tokens if lease.hot else None
        self._inbox.send_nowait(_Release(lease.index, lease.grant, held, tokens))

    async def prepare(
        self, lease: Lease, files: SlotFiles, session: Session | None, source: str | None = None
    ) -> str | None:
        """Make the slot ready for its holder: the evicted session's cache saved to its file,
        then `session`'s restored from its own (or from that of `source`, whose cache it
        extends), unless the slot holds it already. Why its cache could not be restored,
        where it had one to restore."""
        if lease.evicted is not None:
            log.info(
                "slot %d of %s goes from session %s to %s",
                lease.slot.number,
                lease.slot.client.base_url,
                lease.evicted,
                lease.owner or "a summary",
            )
            try:
                await files.save(lease.slot, lease.evicted)
            finally:
                self.saved(lease.evicted)
                lease.evicted = None
        if session is None or lease.hot:
            return None
        if not lease.slot.client.engine.slot_files:
            return _restarted_since(lease.slot.client, session)
        restored = await files.restore(lease.slot, session, source)
        lease.tokens = restored.tokens if restored else None
        if restored is None and session.last_usage() is not None:
            return files.missing(lease.slot, source or session.id)
        return None

    def saved(self, session: str) -> None:
        """The cache of `session`, evicted from a slot, is in its file now (or never will be)."""
        self._inbox.send_nowait(_Saved(session))

    def reset(self, server: str) -> None:
        """`server` restarted: its slots are empty."""
        self._inbox.send_nowait(_Reset(server))

    def health(self, server: str, *, up: bool) -> None:
        """`server` answers again, or stopped answering."""
        self._inbox.send_nowait(_Health(server, up))

    async def views(self) -> tuple[SlotView, ...]:
        return await ask(self._inbox, _Views)


POOL = "the slot pool"
RAN_ON_KEPT = 4096
"""Sessions whose server the pool remembers (`_Pool.ran_on`), the most recent."""


def _restarted_since(client: Client, session: Session) -> str | None:
    """On a server whose cache every request shares (vLLM), no slot holds a session's cache:
    it is lost only when the server restarted since the session's last request."""
    usage = session.last_usage()
    if usage is None or client.started_at is None or usage.time.timestamp() >= client.started_at:
        return None
    return (
        f"the server at {client.base_url} restarted since the session's last request, and "
        "keeps no cache across a restart"
    )


async def pool_actor(  # noqa: PLR0913 - what the pool starts with, each by name
    slots: Sequence[Slot],
    files: SlotFiles,
    restarts: Restarts = RESTARTS,
    *,
    models: Mapping[str, str] | None = None,
    default: str | None = None,
    task_status: trio.TaskStatus[PoolHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Lend `slots` until cancelled, restarted on a bug within `restarts`; then save the
    cache of every session a slot holds. `models`: each server's model, by its URL, where
    loopd serves several; `default`: the model of a request that names none."""
    # Unbounded on purpose: releases, saves and health news are sent with `send_nowait` from
    # `finally` blocks and cancelled tasks, and must never block or be lost; each lease sends
    # at most two, and acquires wait for their answer.
    send, receive = trio.open_memory_channel[_Message](math.inf)
    of = models or {}
    pool = _Pool([_State(s, i, of.get(s.client.base_url)) for i, s in enumerate(slots)], default)
    task_status.started(PoolHandle(send, len({s.client.base_url for s in slots})))

    async def life() -> None:
        nonlocal pool
        async for message in receive:
            try:
                pool.take(message)
            except Exception as e:
                pool = pool.restarted(message, ActorFailed.of(POOL, e))
                raise

    try:
        async with receive:
            await supervised(POOL, life, restarts)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(SAVE_AT_STOP):
            for state in pool.states:
                if state.owner is not None and files.save_when != "never":
                    await files.save(state.slot, state.owner)


class _Pool:
    def __init__(self, states: list[_State], default: str | None = None) -> None:
        self.states = states
        self.default = default
        """The model of a request that names none."""
        self.down: set[str] = set()
        """Servers that do not answer."""
        self.waiting: deque[_Acquire] = deque()
        self.evicting: set[str] = set()
        """Sessions whose cache is being saved by whoever took their slot."""
        self.grants = itertools.count(1)
        self.ran_on: OrderedDict[str, str] = OrderedDict()
        """On servers whose cache every request shares (vLLM), the one each session last ran
        on: it keeps the session's blocks after its slot went to another session, so the
        session takes a slot there again rather than a free one elsewhere. (On llama-server
        a session's cache leaves with its slot, and its slot file says where it went.)"""

    def take(self, message: _Message) -> None:
        if isinstance(message, _Acquire):
            if not self._try(message):
                if message.wait:
                    self.waiting.append(message)
                else:
                    reply_value(message.reply, None)
            return
        if isinstance(message, _Release):
            state = self.states[message.index]
            if state.grant != message.grant:
                return  # of a lending that ended already, before a restart: nothing to free
            state.grant, state.used = None, trio.current_time()
            state.owner, state.tokens = message.owner, message.tokens
        elif isinstance(message, _Saved):
            self.evicting.discard(message.session)
        elif isinstance(message, _Reset):
            self._forget(message.server)
        elif isinstance(message, _Health):
            if message.up:
                self.down.discard(message.server)
            else:
                self.down.add(message.server)
                self._forget(message.server)
        else:
            views = tuple(
                SlotView(
                    s.slot.client.base_url, s.slot.number, s.owner, s.tokens, s.leased, s.model
                )
                for s in self.states
            )
            reply_value(message.reply, views)
            return
        self._grant_waiting()

    def restarted(self, failed: _Message, error: ActorFailed) -> _Pool:
        """The pool a restart after a failure in `failed` starts with; what was asked of
        this one and not answered is answered `error`."""
        new = _Pool(
            [_State(s.slot, s.index, s.model, grant=s.grant) for s in self.states], self.default
        )
        new.down, new.evicting, new.grants = set(self.down), set(self.evicting), self.grants
        # News the failure caught still counts: their senders have gone and never repeat it.
        if isinstance(failed, _Release):
            if new.states[failed.index].grant == failed.grant:
                new.states[failed.index].grant = None
        elif isinstance(failed, _Saved):
            new.evicting.discard(failed.session)
        elif isinstance(failed, _Health) and failed.up:
            new.down.discard(failed.server)
        elif isinstance(failed, _Health):
            new.down.add(failed.server)
        elif isinstance(failed, _Acquire | _Views):
            reply_error(failed.reply, error)  # no-op for a lease granted before the failure
        for request in self.waiting:
            reply_error(request.reply, error)
        return new

    def _forget(self, server: str) -> None:
        for state in self.states:
            # A leased slot is filled again by its holder, or its request fails.
            if state.slot.client.base_url == server and not state.leased:
                state.owner, state.tokens = None, None

    def _grant_waiting(self) -> None:
        for request in list(self.waiting):
            if self._try(request):
                self.waiting.remove(request)

    def _try(self, request: _Acquire) -> bool:
        """Grant `request` if a slot can be had now; True when it is answered."""
        if request.owner is not None and request.owner in self.evicting:
            return False  # its cache is on its way to the file it would be restored from
        model = request.model or self.default
        mine = self._holding(request.owner, request.avoid, model)
        if mine is None and request.hot_only:
            reply_value(request.reply, None)
            return True
        if mine is None and request.source is not None:
            if request.source in self.evicting:
                return False  # its cache is on its way to the file the fork would restore
            theirs = self._holding(request.source, request.avoid, model)
            if theirs and not theirs.leased:
                mine = theirs  # the fork takes it over, holding its parent's cache
        prefer = request.prefer or self.ran_on.get(request.owner or "")
        state = mine or self._least_recently_used(prefer, request.avoid, model)
        if state is None or state.leased:
            return False
        hot = state is mine
        taken_over = hot and state.owner != request.owner
        lease = Lease(
            state.slot,
            state.index,
            hot=hot,
            evicted=state.owner if not hot or taken_over else None,
            owner=request.owner,
            tokens=state.tokens if hot else None,
            grant=next(self.grants),
            model=state.model,
        )
        self._keep_server(request.owner, state)
        if self._give(request, state, lease) and (not hot or taken_over):
            if lease.evicted is not None:
                self.evicting.add(lease.evicted)
            state.owner, state.tokens = request.owner, None
        return True

    def _keep_server(self, owner: str | None, state: _State) -> None:
        """Where `owner` runs now, where the server's cache outlives the slot (`ran_on`)."""
        if owner is None or state.slot.client.engine.slot_files:
            return
        self.ran_on[owner] = state.slot.client.base_url
        self.ran_on.move_to_end(owner)
        if len(self.ran_on) > RAN_ON_KEPT:
            self.ran_on.popitem(last=False)

    def _holding(self, owner: str | None, avoid: str | None, model: str | None) -> _State | None:
        """The slot of `model` that holds `owner`'s cache, on a server other than `avoid`."""
        return next(
            (
                s
                for s in self.states
                if s.owner
                and s.owner == owner
                and s.model == model
                and s.slot.client.base_url != avoid
            ),
            None,
        )

    def _least_recently_used(
        self, prefer: str | None, avoid: str | None, model: str | None
    ) -> _State | None:
        """An idle slot of `model` on a server that answers (of any, while none does, unless
        one is to be avoided): on `prefer` first, a free one first, then the one given back
        longest ago."""
        states = [s for s in self.states if s.model == model]
        idle = [s for s in states if not s.leased and s.slot.client.base_url != avoid]
        if avoid or any(s.slot.client.base_url not in self.down for s in states):
            idle = [s for s in idle if s.slot.client.base_url not in self.down]
        return min(
            idle,
            key=lambda s: (s.slot.client.base_url != prefer, s.owner is not None, s.used),
            default=None,
        )

    def _give(self, request: _Acquire, state: _State, lease: Lease) -> bool:
        """Hand `lease` over; False (and the slot untouched) when the asker has left."""
        try:
            request.reply.send_nowait(outcome.Value(lease))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        state.grant = lease.grant
        return True
