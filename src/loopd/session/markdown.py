"""The user's and the project's own Markdown files that loopd reads besides `AGENTS.md`: slash
commands (`.loopd/commands/NAME.md`) and skills (`.loopd/skills/NAME/SKILL.md`), each with an
optional front matter of `key: value` lines between two `---` lines, as Claude Code's commands
and the Agent Skills format write them.

The front matter is read as the simple form those files use (one `key: value` a line, a value
optionally quoted, `>` or `|` folding the indented lines that follow), not as YAML at large: a
line that is none of these is skipped, never an error, since a file that reads oddly should
still be usable by its body.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

__all__ = ["FILE_BYTES", "NAME", "folders_up", "front_matter", "read_head"]

FILE_BYTES = 256 * 1024
"""The most of one such file that is read: a command or a skill longer than this is cut."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""A command's or a skill's name: what follows `/` in a chat, or `skills.` in a tool's name."""

_LINE = re.compile(r"([A-Za-z][A-Za-z0-9_-]*)\s*:\s*(.*)")


def front_matter(text: str) -> tuple[dict[str, str], str]:
    """The `key: value` pairs of `text`'s front matter (keys lowercased), and its body."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, text
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        return {}, text  # no closing line: it is all body
    fields: dict[str, str] = {}
    i = 1
    while i < end:
        match = _LINE.fullmatch(lines[i].strip())
        i += 1
        if match is None or lines[i - 1][:1].isspace():
            continue
        key, value = match.group(1).lower(), match.group(2).strip()
        if value in (">", "|", ">-", "|-"):  # folded or literal: the indented lines below
            block = []
            while i < end and (not lines[i].strip() or lines[i][:1].isspace()):
                block.append(lines[i].strip())
                i += 1
            value = (" " if value.startswith(">") else "\n").join(b for b in block if b)
        elif len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        fields[key] = value
    return fields, "\n".join(lines[end + 1 :]).lstrip("\n")


def read_head(path: Path) -> bytes | None:
    """The first `FILE_BYTES` of a regular file; None where it is none or cannot be read (it
    is opened without waiting: a FIFO would never end a read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(FILE_BYTES) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
        except OSError:
            return None


def folders_up(start: Path, top: Path | None) -> list[Path]:
    """`start` and each folder above it, nearest first, up to `top` (None: the file system's
    root); none where `start` is not under `top`."""
    if top is not None and not start.is_relative_to(top):
        return []
    folders = [start]
    while folders[-1] != (top or folders[-1].parent):
        folders.append(folders[-1].parent)
    return folders
