"""Writing and editing files under the roots, so that nothing the model writes loses a
person's data.

A change is planned first (`plan`: the file as it is, as it would be, the diff a person
approves), then made (`commit`): to a temporary file beside it, fsync'd, given the old file's
mode, and renamed over it, so the file is whole, old or new, whatever happens. `commit` refuses
when the file no longer holds what the plan read (a person or a program changed it meanwhile).
Paths resolve as the reading tools' do: nothing outside the roots, no `..`, no link out.
Binary files and files past `WRITE_BYTES` are refused, as are contents that are not text.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._edits import Edit, apply_edits, diff, line_changes
from ._port import ToolFailure
from ._roots import SNIFF_BYTES, Roots

__all__ = ["WRITE_BYTES", "Planned", "commit", "digest", "plan", "write_atomically"]

WRITE_BYTES = 4 * 1024 * 1024
"""Files larger than this are not written or edited (before or after)."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Planned:
    """One file's change, as planned: what it holds, what it will hold."""

    path: Path
    shown: str
    """The path as the model gave it, relative to the roots."""
    old: bytes | None
    """None: the file does not exist yet."""
    new: bytes
    mode: int

    @property
    def diff(self) -> str:
        old = None if self.old is None else self.old.decode()
        return diff(self.shown, old, self.new.decode())

    def summary(self) -> str:
        """What the model reads once it is done."""
        added, removed = line_changes(self.diff)
        if self.old is None:
            return f"Created {self.shown}: {added} lines."
        if self.old == self.new:
            return f"{self.shown} already held this text; nothing changed."
        return f"Changed {self.shown}: +{added} -{removed} lines."


def plan(roots: Roots, tool: str, arguments: dict[str, Any]) -> Planned:
    """The change `write_file` or `edit_file` would make; a `ToolFailure` saying why not."""
    shown = arguments["path"]
    path = roots.resolve(shown)
    old, mode = _current(path, shown)
    if tool == "write_file":
        new = arguments["content"]
    else:
        if old is None:
            raise ToolFailure(f"{shown}: no such file; write_file creates one")
        edits = [Edit(e["old_text"], e["new_text"]) for e in arguments["edits"]]
        new = apply_edits(shown, old.decode(), edits)
    data = new.encode()
    if len(data) > WRITE_BYTES:
        raise ToolFailure(f"{shown}: {len(data)} bytes is more than loopd writes ({WRITE_BYTES})")
    if "\0" in new:
        raise ToolFailure(f"{shown}: the content holds a NUL byte; only text is written")
    return Planned(path, shown, old, data, mode)


def _current(path: Path, shown: str) -> tuple[bytes | None, int]:
    try:
        info = path.lstat()
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise ToolFailure(f"{shown}: the folder {path.parent.name}/ does not exist") from None
        return None, 0o644
    if stat.S_ISDIR(info.st_mode):
        raise ToolFailure(f"{shown} is a directory")
    if not stat.S_ISREG(info.st_mode):
        raise ToolFailure(f"{shown} is not a regular file")
    if info.st_size > WRITE_BYTES:
        raise ToolFailure(f"{shown}: {info.st_size} bytes is more than loopd edits ({WRITE_BYTES})")
    data = path.read_bytes()
    if b"\0" in data[:SNIFF_BYTES]:
        raise ToolFailure(f"{shown} is a binary file; loopd writes text files only")
    try:
        data.decode()
    except UnicodeDecodeError:
        raise ToolFailure(f"{shown} is not UTF-8 text; loopd writes text files only") from None
    return data, stat.S_IMODE(info.st_mode)


def commit(planned: Planned) -> None:
    """Make the change, unless the file changed since it was planned."""
    now, _ = _current(planned.path, planned.shown)
    if now != planned.old:
        raise ToolFailure(
            f"{planned.shown} changed since this call was planned (while it waited for "
            "approval?); nothing was written: read it again"
        )
    write_atomically(planned.path, planned.new, planned.mode)


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """`data` in `path`, whole or not at all: a temporary file beside it, fsync'd, renamed."""
    staging = path.with_name(f".{path.name}.loopd-{secrets.token_hex(4)}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        staging.rename(path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
