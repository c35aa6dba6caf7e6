"""The actors of a running loopd, and the one function that wires them.

    open_core ─┬─ tool port     (supervises MCP servers; calls run in the turn's task)
               ├─ inference     (owns the slot: one request at a time)
               └─ session       (runs turns in order, publishes their events)

They start in that order, each with `nursery.start`, so a turn never meets a half-started
port; they stop in the reverse order when the block ends or any of them fails. A turn that is
running then is cancelled, and still leaves a valid log.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from loopd.config import Config
from loopd.exact import ExactHistory
from loopd.infer import Client
from loopd.store import Session
from loopd.tools import LocalToolPort, open_tool_port
from loopd.turn import Runtime

from ._inference import InferenceHandle, inference_actor
from ._session import Busy, Published, SessionActor, Subscription, TurnDone, TurnFailed

__all__ = [
    "Busy",
    "Core",
    "InferenceHandle",
    "Published",
    "SessionActor",
    "Subscription",
    "TurnDone",
    "TurnFailed",
    "inference_actor",
    "open_core",
]


@dataclass(frozen=True)
class Core:
    session: SessionActor
    inference: InferenceHandle
    port: LocalToolPort


@asynccontextmanager
async def open_core(config: Config, session: Session, client: Client) -> AsyncIterator[Core]:
    async with open_tool_port(config.tools) as port, trio.open_nursery() as nursery:
        inference = await nursery.start(inference_actor, client)
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
        actor = SessionActor(session, runtime, config.channel.queue_limit)
        await nursery.start(actor.run)
        yield Core(actor, inference, port)
        nursery.cancel_scope.cancel()
