"""Tools: the registry behind `find_tool` and `call_tool`, the port that runs calls under
their policy and deadline, the built-in tools, and MCP servers as tool sources."""

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from loopd.config import ToolsConfig
from loopd.supervise import RESTARTS, Restarts

from ._builtin import (
    DELEGATE,
    PLAN,
    WRITE_TOOLS,
    Builtins,
    builtin_entries,
    checked_plan,
    delegate_entry,
)
from ._call import CallerTool, CallOrigin, ModelAnswer, answer_call
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
from ._given import given_tools
from ._mcp import McpSource, start_sources
from ._mcp_connect import missing_tokens, reached_at, token_missing
from ._port import (
    Answered,
    Approval,
    Asking,
    Denied,
    Executor,
    Failed,
    OnAsking,
    OnDecided,
    OnOutput,
    PortAnswer,
    PortHandle,
    PortStopped,
    Preview,
    Result,
    Runner,
    ToolFailure,
    ToolOutput,
    ToolPort,
    ToolRequest,
    for_the_model,
    read_only_refusal,
    run_tool_port,
)
from ._registry import BUILTIN, Registry, policy_for
from ._roots import FolderRefused, Roots
from ._run import Sandbox, process_bound, sandbox_missing
from ._sandbox import secrets
from ._skills import SKILLS, SkillReader
from ._write import (
    NEW_FILE,
    Planned,
    commit,
    digest,
    folder_of,
    plan,
    replace_in,
    write_atomically,
)

log = logging.getLogger(__name__)

__all__ = [
    "BUILTIN",
    "DELEGATE",
    "MAX_ARGUMENT_BYTES",
    "MAX_DEPTH",
    "NEW_FILE",
    "PLAN",
    "SKILLS",
    "WRITE_TOOLS",
    "Answered",
    "Approval",
    "Asking",
    "Builtins",
    "CallOrigin",
    "CallerTool",
    "Denied",
    "Dispatch",
    "Executor",
    "Failed",
    "FolderRefused",
    "Local",
    "McpSource",
    "ModelAnswer",
    "OnAsking",
    "OnDecided",
    "OnOutput",
    "Planned",
    "Port",
    "PortAnswer",
    "PortHandle",
    "PortStopped",
    "Preview",
    "Registry",
    "Result",
    "Roots",
    "Runner",
    "Sandbox",
    "SkillReader",
    "ToolEntry",
    "ToolFailure",
    "ToolOutput",
    "ToolPort",
    "ToolRequest",
    "answer_call",
    "builtin_entries",
    "call_key",
    "checked_plan",
    "commit",
    "delegate_entry",
    "digest",
    "dispatch",
    "find_tool_text",
    "folder_of",
    "for_the_model",
    "given_tools",
    "missing_tokens",
    "open_tool_port",
    "plan",
    "policy_for",
    "process_bound",
    "reached_at",
    "read_only_refusal",
    "replace_in",
    "requested_tool",
    "run_tool_port",
    "sandbox_missing",
    "secrets",
    "token_missing",
    "write_atomically",
]


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
