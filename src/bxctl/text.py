"""The plain lines bxctl prints, shared by its commands and the live chat: no rich here, so
the one-shot commands (`bxctl.oneshot`) print them without loading it."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from loopd.wire.events import ApprovalNeeded

__all__ = [
    "approve_command",
    "as_tree",
    "context_line",
    "fit",
    "fork_line",
    "recent_tree",
    "session_line",
    "session_lines",
    "title_of",
    "turn_lines",
    "turns_text",
    "unreadable_line",
]


def turns_text(turns: int) -> str:
    """`1 turn`, `2 turns`."""
    return f"{turns} turn{'' if turns == 1 else 's'}"


def session_line(
    s: _Listed, current: str | None, *, depth: int = 0, title: str | None = None, width: int = 80
) -> str:
    """One session in a list, in `width` columns: its id, turns, last activity, and its title
    (`title`, else its own: the first user message), cut with an ellipsis where the line
    would not fit. The one loopd serves is starred; one that continues another (a compaction)
    names it; a fork says at which turn of the session it forks, named unless it is drawn
    under it; a sub-agent's or a fork is drawn `depth` levels under the session it works for
    or forks."""
    mark = "*" if s.id == current else " "
    name = f"{'   ' * (depth - 1)}└─ {s.id}" if depth else s.id
    turns = f"{s.turns:4d} turn{' ' if s.turns == 1 else 's'}"
    parts = [f"{mark} {name}", turns, s.last_activity[:16].replace("T", " ")]
    if s.continues:
        parts.append(f"continues {s.continues}")
    if s.forked_from:
        under = depth > 0 and s.parent is None  # drawn under the session it forks
        parts.append(f"fork {'' if under else f'of {s.forked_from} '}at turn {s.at}")
    if title := title or s.title:
        parts.append(_printable(title))
    return fit("  ".join(parts), width)


def session_lines(sessions: Sequence[L], current: str | None, width: int) -> list[tuple[L, str]]:
    """The sessions as a list shows them (`recent_tree`), each with its line in `width`
    columns; a session that continues another and has no message of its own yet has the
    title of the conversation it goes on with."""
    by_id = {s.id: s for s in sessions}
    return [
        (s, session_line(s, current, depth=depth, title=title_of(s, by_id), width=width))
        for depth, s in recent_tree(sessions)
    ]


def title_of(session: L, by_id: dict[str, L]) -> str | None:
    """The title of the session a chain of compactions began with (else the nearest one's)."""
    title, seen = session.title, {session.id}
    while (
        session.continues and (earlier := by_id.get(session.continues)) and earlier.id not in seen
    ):
        seen.add(earlier.id)
        session, title = earlier, earlier.title or title
    return title


def fit(line: str, width: int) -> str:
    """`line`, cut with an ellipsis where it takes more than `width` columns of a terminal (a
    wide character takes two)."""
    if _columns(line) <= width:
        return line
    kept, used = [], 0
    for char in line:
        used += _columns(char)
        if used > width - 1:
            break
        kept.append(char)
    return "".join(kept).rstrip() + "…"


def _columns(text: str) -> int:
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def _printable(text: str) -> str:
    """`text` with its control characters (a tab, a terminal's escape) as spaces: a title is
    the user's text, printed on their terminal."""
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)


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
    @property
    def title(self) -> str | None: ...


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


def recent_tree(sessions: Sequence[L]) -> list[tuple[int, L]]:
    """The sessions as lists show them: the tree of `as_tree`, each session at the top with
    all that is drawn under it, the most recent first (by the latest activity in its tree:
    work in a fork brings up the session it forks)."""
    blocks: list[list[tuple[int, L]]] = []
    for depth, s in as_tree(sessions):
        if depth == 0:
            blocks.append([])
        blocks[-1].append((depth, s))
    blocks.sort(key=lambda block: max(_recency(s) for _, s in block), reverse=True)
    return [drawn for block in blocks for drawn in block]


def _recency(s: _Listed) -> tuple[datetime, str]:
    return datetime.fromisoformat(s.last_activity), s.id


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
