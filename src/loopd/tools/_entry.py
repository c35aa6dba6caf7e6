"""One tool in the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loopd.config import Policy
from loopd.session.records import Mode

__all__ = ["ToolEntry"]


@dataclass(frozen=True)
class ToolEntry:
    name: str
    """The name the model passes to `call_tool`."""
    summary: str
    """One line: what it does."""
    description: str
    """The full description (often the same as the summary)."""
    schema: dict[str, Any]
    """JSON schema of the arguments object."""
    source: str
    """`builtin`, or the MCP server's name."""
    policy: Policy
    available: bool = True
    timeout: float | None = None
    """Seconds a call may take, when not `[tools] timeout` (a command's own bound)."""
    accepting: Policy | None = None
    """Its policy in a session whose mode is `accept_edits`; None: as `policy`."""

    def policy_in(self, mode: Mode) -> Policy:
        """Its policy in a session of mode `mode` (`read_only` is the port's to apply)."""
        if mode == "accept_edits" and self.accepting is not None:
            return self.accepting
        return self.policy
