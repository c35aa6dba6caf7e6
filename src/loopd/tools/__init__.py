"""Tools: the registry behind `find_tool` and `call_tool`, the port that runs calls under
their policy and deadline, the built-in tools, and MCP servers as tool sources."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from loopd.config import ToolsConfig

from ._builtin import Builtins, Roots, builtin_entries
from ._call import answer_call
from ._dispatch import (
    MAX_ARGUMENT_BYTES,
    MAX_DEPTH,
    Dispatch,
    Local,
    Port,
    call_key,
    dispatch,
    find_tool_text,
    requested_tool,
)
from ._entry import ToolEntry
from ._mcp import McpSource
from ._port import (
    APPROVAL_TEXT,
    Denied,
    Executor,
    Failed,
    LocalToolPort,
    PendingApproval,
    PortAnswer,
    Result,
    ToolFailure,
    ToolOutput,
    ToolPort,
    ToolRequest,
    for_the_model,
)
from ._registry import BUILTIN, Registry, policy_for

__all__ = [
    "APPROVAL_TEXT",
    "BUILTIN",
    "MAX_ARGUMENT_BYTES",
    "MAX_DEPTH",
    "Builtins",
    "Denied",
    "Dispatch",
    "Executor",
    "Failed",
    "Local",
    "LocalToolPort",
    "McpSource",
    "PendingApproval",
    "Port",
    "PortAnswer",
    "Registry",
    "Result",
    "Roots",
    "ToolEntry",
    "ToolFailure",
    "ToolOutput",
    "ToolPort",
    "ToolRequest",
    "answer_call",
    "builtin_entries",
    "call_key",
    "dispatch",
    "find_tool_text",
    "for_the_model",
    "open_tool_port",
    "policy_for",
    "requested_tool",
]


@asynccontextmanager
async def open_tool_port(config: ToolsConfig) -> AsyncIterator[LocalToolPort]:
    """The tool port with its built-in tools and MCP servers, supervised until the block ends.

    The MCP servers start side by side, and each has had its first start (or failed it)
    before the port is handed out, so their tools are in the registry from the first turn on.
    """
    registry = Registry(builtin_entries(config))
    executors: dict[str, Executor] = {BUILTIN: Builtins(config.roots, config.timeout)}
    sources = [McpSource(name, server, registry, config) for name, server in config.mcp.items()]
    async with trio.open_nursery() as nursery:
        for source in sources:
            executors[source.name] = source
            nursery.start_soon(source.supervise)
        for source in sources:
            await source.first_start.wait()
        yield LocalToolPort(registry, executors, config.timeout)
        nursery.cancel_scope.cancel()
