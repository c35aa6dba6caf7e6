"""The channel server: accepts clients on the socket, up to `[channel] max_clients`, and says
goodbye to all of them when loopd stops."""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass

import trio

from loopd.actors import Core
from loopd.config import ChannelConfig
from loopd.wire import proto

from ._connection import GOODBYE_GRACE, Connection
from ._handlers import DaemonInfo

__all__ = ["ChannelServer"]

log = logging.getLogger(__name__)


@dataclass
class ChannelServer:
    core: Core
    info: DaemonInfo
    config: ChannelConfig

    def __post_init__(self) -> None:
        self._connections: set[Connection] = set()
        self._numbers = itertools.count(1)

    async def serve(self, listener: trio.SocketListener) -> None:
        await trio.serve_listeners(self._handle, [listener])

    async def _handle(self, stream: trio.SocketStream) -> None:
        if len(self._connections) >= self.config.max_clients:
            await _refuse(stream, self.config.max_clients)
            return
        number = next(self._numbers)
        connection = Connection(number, stream, self.core, self.info, self.config)
        self._connections.add(connection)
        try:
            await connection.run()
        except Exception:
            log.exception("connection %d failed", number)
        finally:
            self._connections.discard(connection)

    async def goodbye(self, reason: str) -> None:
        """Tell every client the daemon is going, and give their writers a moment."""
        for connection in list(self._connections):
            connection.close_with(proto.Bye(reason=reason))
        with trio.move_on_after(GOODBYE_GRACE):
            while self._connections:  # noqa: ASYNC110 - connections end on their own
                await trio.sleep(0.01)


async def _refuse(stream: trio.SocketStream, cap: int) -> None:
    message = f"loopd serves at most {cap} clients at once ([channel] max_clients)"
    with trio.move_on_after(GOODBYE_GRACE):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(proto.dump(proto.Error(code="too_many_clients", message=message)))
        await stream.aclose()
