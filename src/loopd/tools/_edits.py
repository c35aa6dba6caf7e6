"""What a write or an edit would make of a file, and the diff a person approves: pure text,
no I/O.

An edit replaces one exact piece of text with another. The piece must occur exactly once:
not found, the error shows where the text almost matched (the closest lines, by difflib), so
the model can correct itself; found more than once, it names the lines, so the model can give
more context.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from ._types import ToolFailure

__all__ = ["Edit", "apply_edits", "diff", "line_changes"]

NEAR_LINES = 3
"""Lines of the closest match shown when an edit's text is not found."""


@dataclass(frozen=True)
class Edit:
    old: str
    new: str


def apply_edits(path: str, text: str, edits: Sequence[Edit]) -> str:
    """The text after each edit in turn; a `ToolFailure` naming the first that cannot apply
    (nothing is applied then)."""
    for number, edit in enumerate(edits, start=1):
        which = f"edit {number} of {len(edits)}" if len(edits) > 1 else "the edit"
        if not edit.old:
            raise ToolFailure(f"{path}: {which} has an empty old_text; give the text to replace")
        count = text.count(edit.old)
        if count == 0:
            raise ToolFailure(
                f"{path}: {which}: old_text is not in the file. {_nearest(text, edit.old)}"
            )
        if count > 1:
            lines = _lines_of(text, edit.old)
            raise ToolFailure(
                f"{path}: {which}: old_text occurs {count} times (at lines "
                f"{', '.join(map(str, lines))}); include more of the text around it so it is "
                "unique"
            )
        text = text.replace(edit.old, edit.new, 1)
    return text


def _lines_of(text: str, piece: str) -> list[int]:
    lines, start = [], 0
    while (found := text.find(piece, start)) >= 0:
        lines.append(text.count("\n", 0, found) + 1)
        start = found + 1
    return lines


def _nearest(text: str, piece: str) -> str:
    """Where the file comes closest to `piece`: the lines it most looks like."""
    lines = text.splitlines()
    wanted = piece.splitlines() or [piece]
    width = len(wanted)
    best, best_at = 0.0, -1
    for start in range(max(1, len(lines) - width + 1)):
        window = "\n".join(lines[start : start + width])
        ratio = difflib.SequenceMatcher(None, window, piece, autojunk=False).quick_ratio()
        if ratio > best:
            ratio = difflib.SequenceMatcher(None, window, piece, autojunk=False).ratio()
            if ratio > best:
                best, best_at = ratio, start
    if best_at < 0 or best < 0.5:
        return "Nothing in it comes close; read the file again."
    shown = "\n".join(lines[best_at : best_at + min(width, NEAR_LINES)])
    return f"The closest text, at line {best_at + 1} ({best:.0%} alike):\n{shown}"


def diff(path: str, old: str | None, new: str) -> str:
    """A unified diff of the file as it is (None: it does not exist) against as it would be."""
    before = (old or "").splitlines(keepends=True)
    after = new.splitlines(keepends=True)
    lines = difflib.unified_diff(
        before, after, "/dev/null" if old is None else f"a/{path}", f"b/{path}"
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def line_changes(unified: str) -> tuple[int, int]:
    """Lines added and removed, counted from a unified diff."""
    added = removed = 0
    for line in unified.splitlines():
        if line.startswith("+") and not line.startswith("+++ "):
            added += 1
        elif line.startswith("-") and not line.startswith("--- "):
            removed += 1
    return added, removed
