"""Writing and editing files under the roots, so that nothing the model writes loses a
person's data or lands outside the roots.

A change is planned first (`plan`: the file as it is, as it would be, the diff a person
approves), then made (`commit`): to a temporary file beside it, fsync'd, given the old file's
mode, and renamed over it, so the file is whole, old or new, whatever happens. `commit` refuses
when the file no longer holds what the plan read (a person or a program changed it meanwhile).
Paths resolve as the reading tools' do: nothing outside the roots, no `..`, no link out;
`.git/hooks` and `.git/config` are never written. Binary files and files past `WRITE_BYTES`
are refused, as are contents that are not text.

The file is read and replaced through its folder's descriptor, reached from the root one
folder at a time without following links: a command of the model's that swaps a folder for a
link to elsewhere between the check and the write (a race it can run in the background) ends
the write with an error, and never moves it outside the roots.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopd.canonical import digest
from loopd.wire.events import FileChange

from ._edits import Edit, apply_edits, diff, line_changes
from ._roots import SNIFF_BYTES, Roots, folder_of, write_protected
from ._types import ToolFailure

__all__ = [
    "NEW_FILE",
    "WRITE_BYTES",
    "Planned",
    "commit",
    "digest",
    "folder_of",
    "plan",
    "replace_in",
    "write_atomically",
]

WRITE_BYTES = 4 * 1024 * 1024
"""Files larger than this are not written or edited (before or after)."""
CHANGE_CHARS = 20_000
"""The longest text (before or after) a `FileChange` carries to clients."""
NEW_FILE = "new"
"""The basis of a change planned where no file was (any other basis is a SHA-256)."""


@dataclass(frozen=True)
class Planned:
    """One file's change, as planned: what it holds, what it will hold."""

    path: Path
    root: Path
    """The root `path` is in: the file is reached from it (`folder_of`)."""
    shown: str
    """The path as the model gave it, relative to the roots."""
    old: bytes | None
    """None: the file does not exist yet."""
    new: bytes
    mode: int

    @property
    def basis(self) -> str:
        """What the change was planned on: the file's SHA-256, or `NEW_FILE`. An approved
        change is made only on the basis its preview had."""
        return NEW_FILE if self.old is None else digest(self.old)

    @property
    def diff(self) -> str:
        old = None if self.old is None else self.old.decode()
        return diff(self.shown, old, self.new.decode())

    def change(self) -> FileChange | None:
        """Both texts, for an editor's diff view; None where either is not text or is longer
        than `CHANGE_CHARS` (the unified diff alone is shown then)."""
        try:
            old = None if self.old is None else self.old.decode()
            new = self.new.decode()
        except UnicodeDecodeError:
            return None
        if max(len(old or ""), len(new)) > CHANGE_CHARS:
            return None
        return FileChange(path=str(self.path), old_text=old, new_text=new)

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
    if why := roots.tampered():  # an edit's diff would show what a second name reads
        raise ToolFailure(why)
    path = roots.resolve(shown)
    if why := write_protected(path):
        raise ToolFailure(f"{shown}: not written: {why}")
    root = next(r for r in roots.roots.values() if path.is_relative_to(r))
    with folder_of(root, path, shown) as folder:
        old, mode = _current(folder, path, shown)
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
    return Planned(path, root, shown, old, data, mode)


def _current(folder: int, path: Path, shown: str) -> tuple[bytes | None, int]:
    try:
        fd = os.open(
            path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder
        )
    except FileNotFoundError:
        return None, 0o644
    except IsADirectoryError:
        raise ToolFailure(f"{shown} is a directory") from None
    except OSError:  # ELOOP: a link
        raise ToolFailure(f"{shown} is not a regular file") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ToolFailure(f"{shown} is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise ToolFailure(f"{shown} is not a regular file")
        if info.st_size > WRITE_BYTES:
            raise ToolFailure(
                f"{shown}: {info.st_size} bytes is more than loopd edits ({WRITE_BYTES})"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    if b"\0" in data[:SNIFF_BYTES]:
        raise ToolFailure(f"{shown} is a binary file; loopd writes text files only")
    try:
        data.decode()
    except UnicodeDecodeError:
        raise ToolFailure(f"{shown} is not UTF-8 text; loopd writes text files only") from None
    return data, stat.S_IMODE(info.st_mode)


def commit(planned: Planned) -> None:
    """Make the change, unless the file changed since it was planned."""
    with folder_of(planned.root, planned.path, planned.shown) as folder:
        now, _ = _current(folder, planned.path, planned.shown)
        if now != planned.old:
            raise ToolFailure(
                f"{planned.shown} changed since this call was planned (while it waited for "
                "approval?); nothing was written: read it again"
            )
        replace_in(folder, planned.path.name, planned.new, planned.mode)


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """`data` in `path`, whole or not at all (in a folder of loopd's own: no walk)."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        replace_in(folder, path.name, data, mode)
    finally:
        os.close(folder)


def replace_in(folder: int, name: str, data: bytes, mode: int) -> None:
    """`data` as `name` in the folder open as `folder`, whole or not at all: a temporary file
    beside it, fsync'd, renamed over it, the folder fsync'd."""
    staging = f".{name}.loopd-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(staging, flags, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.rename(staging, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging, dir_fd=folder)
        raise
    os.fsync(folder)
