"""`open_core` wires the actors of a running loopd:

    open_core ─┬─ tool port     (owns tool calls in flight and pending approvals; supervises
               │                 MCP servers)
               ├─ slot pool     (owns the server's slots; lends one to a session for a turn)
               └─ sessions      (a session actor per live conversation: its log, its turns,
                                 their events; the registry opens and stops them, each with
                                 the MCP servers its client gave it; a turn's `delegate`
                                 calls run sub-agents in the calls' tasks)

They start in that order, each before the next needs it, and stop in the reverse order when
the block ends. A bug in the pool or the port restarts that actor alone on the same inbox
(`loopd.supervise`), up to `restarts`; past it they all stop. Turns that are running then are
cancelled, and still leave valid logs; the caches the slots hold are saved to the sessions'
slot files.
"""

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import trio

from loopd.config import Config, user_instructions, user_skills
from loopd.hooks import Hooks
from loopd.infer import Client, Slot
from loopd.session.baseline import SUB_AGENT_NOTE, make_baseline
from loopd.session.compact import Compactor
from loopd.session.records import Baseline
from loopd.session.store import Session, Store
from loopd.supervise import RESTARTS, Restarts
from loopd.tools import (
    PortHandle,
    Roots,
    SkillReader,
    delegate_entry,
    given_tools,
    open_tool_port,
    secrets,
)
from loopd.turn import Runtime
from loopd.turn.changes import Blobs, Hands
from loopd.turn.exact import ExactHistory

from ._agents import AGENTS, Agents
from ._instructions import InstructionReader
from ._models import Models
from ._pool import PoolHandle, pool_actor
from ._registry import SessionRegistry
from ._session import SessionActor, SessionHooks
from ._slots import SlotFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Core:
    """What the channel holds of a running core."""

    sessions: SessionRegistry
    pool: PoolHandle
    agents: Agents


@asynccontextmanager
async def open_core(  # noqa: PLR0913 - what a whole loopd is made of
    config: Config,
    store: Store,
    clients: Sequence[Client],
    slot_directory: Path | None = None,
    private: Sequence[Path] = (),
    *,
    restarts: Restarts = RESTARTS,
    served: Mapping[str, str] | None = None,
) -> AsyncIterator[Core]:
    """The actors of a loopd on the servers of `clients` (the first one renders templates).
    `served`: each server's model (`[models.NAME]`), by its URL, where loopd serves several;
    the first client is then of the default model.
    `slot_directory`: where llama-server keeps slot files, when loopd can see it; `private`:
    loopd's own files, out of the tools' reach (`config.private_paths`); `restarts`: how often
    the pool, the port and each MCP source may fail and start again, and who stops loopd when
    the pool or the port fails more often."""
    baseline: Callable[[], Baseline] = partial(make_baseline, config.session.system_prompt)
    served = served or {}
    files = slot_files(config, slot_directory)
    files.models = served
    slots = [
        s for client in clients for s in await _slots_of(client, _most(config, served, client))
    ]
    log.info("%d slots in the pool", len(slots))
    client = clients[0]
    exact = config.session.history == "exact"
    keys = secrets(config.tools.run)
    # One view of the folders for every reader and writer of files: each hides loopd's own
    # files and the user's keys alike. `keys` alone hides the keys where no root applies (the
    # user's own instructions and skills).
    roots = Roots(config.tools.roots, [*private, *keys], own=private)
    key_roots = Roots([], keys)
    models = Models(
        names=tuple(config.models),
        default=config.default_model,
        servers=served,
        exact={
            name: ExactHistory(next(c for c in clients if served.get(c.base_url) == name))
            for name in config.models
            if exact and name in served.values()
        },
    )
    async with (
        open_tool_port(config.tools, private, restarts) as port,
        _pool(slots, files, restarts, models) as pool,
    ):
        runtime = Runtime(  # each turn runs it on the slot it is lent
            loop=config.loop,
            inference=slots[0],
            port=port,
            registry=port.registry,
            find_limit=config.tools.find_limit,
            sampling=dict(config.server.sampling),
            exact=ExactHistory(client) if exact else None,
            hands=_hands(config, roots),
            hooks=Hooks(config.hooks),
        )
        agents = Agents(
            config.agents,
            at_once=config.agents.at_once or len(slots) - 1,
            store=store,
            pool=pool,
            files=files,
            baseline=partial(make_baseline, f"{config.session.system_prompt}\n\n{SUB_AGENT_NOTE}"),
        )
        if config.agents.depth > 0:
            port.registry.set_source(AGENTS, [delegate_entry(config.tools, AGENTS)])

        def actor(session: Session, hooks: SessionHooks, tools: PortHandle) -> SessionActor:
            return SessionActor(
                session,
                store=store,
                baseline=baseline,
                runtime=replace(runtime, port=tools, registry=tools.registry),
                port=tools,
                pool=pool,
                files=files,
                compactor=Compactor(
                    max_tokens=config.session.summary_tokens,
                    sampling=dict(config.server.sampling),
                    on_full=config.session.on_full,
                ),
                queue_limit=config.channel.queue_limit,
                agents=agents,
                hooks=hooks,
                models=models,
            )

        async with trio.open_nursery() as sessions:
            registry = SessionRegistry(
                sessions,
                store,
                baseline,
                actor,
                partial(
                    given_tools,
                    port,
                    config.tools,
                    restarts=restarts,
                    skills=SkillReader(roots=roots, user=user_skills(), keys=key_roots),
                ),
                max_live=config.session.max_live,
                roots=roots,
                agents=agents,
                instructions=InstructionReader(
                    roots=roots,
                    user=user_instructions(),
                    keys=key_roots,
                    limit=config.session.instructions_bytes,
                ),
            )
            yield Core(registry, pool, agents)
            sessions.cancel_scope.cancel()


@asynccontextmanager
async def _pool(
    slots: Sequence[Slot], files: SlotFiles, restarts: Restarts, models: Models
) -> AsyncIterator[PoolHandle]:
    """The slot pool, which stops only once the block is over. Stopping loopd cancels both at
    once; a pool that stopped first would have closed its inbox while the turns of the block
    still held its slots and gave them back as they ended, and would save caches their slots
    were still busy with."""
    stop = trio.CancelScope(shield=True)

    async def run(*, task_status: trio.TaskStatus[PoolHandle]) -> None:
        with stop:
            await pool_actor(
                slots,
                files,
                restarts,
                models=models.servers,
                default=models.default,
                task_status=task_status,
            )

    async with trio.open_nursery() as nursery:
        pool: PoolHandle = await nursery.start(run)
        try:
            yield pool
        finally:
            stop.cancel()


def _most(config: Config, served: Mapping[str, str], client: Client) -> int:
    """Slots loopd lends of `client`'s server: its model's `slots`, else `[server] slots`."""
    model = config.models.get(served.get(client.base_url, ""))
    return (model.slots if model else None) or config.server.slots


async def _slots_of(client: Client, most: int) -> list[Slot]:
    if not client.engine.slot_files:  # vLLM and the others: `most` turns at once, no slots
        return [Slot(client, n) for n in range(most)]
    count = await client.slot_count()
    if count is None:
        log.warning(
            "llama-server at %s does not list its slots (GET /slots): loopd uses one, slot 0",
            client.base_url,
        )
    return [Slot(client, n) for n in range(min(count or 1, most))]


def _hands(config: Config, roots: Roots) -> Hands:
    """What writes and edits files in `roots`, keeping every content it replaces in
    `file-history` beside the sessions, for `undo` (in `[tools] roots`, or, with none, in a
    session's own folder)."""
    return Hands(roots, Blobs(config.store.directory.parent / "file-history"))


def slot_files(config: Config, directory: Path | None) -> SlotFiles:
    """The slot files of the sessions in `[store] directory`."""
    notes = config.store.directory.parent / "slot-files"
    return SlotFiles(config.slots.save, notes, directory, config.slots.keep_bytes)
