"""MCP servers as tool sources, over stdio or at a URL (`_mcp_connect`), with the official
`mcp` SDK (it runs on trio through anyio).

Each server is a small state machine owned by one task, its supervisor in `open_tool_port`'s
nursery beside the port actor:

    starting ──▶ up(client) ──(its connection closed)──▶ down(why) ──(a call wants it)──▶ starting
        └──(failed, timed out)──▶ down(why, not before T: backoff) ─┘
    any ──(a bug in the supervisor)──▶ starting         (within `Restarts`, a new server)
    any ──(loopd stops, or the supervisor failed past its bound)──▶ stopped(why)

Its tools join the registry as `<server>.<tool>` while it is up. The SDK notices a dead
server only when a call fails (its connection closed: `CONNECTION_CLOSED`, or a request to a
server at a URL that refuses the connection), so that call answers `Failed`, the tools are
marked unavailable, and the next call starts the server again (connects again, for one at a
URL); starts that keep failing back off, up to a minute apart, the calls meanwhile answering
that the server is unavailable. Callers only read the state and wait
for it to change; only the supervisor changes it. Nothing a server does can take the daemon
down, nor can a bug in its supervisor: it is started again (`supervised`), and past its bound
the source stops alone, its tools answering why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from loopd.backoff import RESTART
from loopd.config import McpServer, ToolsConfig
from loopd.supervise import RESTARTS, GaveUp, Restarts, short, supervised

from ._mcp_connect import connect
from ._registry import Registry, policy_for
from ._types import ToolEntry, ToolFailure, ToolOutput, ToolRequest

if TYPE_CHECKING:  # the SDK is imported once a server is used (`_mcp_connect`)
    import mcp.types
    from mcp import Client

__all__ = ["McpSource", "start_sources"]

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0


@dataclass(frozen=True)
class Starting:
    pass


@dataclass(frozen=True)
class Up:
    client: Client
    closed: trio.Event = field(default_factory=trio.Event)
    """Set by a call that found the connection closed: the server is gone."""


@dataclass(frozen=True)
class Down:
    why: str
    not_before: float = 0.0
    """No start before this time (`trio.current_time()`): the backoff after failed starts."""
    failures: int = 0
    """Starts that failed in a row."""


@dataclass(frozen=True)
class Stopped:
    why: str = "loopd is shutting down"


State = Starting | Up | Down | Stopped


class McpSource:
    """One MCP server: its supervisor task (`supervise`), and the executor of its tools."""

    def __init__(
        self,
        name: str,
        server: McpServer,
        registry: Registry,
        config: ToolsConfig,
        restarts: Restarts = RESTARTS,
    ) -> None:
        self.name, self.server = name, server
        self.registry, self.config = registry, config
        # An MCP server's tools are not worth loopd: past its bound, the source stops alone.
        self.restarts = replace(restarts, gave_up=None)
        self.state: State = Starting()
        self.words = _URL_WORDS if server.url is not None else _STDIO_WORDS
        self._watchers = trio.lowlevel.ParkingLot()
        """Callers waiting for the state to change."""
        self._wanted = trio.Event()
        """A caller wants the server started (set by callers, taken by the supervisor)."""
        self.first_start = trio.Event()
        """Set once the first start has succeeded or failed."""

    def _become(self, state: State) -> None:
        self.state = state
        self._watchers.unpark_all()
        if not isinstance(state, Starting):
            self.first_start.set()

    async def supervise(self) -> None:
        """Start the server at once, and again whenever a call wants it and it is down, until
        cancelled; restarted on a bug within its `Restarts`."""
        stopped = Stopped()
        try:
            await supervised(
                f"the supervisor of MCP server {self.name}", self._lives, self.restarts
            )
        except GaveUp as e:
            stopped = Stopped(f"{e}; loopd goes on without it")
        finally:
            self.registry.set_available(self.name, available=False)
            self._become(stopped)

    async def _lives(self) -> None:
        failures = 0
        while True:
            # Made anew before the server can be down, so no caller's wish comes too early.
            self._wanted = trio.Event()
            self._become(Starting())
            failures = await self._run_once(failures)
            await self._wanted.wait()

    async def _run_once(self, failures: int) -> int:
        """One life of the server, up to its end; the start failures in a row after it."""
        up: Up | None = None
        try:
            with trio.CancelScope(deadline=trio.current_time() + START_TIMEOUT) as starting:
                async with connect(self.name, self.server) as client:
                    listed = await client.list_tools()
                    starting.deadline = math.inf
                    self.registry.set_source(self.name, self._entries(listed.tools))
                    log.info(
                        "MCP server %s %s: %d tools", self.name, self.words.up, len(listed.tools)
                    )
                    up = Up(client)
                    self._become(up)
                    await up.closed.wait()
            if starting.cancelled_caught:
                return self._failed(failures, f"it did not answer within {START_TIMEOUT:g} s")
        except Exception as e:  # noqa: BLE001 - whatever a server does, report it and go on
            if up is None:
                return self._failed(failures, short(e))
            log.warning("MCP server %s %s: %s", self.name, self.words.gone, short(e))
        finally:
            self.registry.set_available(self.name, available=False)
        self._become(Down(f"it {self.words.gone}; {self.words.again}"))
        return 0

    def _failed(self, failures: int, why: str) -> int:
        failures += 1
        delay = RESTART.delay(failures)
        log.warning(
            "MCP server %s %s: %s (next try in %.0f s at the earliest)",
            self.name,
            self.words.failed,
            why,
            delay,
        )
        self._become(Down(why, trio.current_time() + delay, failures))
        return failures

    def _entries(self, tools: list[mcp.types.Tool]) -> list[ToolEntry]:
        entries = []
        for tool in tools:
            name = f"{self.name}.{tool.name}"
            description = (tool.description or tool.title or tool.name).strip()
            entries.append(
                ToolEntry(
                    name=name,
                    summary=description.splitlines()[0] if description else name,
                    description=description,
                    schema=dict(tool.input_schema),
                    source=self.name,
                    policy=policy_for(self.config, name, self.name, self.server.policy),
                )
            )
        return entries

    async def _up(self) -> Up:
        """The server up, started if a call may start it now; a `ToolFailure` saying why not."""
        asked = False
        while True:
            state = self.state
            if isinstance(state, Up) and not state.closed.is_set():
                return state
            if isinstance(state, Stopped):
                raise ToolFailure(f"MCP server {self.name} is stopped: {state.why}")
            if isinstance(state, Down):
                wait = state.not_before - trio.current_time()
                if asked and state.failures:
                    raise ToolFailure(f"MCP server {self.name} {self.words.failed}: {state.why}")
                if wait > 0:
                    raise ToolFailure(
                        f"MCP server {self.name} {self.words.down} ({state.why}); "
                        f"the next {self.words.attempt} is in {wait:.0f} s"
                    )
                self._wanted.set()
                asked = True
            await self._watchers.park()

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        """The MCP server's tools work where the server does: a session's own folder (`cwd`)
        does not reach them."""
        from mcp.shared.exceptions import MCPError  # noqa: PLC0415 - imported by `_up`'s start
        from mcp.types import CONNECTION_CLOSED  # noqa: PLC0415

        up = await self._up()
        tool = entry.name.removeprefix(f"{self.name}.")
        try:
            result = await up.client.call_tool(tool, request.arguments)
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                self.registry.set_available(self.name, available=False)
                up.closed.set()  # the supervisor sees the server gone, and says so
                raise ToolFailure(
                    f"MCP server {self.name} {self.words.gone} ({e}); {self.words.again}"
                ) from None
            raise ToolFailure(f"{entry.name}: {e}") from None
        text = "\n".join(_text_of(block) for block in result.content)
        return ToolOutput(text, is_error=result.is_error)


@dataclass(frozen=True)
class _Words:
    """How a server's life is told: one loopd runs starts and stops, one at a URL is
    connected to and goes away."""

    up: str
    failed: str
    gone: str
    again: str
    down: str
    attempt: str


_STDIO_WORDS = _Words(
    "started",
    "did not start",
    "stopped",
    "it is started again on the next call",
    "is not running",
    "start",
)
_URL_WORDS = _Words(
    "connected",
    "is unavailable",
    "went away",
    "it is connected again on the next call",
    "is unavailable",
    "try",
)


async def start_sources(nursery: trio.Nursery, sources: Sequence[McpSource]) -> None:
    """Supervise `sources` in `nursery`, side by side; return once each has had its first
    start (or failed it), so that their tools are in the registry from the first turn on."""
    for source in sources:
        nursery.start_soon(source.supervise)
    for source in sources:
        await source.first_start.wait()


def _text_of(block: Any) -> str:
    from mcp.types import TextContent  # noqa: PLC0415 - imported by then (`run_tool`)

    if isinstance(block, TextContent):
        return block.text
    kind = getattr(block, "type", "content")
    return f"[{kind} content, not shown]"
