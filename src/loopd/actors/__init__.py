"""The actors of a running loopd, and the one function that wires them.

    open_core ─┬─ tool port     (owns tool calls in flight and pending approvals; supervises
               │                 MCP servers)
               ├─ inference     (owns the slot: one request at a time)
               └─ session       (owns the session and its turns; publishes their events)

Each has one inbox: a memory channel of typed messages, with a reply channel where an answer
is needed, reached through its handle. They start in that order, each before the next needs
it, and stop in the reverse order when the block ends or any of them fails. A turn that is
running then is cancelled, and still leaves a valid log.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from loopd.baseline import make_baseline
from loopd.compact import Compactor
from loopd.config import Config
from loopd.exact import ExactHistory
from loopd.infer import Client
from loopd.records import Baseline
from loopd.slots import Slot, SlotFiles
from loopd.store import Session, Store
from loopd.tools import open_tool_port
from loopd.turn import Runtime

from ._inference import InferenceHandle, inference_actor
from ._session import SessionActor
from ._session_inbox import (
    HISTORY_PAGE,
    Busy,
    DuplicateTurn,
    HistoryPage,
    Published,
    SessionBusy,
    SessionHandle,
    SessionStatus,
    Subscription,
    TurnDone,
    TurnFailed,
)

__all__ = [
    "HISTORY_PAGE",
    "Busy",
    "DuplicateTurn",
    "HistoryPage",
    "InferenceHandle",
    "Published",
    "SessionActor",
    "SessionBusy",
    "SessionHandle",
    "SessionStatus",
    "Subscription",
    "TurnDone",
    "TurnFailed",
    "inference_actor",
    "open_core",
    "slot_files",
]


@asynccontextmanager
async def open_core(
    config: Config,
    store: Store,
    session: Session,
    client: Client,
    slot_directory: Path | None = None,
) -> AsyncIterator[SessionHandle]:
    """The actors serving `session` (which the session actor closes when it leaves it).
    `slot_directory`: where llama-server keeps slot files, when loopd can see it."""
    baseline: Callable[[], Baseline] = partial(make_baseline, config.session.system_prompt)
    async with open_tool_port(config.tools) as port, trio.open_nursery() as nursery:
        inference = await nursery.start(inference_actor, client, config.slots.main)
        slots = slot_files(config, inference, slot_directory)
        runtime = Runtime(
            loop=config.loop,
            inference=inference,
            port=port,
            registry=port.registry,
            slot=config.slots.main,
            find_limit=config.tools.find_limit,
            sampling=dict(config.server.sampling),
            exact=ExactHistory(client) if config.session.history == "exact" else None,
        )
        actor = SessionActor(
            session,
            store=store,
            baseline=baseline,
            runtime=runtime,
            port=port,
            slots=slots,
            compactor=Compactor(
                inference,
                main=config.slots.main,
                side=config.slots.side,
                max_tokens=config.session.summary_tokens,
                sampling=dict(config.server.sampling),
                on_full=config.session.on_full,
            ),
            queue_limit=config.channel.queue_limit,
        )
        handle: SessionHandle = await nursery.start(actor.run)
        yield handle
        nursery.cancel_scope.cancel()


def slot_files(config: Config, slot: Slot, directory: Path | None) -> SlotFiles:
    """The slot files of the sessions in `[store] directory`."""
    notes = config.store.directory.parent / "slot-files"
    return SlotFiles(slot, config.slots.save, notes, directory, config.slots.keep_bytes)
