"""MCP servers over stdio as tool sources, with the official `mcp` SDK (it runs on trio
through anyio).

Each server has a supervisor task in `open_tool_port`'s nursery, beside the port actor, that
holds its connection open. Its
tools join the registry as `<server>.<tool>`. The SDK notices a dead server only when a call
fails, so that call answers `Failed`, the tools are marked unavailable, and the next call
starts the server again; starts that keep failing back off, up to a minute apart. Nothing a
server does can take the daemon down.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import mcp.types
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from loopd._groups import innermost
from loopd.backoff import RESTART
from loopd.config import McpServer, ToolsConfig

from ._entry import ToolEntry
from ._port import ToolFailure, ToolOutput, ToolRequest
from ._registry import Registry, policy_for

__all__ = ["McpSource"]

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0


class McpSource:
    """One MCP server: its supervisor task, and the executor of its tools."""

    def __init__(
        self, name: str, server: McpServer, registry: Registry, config: ToolsConfig
    ) -> None:
        self.name = name
        self.server = server
        self.registry = registry
        self.config = config
        self._client: Client | None = None
        self._wanted = trio.Event()
        self._wanted.set()  # start at once
        self._broken = trio.Event()
        self._changed = trio.Event()
        self.first_start = trio.Event()
        """Set once the first start has succeeded or failed."""
        self._starts = 0
        """Start attempts that ended, in success or failure: a caller waits for the next."""
        self._failures = 0
        self._not_before = 0.0
        self._last_error = ""

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def supervise(self) -> None:
        """Start the server whenever it is wanted and not running, until cancelled."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            await self._serve_once()

    async def _serve_once(self) -> None:
        params = StdioServerParameters(
            command=self.server.command[0],
            args=self.server.command[1:],
            env={**os.environ, **self.server.env},
        )
        started = False
        try:
            with trio.CancelScope(deadline=trio.current_time() + START_TIMEOUT) as starting:
                async with Client(params) as client:
                    listed = await client.list_tools()
                    starting.deadline = math.inf
                    self.registry.set_source(self.name, self._entries(listed.tools))
                    self._client, self._failures, self._broken = client, 0, trio.Event()
                    self._starts += 1
                    started = True
                    log.info("MCP server %s started: %d tools", self.name, len(listed.tools))
                    self.first_start.set()
                    self._notify()
                    await self._broken.wait()
            if starting.cancelled_caught:
                self._failed(f"it did not answer within {START_TIMEOUT:g} s")
        except Exception as e:  # noqa: BLE001 - whatever a server does, report it and go on
            if started:
                log.warning("MCP server %s stopped: %s", self.name, _short(e))
            else:
                self._failed(_short(e))
        finally:
            self._client = None
            self.registry.set_available(self.name, available=False)
            self.first_start.set()
            self._notify()

    def _failed(self, why: str) -> None:
        self._starts += 1
        self._failures += 1
        self._last_error = why
        delay = RESTART.delay(self._failures)
        self._not_before = trio.current_time() + delay
        log.warning(
            "MCP server %s did not start: %s (next try in %.0f s at the earliest)",
            self.name,
            why,
            delay,
        )

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
                    policy=policy_for(self.config, name, self.name),
                )
            )
        return entries

    async def _connected(self) -> Client:
        if self._client is not None:
            return self._client
        wait = self._not_before - trio.current_time()
        if wait > 0:
            raise ToolFailure(
                f"MCP server {self.name} is not running ({self._last_error}); "
                f"the next start is in {wait:.0f} s"
            )
        starts = self._starts
        self._wanted.set()
        while self._client is None and self._starts == starts:
            await self._changed.wait()
        if self._client is None:
            raise ToolFailure(f"MCP server {self.name} did not start: {self._last_error}")
        return self._client

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        """The MCP server's tools work where the server does: a session's own folder (`cwd`)
        does not reach them."""
        client = await self._connected()
        tool = entry.name.removeprefix(f"{self.name}.")
        try:
            result = await client.call_tool(tool, request.arguments)
        except MCPError as e:
            if "closed" in str(e).lower():
                # Down now, for every caller; the supervisor cleans up and restarts on demand.
                self._client = None
                self.registry.set_available(self.name, available=False)
                self._broken.set()
                raise ToolFailure(
                    f"MCP server {self.name} stopped ({e}); it is started again on the next call"
                ) from None
            raise ToolFailure(f"{entry.name}: {e}") from None
        text = "\n".join(_text_of(block) for block in result.content)
        return ToolOutput(text, is_error=result.is_error)


def _text_of(block: Any) -> str:
    if isinstance(block, mcp.types.TextContent):
        return block.text
    kind = getattr(block, "type", "content")
    return f"[{kind} content, not shown]"


def _short(error: BaseException) -> str:
    error = innermost(error)
    return f"{type(error).__name__}: {error}"[:300]
