"""The folders the file tools work in, how a path the model gives resolves in them, and what
inside them the tools never touch: loopd's own files and the user's keys (never reached), and
what is in a `.git` folder (never written: its hooks and config name programs git runs as the
person, outside any sandbox)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePath, PurePosixPath

from ._port import ToolFailure

__all__ = ["SNIFF_BYTES", "FolderRefused", "Roots", "hideable", "write_protected"]

SNIFF_BYTES = 8192
"""Enough of a file to tell text from binary the way git does: a NUL byte."""


class FolderRefused(Exception):
    """A session's folder that is not one file tools may work in; the message says why."""


class Roots:
    """The folders file tools may read. With one root, paths are relative to it; with several,
    a path starts with the root's folder name."""

    def __init__(self, roots: list[Path], private: Sequence[Path] = ()) -> None:
        self.roots = {r.expanduser().resolve().name: r.expanduser().resolve() for r in roots}
        self.private = tuple(private)
        """What the tools never reach: loopd's own files (`config.private_paths`) and the
        user's keys (`tools.secrets`)."""
        self._hidden = hideable(private, list(self.roots.values()))

    def within(self, cwd: Path | None) -> Roots:
        """The roots of a session: its own folder alone, or (None) all of these."""
        return self if cwd is None else Roots([cwd], self.private)

    def folder(self, cwd: str) -> Path:
        """`cwd` as a session's own folder: an absolute path to a folder inside one of these
        roots (or one of them). Raises `FolderRefused`."""
        path = Path(cwd)
        if not path.is_absolute():
            raise FolderRefused(f"{cwd}: a session's folder is an absolute path")
        if not self.roots:
            raise FolderRefused(
                f"{cwd}: no folder is open to loopd's file tools; add it (or a folder above "
                "it) to [tools] roots"
            )
        resolved = path.resolve()
        if not any(resolved.is_relative_to(r) for r in self.roots.values()):
            allowed = ", ".join(str(r) for r in self.roots.values())
            raise FolderRefused(
                f"{cwd} is not inside the folders loopd's tools may use ({allowed}): add it to "
                "[tools] roots"
            )
        if not resolved.is_dir():
            raise FolderRefused(f"{cwd}: no such folder")
        return resolved

    def resolve(self, path: str) -> Path:
        if not self.roots:
            raise ToolFailure("no folders are open to file tools (set [tools] roots)")
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

    def hides(self, path: Path) -> bool:
        """Whether `path` (resolved) is one the tools never reach."""
        return any(path.is_relative_to(hidden) for hidden in self._hidden)

    def shown(self, path: Path) -> str:
        for name, root in self.roots.items():
            if path.is_relative_to(root):
                relative = path.relative_to(root).as_posix()
                return relative if len(self.roots) == 1 else f"{name}/{relative}".rstrip("/.")
        return path.name


def hideable(paths: Sequence[Path], roots: Sequence[Path]) -> list[Path]:
    """`paths` resolved, less the folders that hold a root or the home folder: hiding one of
    those whole would hide the roots, or every dotfile a program reads."""
    home = Path.home().resolve()
    resolved = [p.expanduser().resolve() for p in paths]
    return [p for p in resolved if not any(k.is_relative_to(p) for k in (*roots, home))]


def write_protected(path: PurePath) -> str | None:
    """Why the tools never write `path`, or None: what is in a `.git` folder (hooks and config
    name programs git runs as the person, outside any sandbox; `commondir` moves both)."""
    if ".git" in path.parts[:-1]:
        return "it is in a .git folder, whose hooks and config git runs outside any sandbox"
    return None
