"""Reading a new session's `AGENTS.md` files (`loopd.session.instructions` says what becomes
of them).

The project's: the `AGENTS.md` of each folder from the session's own folder (its `cwd`, else
the single root of `[tools] roots`; with several roots and no `cwd`, none) up to the root that
holds it, never above: what the file tools may not read, loopd does not read for them either.
A file the tools never reach (loopd's own files, the user's keys, `[tools.run] deny_read`), a
link that leads out of the root, or anything but a regular file is skipped unread. The user's
own: `AGENTS.md` in loopd's config folder (`$XDG_CONFIG_HOME/loopd`), unless it is a link to one
of the user's keys.

The prompt takes `[session] instructions_bytes` of them in all, given out nearest first (the
session's folder's file, then each folder above it, the user's own last); a file past that is
cut, and the prompt says where.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from loopd.session.instructions import FILE_NAME, InstructionFile, Read
from loopd.tools import Roots, ToolFailure

__all__ = ["InstructionReader"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 16


@dataclass(frozen=True)
class InstructionReader:
    roots: Roots
    """`[tools] roots`, hiding what the tools never reach."""
    user: Path | None
    """The user's own `AGENTS.md` (it may not exist)."""
    keys: Roots
    """No roots; hides the user's keys: the user's own file is never one of them."""
    limit: int
    """`[session] instructions_bytes`: 0 reads none."""

    def read(self, cwd: Path | None) -> Read:
        """The files for a new session in folder `cwd` (None: its roots), in the prompt's
        order: the user's own, then the project's from its root down."""
        if self.limit == 0:
            return Read((), self.limit)
        found = [  # nearest first
            got
            for folder in self.roots.up_from(cwd)
            if (got := self._project_file(folder / FILE_NAME)) is not None
        ]
        user = self._user_file(self.user) if self.user is not None else None
        if user is not None and all(user[0] != path for path, *_ in found):
            found.append(user)
        left = self.limit
        files: list[tuple[InstructionFile, str]] = []
        for path, head, digest, size in found:
            kept = _boundary(head, min(len(head), left))
            left -= kept
            text = head[:kept].decode("utf-8", "replace")
            file = InstructionFile(path=str(path), sha256=digest, size=size, kept=kept)
            files.append((file, text))
        files.reverse()
        if files:
            log.info("AGENTS.md files for a new session: %s", ", ".join(f.path for f, _ in files))
        return Read(tuple(files), self.limit)

    def _project_file(self, path: Path) -> tuple[Path, bytes, str, int] | None:
        if not os.path.lexists(path):
            return None
        try:
            resolved = path.resolve()
        except OSError:
            return None
        if not any(resolved.is_relative_to(r) for r in self.roots.roots.values()):
            log.info("%s leads outside [tools] roots: not read", path)
            return None
        if self.roots.hides(resolved):
            log.info("%s is hidden from the tools: not read", path)
            return None
        try:
            with self.roots.open(resolved, str(path)) as f:
                return (path, *self._take(f.fileno()))
        except (ToolFailure, OSError) as e:
            log.warning("%s: not read: %s", path, e)
            return None

    def _user_file(self, path: Path) -> tuple[Path, bytes, str, int] | None:
        try:
            resolved = path.resolve()
            if not resolved.exists() or self.keys.hides(resolved):
                return None
            fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return (path, *self._take(fd))
        except OSError as e:
            log.warning("%s: not read: %s", path, e)
            return None
        finally:
            os.close(fd)

    def _take(self, fd: int) -> tuple[bytes, str, int]:
        """The first `limit` bytes (and the next, to cut between characters), the SHA-256 of
        the whole file, and its size."""
        digest, head, size, most = hashlib.sha256(), bytearray(), 0, self.limit + 1
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if len(head) < most:
                head += chunk[: most - len(head)]
        return bytes(head), digest.hexdigest(), size


def _boundary(data: bytes, at: int) -> int:
    """`at`, moved back to the start of a UTF-8 character where it falls inside one."""
    while 0 < at < len(data) and data[at] & 0xC0 == 0x80:
        at -= 1
    return at
