"""MCP servers a client gives one session (an editor's `mcpServers`), over stdio or at a URL.

Each runs as a `[tools] mcp` server does, an `McpSource` under the same supervision, but for
that session alone: its tools go to a registry laid over loopd's, which only that session's
port handle (`PortHandle.scoped`) decides and runs calls on, so another session's `find_tool`
never lists them and its `call_tool` cannot reach them. The model still sees only `find_tool`
and `call_tool`: its prompt's prefix is the same whatever a session was given.

A server whose name is taken (by a `[tools] mcp` server, a source of loopd's own such as
`builtin`, or an earlier server of the same list) is refused, not started: tool names stay
unique, and the user's configured server keeps its name. Its tools' policy is what
`[tools] policies` says for the tool or the server's name, else `ask`: the user's config does
not know the server.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from loopd.config import McpServer, Policy, ToolsConfig
from loopd.groups import innermost
from loopd.session.records import GivenServer
from loopd.supervise import RESTARTS, Restarts
from loopd.wire import proto

from ._mcp import McpSource, start_sources
from ._port import PortHandle
from ._registry import Registry
from ._skills import SKILLS, SkillReader, Skills
from ._types import Executor

__all__ = ["GIVEN_POLICY", "given_tools"]

log = logging.getLogger(__name__)

GIVEN_POLICY = Policy(action="ask")
"""The policy of a given server's tools where `[tools] policies` says nothing of them."""


@asynccontextmanager
async def given_tools(  # noqa: PLR0913 - what one session's tools are made of
    port: PortHandle,
    config: ToolsConfig,
    servers: Sequence[proto.McpServer],
    cwd: Path | None = None,
    *,
    restarts: Restarts = RESTARTS,
    skills: SkillReader | None = None,
) -> AsyncIterator[tuple[PortHandle, tuple[GivenServer, ...]]]:
    """The port as a session given `servers` sees it, those servers running (each has had its
    first start, or failed it) until the block ends, when they stop; and what became of each,
    for the session's log. With `skills`, the skills of a session working in `cwd` are its
    tools too (`_skills`)."""
    registry = Registry(base=port.registry)
    executors: dict[str, Executor] = {}
    if skills is not None and SKILLS in port.registry.sources():
        log.warning("an MCP server is named %s: the skills' tools are left out", SKILLS)
    elif skills is not None:
        found = Skills(skills, await trio.to_thread.run_sync(skills.find, cwd), config)
        registry.set_source(SKILLS, found.entries())
        executors[SKILLS] = found
    sources: list[McpSource] = []
    given: list[GivenServer] = []
    for server in servers:
        refused = _refusal(server.name, config, port.registry, [s.name for s in sources])
        command = tuple(server.command or ())
        given.append(
            GivenServer(name=server.name, command=command, url=server.url, refused=refused)
        )
        if refused is not None:
            log.warning("MCP server %s given by a client is not started: %s", server.name, refused)
            continue
        sources.append(McpSource(server.name, _spec(server), registry, config, restarts))
    try:
        async with trio.open_nursery() as nursery:
            await start_sources(nursery, sources)
            executors.update({s.name: s for s in sources})
            yield port.scoped(registry, executors), tuple(given)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The sources' supervisors raise nothing of their own: the block's error (a session
        # that failed) goes on as it came, not in the nursery's group.
        raise innermost(group) from None


def _spec(server: proto.McpServer) -> McpServer:
    if server.url is not None:
        return McpServer(
            url=server.url, transport=server.transport, headers=server.headers, policy=GIVEN_POLICY
        )
    return McpServer(command=server.command, env=server.env, policy=GIVEN_POLICY)


def _refusal(name: str, config: ToolsConfig, shared: Registry, earlier: list[str]) -> str | None:
    if name in config.mcp:
        return f"[tools] mcp has a server named {name}"
    if name in shared.sources():
        return f"loopd's own tools come from a source named {name}"
    if name == SKILLS:
        return f"loopd's skills are the tools of a source named {SKILLS}"
    if name in earlier:
        return f"an earlier server of the same list is named {name}"
    return None
