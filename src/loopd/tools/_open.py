"""The tool port as loopd runs it: the port's actor with the built-in tools and the MCP
servers of `[tools]` as its sources."""

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from loopd.config import ToolsConfig
from loopd.supervise import RESTARTS, Restarts

from ._builtin import Builtins, builtin_entries
from ._mcp import McpSource, start_sources
from ._port import PortHandle, run_tool_port
from ._registry import BUILTIN, Registry
from ._run import process_bound, sandbox_missing
from ._types import Executor

__all__ = ["open_tool_port"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_tool_port(
    config: ToolsConfig, private: Sequence[Path] = (), restarts: Restarts = RESTARTS
) -> AsyncIterator[PortHandle]:
    """The tool-port actor with its built-in tools and MCP servers, supervised until the block
    ends; `private`: loopd's own files, out of the built-in tools' and commands' reach;
    `restarts`: how often the port and each MCP source may fail and start again.

    The MCP servers start side by side, and each has had its first start (or failed it)
    before the port is handed out, so their tools are in the registry from the first turn on.
    """
    registry = Registry(builtin_entries(config))
    builtins = Builtins(
        config.roots, config.timeout, config.run, private=private, fetch=config.fetch
    )
    if config.roots and builtins.sandbox.enabled:
        if why := sandbox_missing():
            log.warning("run_command: %s", why)
        else:
            bound = process_bound(config.run)
            level = logging.WARNING if bound.startswith("NO") else logging.INFO
            log.log(level, "run_command: sandboxed by bubblewrap; %s", bound)
    sources = [
        McpSource(name, server, registry, config, restarts) for name, server in config.mcp.items()
    ]
    executors: dict[str, Executor] = {BUILTIN: builtins, **{s.name: s for s in sources}}
    async with trio.open_nursery() as nursery:
        await start_sources(nursery, sources)
        async with run_tool_port(
            registry,
            executors,
            timeout=config.timeout,
            approval_timeout=config.approval_timeout,
            restarts=restarts,
        ) as port:
            yield port
        nursery.cancel_scope.cancel()
