"""The folders the file tools work in, and how a path the model gives resolves in them."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ._port import ToolFailure

__all__ = ["SNIFF_BYTES", "FolderRefused", "Roots"]

SNIFF_BYTES = 8192
"""Enough of a file to tell text from binary the way git does: a NUL byte."""


class FolderRefused(Exception):
    """A session's folder that is not one file tools may work in; the message says why."""


class Roots:
    """The folders file tools may read. With one root, paths are relative to it; with several,
    a path starts with the root's folder name."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = {r.expanduser().resolve().name: r.expanduser().resolve() for r in roots}

    def within(self, cwd: Path | None) -> Roots:
        """The roots of a session: its own folder alone, or (None) all of these."""
        return self if cwd is None else Roots([cwd])

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
        resolved = root.joinpath(*rest).resolve()
        if not resolved.is_relative_to(root):
            raise ToolFailure(f"{path} leads outside the allowed folders")
        return resolved

    def shown(self, path: Path) -> str:
        for name, root in self.roots.items():
            if path.is_relative_to(root):
                relative = path.relative_to(root).as_posix()
                return relative if len(self.roots) == 1 else f"{name}/{relative}".rstrip("/.")
        return path.name
