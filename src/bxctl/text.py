"""The plain lines bxctl prints, shared by its commands and the live chat: no rich here, so
the one-shot commands (`bxctl.oneshot`) print them without loading it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from loopd.wire.events import ApprovalNeeded

__all__ = [
    "approve_command",
    "as_tree",
    "context_line",
    "fork_line",
    "session_line",
    "turn_lines",
    "unreadable_line",
]


def session_line(s: _Listed, current: str | None, *, depth: int = 0) -> str:
    """One session in a list; the one loopd serves is starred, one that continues another (a
    compaction) names it, a fork names the session and turn it was forked at (a `/fork` or a
    `/rewind`), and a sub-agent's or a fork is drawn `depth` levels under the session it works
    for or forks."""
    mark = "*" if s.id == current else " "
    name = f"{'   ' * (depth - 1)}└─ {s.id}" if depth else s.id
    line = f"{mark} {name}  {s.turns:4d} turns  last {s.last_activity[:16].replace('T', ' ')}"
    if s.continues:
        line += f"  continues {s.continues}"
    if s.forked_from:
        line += f"  fork of {s.forked_from} at turn {s.at}"
    return line


def fork_line(fork: str, parent: str, at: int | None) -> str:
    """What bxctl says once it goes on in a fork (a `fork` or a `rewind`)."""
    turn = f"turn {at}" if at is not None else "its latest turn"
    return f"session {fork}: the fork of session {parent} at {turn}"


def turn_lines(messages: Sequence[str]) -> list[str]:
    """A session's turns, numbered from 1 as `/rewind N` and `/fork N` take them, each with its
    message's first line (at most 70 characters)."""
    firsts = ((m.strip().splitlines() or [""])[0] for m in messages)
    return [f"{n:3d}. {f[:69] + '…' if len(f) > 70 else f}" for n, f in enumerate(firsts, 1)]


def unreadable_line(session_id: str, reason: str) -> str:
    """A log in the store that does not read, in a list of sessions, and why."""
    return f"! {session_id}  does not read: {reason}"


class _Listed(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def parent(self) -> str | None: ...
    @property
    def turns(self) -> int: ...
    @property
    def last_activity(self) -> str: ...
    @property
    def continues(self) -> str | None: ...
    @property
    def forked_from(self) -> str | None: ...
    @property
    def at(self) -> int | None: ...


L = TypeVar("L", bound=_Listed)


def as_tree(sessions: Sequence[L], *, newest_first: bool = False) -> list[tuple[int, L]]:
    """The sessions with their depth, each sub-agent's under the session that started it and
    each fork under the session it forks (oldest first there: a fork of a fork under its
    fork); the top sessions in order, or newest first."""
    ids = {s.id for s in sessions}
    children: dict[str, list[L]] = {}
    for s in sessions:
        if (above := _above(s)) in ids:
            children.setdefault(above, []).append(s)
    tops = [s for s in sessions if _above(s) not in ids]
    tree: list[tuple[int, L]] = []
    stack = [(0, s) for s in (tops if newest_first else reversed(tops))]
    while stack:
        depth, s = stack.pop()
        tree.append((depth, s))
        stack += [(depth + 1, c) for c in reversed(children.get(s.id, []))]
    return tree


def _above(s: _Listed) -> str | None:
    """The session `s` is drawn under: the one it works for (a sub-agent's), or it forks."""
    return s.parent or s.forked_from


def approve_command(asking: ApprovalNeeded, session: str | None) -> str:
    """The `bxctl approve` line that answers a call waiting for approval."""
    command = f"bxctl approve {asking.call} --once|--session|--deny --in {session}"
    return f"{command} --sub-agent {asking.session}" if asking.session else command


def context_line(context: int, past_reasoning: int | None, window: int | None = None) -> str:
    """How full the slot is, against its context `window` where the server said it, and how
    much of it is past reasoning (a cost a user can cut with `/think off` or `[loop] thinking =
    false`)."""
    held = f"{context} tokens in the slot"
    if window:
        held = f"{context} of {window} tokens in the slot ({context / window:.0%})"
    if past_reasoning is None:
        return f"{held} (history sent as messages)"
    share = past_reasoning / context if context else 0.0
    return f"{held}, {past_reasoning} of them past reasoning ({share:.0%})"
