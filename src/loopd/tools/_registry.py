"""The registry: every tool loopd can run, behind the two the model sees.

Entries come from sources: `builtin`, and one per MCP server (its tools named
`<server>.<tool>`). A source's entries are replaced as a whole when it (re)connects, and marked
unavailable while it is down, so `find_tool` can say so instead of offering a dead tool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from loopd.config import Action, Policy, ToolsConfig
from loopd.session.records import Mode

from ._entry import ToolEntry
from ._search import SearchIndex

__all__ = ["ASK_BY_DEFAULT", "BUILTIN", "EDIT_TOOLS", "Registry", "ToolEntry", "policy_for"]

BUILTIN = "builtin"


_STRICTNESS: tuple[Action, ...] = ("allow", "ask", "deny")
ASK_BY_DEFAULT = frozenset({"write_file", "edit_file", "run_command"})
"""Built-in tools that change the world: they ask unless their own policy says otherwise."""
EDIT_TOOLS = frozenset({"write_file", "edit_file"})
"""What a session in mode `accept_edits` runs without asking, where only the default asks."""


def policy_for(config: ToolsConfig, name: str, source: str, mode: Mode = "ask") -> Policy:
    """The policy of a tool: each key from the most specific table that sets it (the tool's
    own, else its source's: `[tools.policies.<source>]`, then an MCP server's `policy`), else
    its default; then made as strict as `[tools] class_actions` asks for its data class.

    The tools in `ASK_BY_DEFAULT` ask unless their own table sets `action`: their source's
    table may make them deny, never allow; a table that sets only a class keeps them asking.
    In `mode` `accept_edits` that default is dropped for the `EDIT_TOOLS`: what a table or
    their data class asks for still holds."""
    own = config.policies.get(name)
    tables = [t for t in (own, config.policies.get(source)) if t is not None]
    if source in config.mcp:
        tables.append(config.mcp[source].policy)

    def first(key: str, *, default: Any) -> Any:
        return next((getattr(t, key) for t in tables if key in t.model_fields_set), default)

    policy = Policy.model_validate(
        {
            "action": first("action", default="allow"),
            "class": first("data_class", default="public"),
            "untrusted": first("untrusted", default=False),
        }
    )
    says_action = own is not None and "action" in own.model_fields_set
    accepted = mode == "accept_edits" and name in EDIT_TOOLS
    if source == BUILTIN and name in ASK_BY_DEFAULT and not says_action and not accepted:
        policy = _at_least(policy, "ask")
    return _at_least(policy, config.class_actions.get(policy.data_class, "allow"))


def _at_least(policy: Policy, least: Action) -> Policy:
    if _STRICTNESS.index(least) > _STRICTNESS.index(policy.action):
        return policy.model_copy(update={"action": least})
    return policy


class Registry:
    def __init__(self, entries: Iterable[ToolEntry] = ()) -> None:
        self._entries = {entry.name: entry for entry in entries}
        self._index: SearchIndex | None = None

    def _changed(self) -> None:
        self._index = None  # rebuilt on the next search

    def search(self, query: str, limit: int) -> list[ToolEntry]:
        if self._index is None:
            self._index = SearchIndex(self.entries())
        return self._index.search(query, limit)

    def get(self, name: str) -> ToolEntry | None:
        return self._entries.get(name)

    def entries(self) -> list[ToolEntry]:
        """All entries, by name."""
        return [self._entries[name] for name in sorted(self._entries)]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def set_source(self, source: str, entries: Iterable[ToolEntry]) -> None:
        """Replace everything a source offers."""
        kept = {n: e for n, e in self._entries.items() if e.source != source}
        kept.update((e.name, e) for e in entries)
        self._entries = kept
        self._changed()

    def set_available(self, source: str, available: bool) -> None:
        self._entries = {
            n: replace(e, available=available) if e.source == source else e
            for n, e in self._entries.items()
        }
        self._changed()
