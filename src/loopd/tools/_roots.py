"""The folders the file tools work in, how a path the model gives resolves in them, and what
inside them the tools never touch: loopd's own files and the user's keys (never reached), and
what is in a `.git` folder (never written: its hooks and config name programs git runs as the
person, outside any sandbox)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePath, PurePosixPath
from typing import BinaryIO

from loopd.session.markdown import folders_up

from ._types import ToolFailure

__all__ = [
    "SNIFF_BYTES",
    "FolderRefused",
    "Roots",
    "folder_of",
    "hideable",
    "write_protected",
]

SNIFF_BYTES = 8192
LOCK_PREFIX = ".#lk"
"""GnuPG's lock files (`.#lk0x...`), which it makes as hard links of its own."""
"""Enough of a file to tell text from binary the way git does: a NUL byte."""


class FolderRefused(Exception):
    """A session's folder that is not one file tools may work in; the message says why."""


class Roots:
    """The folders file tools may read. With one root, paths are relative to it; with several,
    a path starts with the root's folder name."""

    def __init__(
        self, roots: list[Path], private: Sequence[Path] = (), own: Sequence[Path] = ()
    ) -> None:
        self.roots = {r.expanduser().resolve().name: r.expanduser().resolve() for r in roots}
        self.private = tuple(private)
        """What the tools never reach: loopd's own files (`config.private_paths`) and the
        user's keys (`tools.secrets`)."""
        self.own = tuple(own)
        """loopd's own files (`config.private_paths`): with no roots, a session's folder holds
        none of them and is in none of them (`folder`)."""
        self._hidden = hideable(private, list(self.roots.values()))

    def within(self, cwd: Path | None) -> Roots:
        """The roots of a session: its own folder alone, or (None) all of these."""
        return self if cwd is None else Roots([cwd], self.private)

    def folder(self, cwd: str) -> Path:
        """`cwd` as a session's own folder: an absolute path to a folder inside one of these
        roots (or one of them); with no roots, any folder `_own_folder` accepts. Raises
        `FolderRefused`."""
        path = Path(cwd)
        if not path.is_absolute():
            raise FolderRefused(f"{cwd}: a session's folder is an absolute path")
        resolved = path.resolve()
        if not self.roots:
            return self._own_folder(cwd, resolved)
        if not any(resolved.is_relative_to(r) for r in self.roots.values()):
            allowed = ", ".join(str(r) for r in self.roots.values())
            raise FolderRefused(
                f"{cwd} is not inside the folders loopd's tools may use ({allowed}): add it to "
                "[tools] roots"
            )
        if not resolved.is_dir():
            raise FolderRefused(f"{cwd}: no such folder")
        return resolved

    def _own_folder(self, cwd: str, resolved: Path) -> Path:
        """With no `[tools] roots`, the folder a client gives a new session (an editor's
        project) is its one root, as a coding agent's working folder is: any folder but one
        whose whole would open too much, or loopd's own files, or the user's keys."""
        if not resolved.is_dir():
            raise FolderRefused(f"{cwd}: no such folder")
        if resolved == Path(resolved.anchor):
            raise FolderRefused(
                f"{cwd} is the root of the file system: loopd's tools work in a project's "
                "folder, not the whole machine"
            )
        home = Path.home().resolve()
        if resolved == home:
            raise FolderRefused(
                f"{cwd} is your home folder: loopd's tools work in a project's folder, not "
                "all of your files; open a project folder (or set [tools] roots)"
            )
        for given in self.own:
            own = Path(os.path.realpath(given.expanduser()))
            if own == home or own == Path(own.anchor):
                continue
            if resolved.is_relative_to(own) or own.is_relative_to(resolved):
                where = "is inside" if resolved.is_relative_to(own) else "holds"
                raise FolderRefused(
                    f"{cwd} {where} loopd's own files ({own}: its sessions, logs, socket or "
                    "config), which its tools never reach; open a project folder"
                )
        for hidden in self.private:
            secret = Path(os.path.realpath(hidden.expanduser()))
            if secret != home and resolved.is_relative_to(secret):
                raise FolderRefused(
                    f"{cwd} is inside {secret}, which is hidden from loopd's tools (the "
                    "user's keys, [tools.run] deny_read); open a project folder"
                )
        return resolved

    def resolve(self, path: str) -> Path:
        if not self.roots:
            raise ToolFailure(
                "no folders are open to file tools in this session: a session opened in a "
                "folder (an editor's) works there, or set [tools] roots"
            )
        parts = PurePosixPath(path).parts
        if PurePosixPath(path).is_absolute() or path.startswith("~"):
            raise ToolFailure(
                f"{path}: absolute paths are refused; give a path relative to "
                "the root (list_directory '.' shows it)"
            )
        if ".." in parts:
            raise ToolFailure(f"{path}: '..' is refused; paths stay inside the roots")
        if len(self.roots) == 1:
            (root,) = self.roots.values()
            rest = parts
        else:
            if not parts or parts[0] not in self.roots:
                raise ToolFailure(f"{path}: start with one of the roots: {', '.join(self.roots)}")
            root, rest = self.roots[parts[0]], parts[1:]
        try:
            resolved = root.joinpath(*rest).resolve()
        except OSError as e:  # a link removed while it was followed: a race, or a loop
            raise ToolFailure(f"{path}: cannot be resolved ({e.strerror})") from None
        if not resolved.is_relative_to(root):
            raise ToolFailure(f"{path} leads outside the allowed folders")
        if self.hides(resolved):
            raise ToolFailure(
                f"{path} is hidden from the tools (loopd's own files and the user's keys; "
                "[tools.run] deny_read)"
            )
        return resolved

    def up_from(self, cwd: Path | None) -> list[Path]:
        """A session's folder (`cwd`, else the single root; with several and no `cwd`, none)
        and each folder above it up to the root that holds it, never above: nearest first.
        Where a session's own files (`AGENTS.md`, skills) are looked for."""
        tops = list(self.roots.values())
        if cwd is None:
            if len(tops) != 1:
                return []
            cwd = tops[0]
        holding = [r for r in tops if cwd.is_relative_to(r)]
        if not holding:
            return []
        return folders_up(cwd, max(holding, key=lambda r: len(r.parts)))

    def hides(self, path: Path) -> bool:
        """Whether `path` (resolved) is one the tools never reach."""
        return any(path.is_relative_to(hidden) for hidden in self._hidden)

    def open(self, path: Path, shown: str) -> BinaryIO:
        """`path` (resolved, inside a root) open for reading, reached from its root without
        following a link: a link swapped in after the check is refused, never followed to a
        hidden file; a FIFO is never waited on."""
        root = next(r for r in self.roots.values() if path.is_relative_to(r))
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with folder_of(root, path, shown) as folder:
            try:
                fd = os.open(path.name, flags, dir_fd=folder)
            except FileNotFoundError:
                raise ToolFailure(f"{shown}: no such file") from None
            except OSError as e:  # ELOOP: a link now
                raise ToolFailure(f"{shown} cannot be opened ({e.strerror})") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            if stat.S_ISDIR(info.st_mode):
                raise ToolFailure(f"{shown} is a directory; use list_directory")
            raise ToolFailure(f"{shown} is not a regular file")
        return os.fdopen(fd, "rb")

    def tampered(self) -> str | None:
        """Why the hidden paths inside the roots cannot be trusted to stay hidden, or None. A
        command can make one before it exists: a link to a file it can read, or a hard link
        of one, so the key written there later lands where it reads. Found, every tool and
        command is refused until a person removes it."""
        for hidden in self._hidden:
            if not any(hidden.is_relative_to(root) for root in self.roots.values()):
                continue  # outside the roots: commands cannot write there
            for path in _under(hidden):
                try:
                    info = path.lstat()
                except FileNotFoundError:
                    continue
                linked = stat.S_ISREG(info.st_mode) and info.st_nlink > 1
                if linked and path.name.startswith(LOCK_PREFIX):
                    continue  # GnuPG's own lock files are hard links, by design
                if stat.S_ISLNK(info.st_mode) or linked:
                    kind = "a link" if stat.S_ISLNK(info.st_mode) else "a file with another name"
                    return (
                        f"{path} is hidden from the tools, and is {kind}: a command may have "
                        "made it to read what is written there. Remove it (or its other "
                        "name) before the tools run again"
                    )
        return None

    def shown(self, path: Path) -> str:
        for name, root in self.roots.items():
            if path.is_relative_to(root):
                relative = path.relative_to(root).as_posix()
                return relative if len(self.roots) == 1 else f"{name}/{relative}".rstrip("/.")
        return path.name


@contextlib.contextmanager
def folder_of(root: Path, path: Path, shown: str) -> Iterator[int]:
    """A descriptor of `path`'s folder, reached from `root` without following a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        for part in PurePath(path.relative_to(root)).parts[:-1]:
            try:
                inner = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise ToolFailure(f"{shown}: the folder {part}/ does not exist") from None
            except OSError:  # ELOOP, ENOTDIR: a link or a file where a folder was
                raise ToolFailure(
                    f"{shown}: {part} is no longer a folder (a link now?); nothing was written"
                ) from None
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _under(path: Path) -> Iterator[Path]:
    """`path`, and all under it when it is a folder (links not followed)."""
    yield path
    if path.is_dir() and not path.is_symlink():
        for folder, folders, files in os.walk(path):
            yield from (Path(folder) / name for name in (*folders, *files))


def hideable(paths: Sequence[Path], roots: Sequence[Path]) -> list[Path]:
    """`paths` resolved, less the folders that hold a root or the home folder: hiding one of
    those whole would hide the roots, or every dotfile a program reads."""
    kept = [str(k) for k in (*roots, Path.home().resolve())]
    resolved = [Path(os.path.realpath(p.expanduser())) for p in paths]
    return [p for p in resolved if not any(_at_or_in(k, str(p)) for k in kept)]


def _at_or_in(path: str, folder: str) -> bool:
    """As `Path.is_relative_to` for absolute, resolved paths, without parsing them again."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def write_protected(path: PurePath) -> str | None:
    """Why the tools never write `path`, or None: what is in a `.git` folder (hooks and config
    name programs git runs as the person, outside any sandbox; `commondir` moves both)."""
    if ".git" in path.parts[:-1]:
        return "it is in a .git folder, whose hooks and config git runs outside any sandbox"
    return None
