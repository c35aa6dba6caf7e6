"""The registry: every tool loopd can run, behind the two the model sees.

Entries come from sources: `builtin`, and one per MCP server (its tools named
`<server>.<tool>`). A source's entries are replaced as a whole when it (re)connects, and marked
unavailable while it is down, so `find_tool` can say so instead of offering a dead tool.

A session given MCP servers of its own (an editor's) sees a registry of their tools laid over
loopd's (`base`): what the base offers, and theirs; no other session sees them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from loopd.config import Action, Policy, ToolsConfig
from loopd.session.records import Mode

from ._search import SearchIndex
from ._types import ToolEntry

__all__ = ["ASK_BY_DEFAULT", "BUILTIN", "EDIT_TOOLS", "Registry", "ToolEntry", "policy_for"]

BUILTIN = "builtin"


_STRICTNESS: tuple[Action, ...] = ("allow", "ask", "deny")
ASK_BY_DEFAULT = frozenset({"write_file", "edit_file", "run_command", "fetch_url"})
"""Built-in tools that change the world or reach out of the machine: they ask unless their own
policy says otherwise (`fetch_url` runs unasked for the domains `[tools.fetch] allow` names)."""
UNTRUSTED = frozenset({"fetch_url"})
"""Built-in tools whose results come from outside, whatever a table says: always untrusted."""
EDIT_TOOLS = frozenset({"write_file", "edit_file"})
"""What a session in mode `accept_edits` runs without asking, where only the default asks."""


def read_only_refuses(entry: ToolEntry) -> bool:
    """Whether a session in mode `read_only` refuses a call to `entry` without asking: the
    built-in tools that change the world, and any tool whose policy would ask."""
    changes = entry.source == BUILTIN and entry.name in ASK_BY_DEFAULT
    return changes or entry.policy_in("read_only").action == "ask"


def policy_for(
    config: ToolsConfig,
    name: str,
    source: str,
    server: Policy | None = None,
    mode: Mode = "ask",
) -> Policy:
    """The policy of a tool: each key from the most specific table that sets it (the tool's
    own, else its source's: `[tools.policies.<source>]`, then its MCP server's `policy`:
    `server`, or `[tools.mcp.<source>] policy`), else its default; then made as strict as
    `[tools] class_actions` asks for its data class. The default action of an MCP server's
    tools is `ask`, as in other agents: a server's tool runs unasked only where the config
    says so. Other tools' default is `allow`.

    The results of the tools in `UNTRUSTED` are untrusted whatever a table says. The tools
    in `ASK_BY_DEFAULT` ask unless their own table sets `action`: their source's
    table may make them deny, never allow; a table that sets only a class keeps them asking.
    In `mode` `accept_edits` that default is dropped for the `EDIT_TOOLS`: what a table or
    their data class asks for still holds."""
    own = config.policies.get(name)
    tables = [t for t in (own, config.policies.get(source)) if t is not None]
    if server is None and source in config.mcp:
        server = config.mcp[source].policy
    if server is not None:
        tables.append(server)

    def first(key: str, *, default: Any) -> Any:
        return next((getattr(t, key) for t in tables if key in t.model_fields_set), default)

    policy = Policy.model_validate(
        {
            "action": first("action", default="allow" if server is None else "ask"),
            "class": first("data_class", default="public"),
            "untrusted": first("untrusted", default=False),
        }
    )
    says_action = own is not None and "action" in own.model_fields_set
    accepted = mode == "accept_edits" and name in EDIT_TOOLS
    if source == BUILTIN and name in ASK_BY_DEFAULT and not says_action and not accepted:
        policy = _at_least(policy, "ask")
    if source == BUILTIN and name in UNTRUSTED:
        policy = policy.model_copy(update={"untrusted": True})
    return _at_least(policy, config.class_actions.get(policy.data_class, "allow"))


def _at_least(policy: Policy, least: Action) -> Policy:
    if _STRICTNESS.index(least) > _STRICTNESS.index(policy.action):
        return policy.model_copy(update={"action": least})
    return policy


class Registry:
    def __init__(self, entries: Iterable[ToolEntry] = (), base: Registry | None = None) -> None:
        self._entries = {entry.name: entry for entry in entries}
        self._base = base
        """What this registry offers besides its own entries (which never shadow the base's)."""
        self._changes = 0
        self._index: tuple[tuple[int, ...], SearchIndex] | None = None
        """The search index, and the changes it was built after."""

    def version(self) -> tuple[int, ...]:
        """Changes so far, here and in the base: an index is stale once they differ."""
        return (self._changes, *(self._base.version() if self._base else ()))

    def search(self, query: str, limit: int) -> list[ToolEntry]:
        version = self.version()
        if self._index is None or self._index[0] != version:
            self._index = (version, SearchIndex(self.entries()))
        return self._index[1].search(query, limit)

    def get(self, name: str) -> ToolEntry | None:
        found = self._base.get(name) if self._base else None
        return found or self._entries.get(name)

    def _all(self) -> dict[str, ToolEntry]:
        shared = self._base.entries() if self._base else []
        return {**self._entries, **{entry.name: entry for entry in shared}}

    def entries(self) -> list[ToolEntry]:
        """All entries, by name."""
        every = self._all()
        return [every[name] for name in sorted(every)]

    def names(self) -> list[str]:
        return sorted(self._all())

    def sources(self) -> set[str]:
        """The sources that offer entries here now (the base's too)."""
        return {entry.source for entry in self._all().values()}

    def set_source(self, source: str, entries: Iterable[ToolEntry]) -> None:
        """Replace everything a source offers."""
        kept = {n: e for n, e in self._entries.items() if e.source != source}
        kept.update((e.name, e) for e in entries)
        self._entries = kept
        self._changes += 1

    def set_available(self, source: str, available: bool) -> None:
        self._entries = {
            n: replace(e, available=available) if e.source == source else e
            for n, e in self._entries.items()
        }
        self._changes += 1
