"""The built-in tools: reading, listing and searching files under the configured roots, and the
time. Nothing reaches outside the roots: absolute paths and `..` are refused, and a path whose
resolved form (symlinks followed) leaves its root is refused too. Reads are bounded, binary files
are named as such, and only regular files are opened (a FIFO would hang a read forever).

The tools run in threads of their own limiter, never the one the store's appends use. A thread
cannot be cancelled, so each tool also watches its own deadline: a regular expression runs in
the `regex` engine, with a timeout and without holding the GIL, since `re` can backtrack for
hours while the event loop waits for the GIL.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import regex
import trio

from loopd.config import ToolsConfig

from ._entry import ToolEntry
from ._port import ToolFailure, ToolOutput
from ._registry import BUILTIN, policy_for

__all__ = ["DELEGATE", "Builtins", "Roots", "builtin_entries", "delegate_entry"]

READ_LINES = 400
READ_BYTES = 256 * 1024
LIST_LIMIT = 500
SEARCH_MATCHES = 100
SEARCH_FILE_BYTES = 2 * 1024 * 1024
# Enough of a file to tell text from binary the way git does: a NUL byte.
SNIFF_BYTES = 8192
# Threads for tool calls at once; an abandoned call keeps its thread until it notices its deadline.
TOOL_THREADS = 8
_SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv"})


class Roots:
    """The folders file tools may read. With one root, paths are relative to it; with several,
    a path starts with the root's folder name."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = {r.expanduser().resolve().name: r.expanduser().resolve() for r in roots}

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


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "Relative to the root, e.g. notes/today.md"}

_TOOLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "read_file": (
        "Read a text file.",
        (
            f"Read a text file under the open folders, {READ_LINES} lines at a time from "
            "start_line (1 by default)."
        ),
        _schema({"path": _PATH, "start_line": {"type": "integer", "minimum": 1}}, ["path"]),
    ),
    "list_directory": (
        "List the files and folders in a directory.",
        "List a directory under the open folders: names, sizes, folders marked with /.",
        _schema({"path": {**_PATH, "default": "."}}, []),
    ),
    "search_text": (
        "Search for text in files.",
        (
            "Search the text files under a folder for a word or phrase (case-insensitive), or a "
            f"regular expression with regex true; gives up to {SEARCH_MATCHES} matching lines."
        ),
        _schema(
            {
                "pattern": {"type": "string", "minLength": 1},
                "path": {**_PATH, "default": "."},
                "regex": {"type": "boolean", "default": False},
            },
            ["pattern"],
        ),
    ),
    "current_time": (
        "Tell the current date and time.",
        "The current date and time, in UTC and in the machine's local time zone.",
        _schema({}, []),
    ),
}
_FILE_TOOLS = ("read_file", "list_directory", "search_text")


def builtin_entries(config: ToolsConfig) -> list[ToolEntry]:
    """The built-in tools; the file tools only when there are roots to read."""
    names = [n for n in _TOOLS if config.roots or n not in _FILE_TOOLS]
    return [
        ToolEntry(name, summary, description, schema, BUILTIN, policy_for(config, name, BUILTIN))
        for name in names
        for summary, description, schema in [_TOOLS[name]]
    ]


DELEGATE = "delegate"


def delegate_entry(config: ToolsConfig, source: str) -> ToolEntry:
    """The `delegate` tool: run by the turn that calls it (a sub-agent is a session), so it
    has no executor here; only its policy is the port's."""
    return ToolEntry(
        DELEGATE,
        "Give a task to a sub-agent and get its answer.",
        (
            "Give a task to a sub-agent: a new conversation with the same tools, on a slot of "
            "its own, that works on the task alone and answers with its result. Its tool calls "
            "and their results stay out of this conversation. Write the task so it stands on "
            "its own: the sub-agent sees nothing of this conversation. Several delegate calls "
            "in one answer run at once."
        ),
        _schema({"task": {"type": "string", "minLength": 1}}, ["task"]),
        source,
        policy_for(config, DELEGATE, source),
    )


class Builtins:
    def __init__(self, roots: list[Path], timeout: float) -> None:
        self.roots = Roots(roots)
        self.timeout = timeout
        """`[tools] timeout`: the port stops waiting then; the tool's thread stops too."""
        self._threads = trio.CapacityLimiter(TOOL_THREADS)
        self._run: dict[str, Callable[[dict[str, Any]], str]] = {
            "read_file": self.read_file,
            "list_directory": self.list_directory,
            "search_text": self.search_text,
            "current_time": lambda _: _now(),
        }

    async def run_tool(self, entry: ToolEntry, arguments: dict[str, Any]) -> ToolOutput:
        function = self._run[entry.name]
        # File I/O in a thread; abandoned on cancel, so a timeout always ends the call.
        text = await trio.to_thread.run_sync(
            function, arguments, abandon_on_cancel=True, limiter=self._threads
        )
        return ToolOutput(text)

    def _regular_file(self, path: str) -> tuple[Path, os.stat_result]:
        resolved = self.roots.resolve(path)
        try:
            info = resolved.stat()
        except FileNotFoundError:
            raise ToolFailure(f"{path}: no such file") from None
        if stat.S_ISDIR(info.st_mode):
            raise ToolFailure(f"{path} is a directory; use list_directory")
        if not stat.S_ISREG(info.st_mode):
            raise ToolFailure(f"{path} is not a regular file")
        return resolved, info

    def read_file(self, arguments: dict[str, Any]) -> str:
        path = arguments["path"]
        resolved, info = self._regular_file(path)
        start = int(arguments.get("start_line", 1))
        with resolved.open("rb") as f:
            if b"\0" in f.read(SNIFF_BYTES):
                raise ToolFailure(
                    f"{path} is a binary file ({info.st_size} bytes); it cannot be shown as text"
                )
            f.seek(0)
            lines: list[str] = []
            taken = 0
            for number, raw in enumerate(f, start=1):
                if number < start:
                    continue
                if len(lines) == READ_LINES or taken + len(raw) > READ_BYTES:
                    lines.append(
                        f"[... more from line {number}: read_file with start_line {number}]"
                    )
                    break
                lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
                taken += len(raw)
        if not lines:
            return f"[{path} has fewer than {start} lines]"
        return "\n".join(lines)

    def list_directory(self, arguments: dict[str, Any]) -> str:
        path = arguments.get("path", ".")
        if len(self.roots.roots) > 1 and path in (".", ""):
            return "\n".join(f"{name}/" for name in sorted(self.roots.roots))
        resolved = self.roots.resolve(path)
        if not resolved.is_dir():
            raise ToolFailure(f"{path}: no such directory")
        entries = sorted(resolved.iterdir(), key=lambda p: p.name)
        lines = []
        for entry in entries[:LIST_LIMIT]:
            try:
                info = entry.stat()
            except OSError:
                lines.append(f"{entry.name} (unreadable)")
                continue
            if stat.S_ISDIR(info.st_mode):
                lines.append(f"{entry.name}/")
            else:
                lines.append(f"{entry.name} ({info.st_size} bytes)")
        if len(entries) > LIST_LIMIT:
            lines.append(f"[... and {len(entries) - LIST_LIMIT} more]")
        return "\n".join(lines) or f"[{path} is empty]"

    def search_text(self, arguments: dict[str, Any]) -> str:
        pattern = arguments["pattern"]
        path = arguments.get("path", ".")
        deadline = time.monotonic() + self.timeout
        try:
            matcher = regex.compile(
                pattern if arguments.get("regex") else regex.escape(pattern), regex.IGNORECASE
            )
        except regex.error as e:
            raise ToolFailure(f"not a valid regular expression: {e}") from None
        start = self.roots.resolve(path)
        matches: list[str] = []
        for file in _text_files(start, self.roots):
            with file.open("rb") as f:
                data = f.read(SEARCH_FILE_BYTES)
            if b"\0" in data[:SNIFF_BYTES]:
                continue
            for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if _search(matcher, line, deadline, pattern):
                    matches.append(f"{self.roots.shown(file)}:{number}: {line.strip()[:200]}")
                    if len(matches) == SEARCH_MATCHES:
                        stop = f"[... stopped at the first {SEARCH_MATCHES} matches]"
                        return "\n".join([*matches, stop])
        return "\n".join(matches) or f"No line under {path} matches {pattern!r}."


def _search(matcher: regex.Pattern[str], line: str, deadline: float, pattern: str) -> bool:
    left = deadline - time.monotonic()
    try:
        if left > 0:
            return matcher.search(line, concurrent=True, timeout=left) is not None
    except TimeoutError:
        pass
    raise ToolFailure(
        f"searching for {pattern!r} took too long ([tools] timeout); "
        "a simpler pattern or a narrower path will do"
    )


def _text_files(start: Path, roots: Roots) -> list[Path]:
    if start.is_file():
        return [start]
    found = []
    for directory, dirs, files in os.walk(start):  # does not follow symlinked folders
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            file = Path(directory) / name
            try:
                resolved = file.resolve()  # a symlinked file may point anywhere: check
                inside = any(resolved.is_relative_to(r) for r in roots.roots.values())
                if inside and stat.S_ISREG(resolved.stat().st_mode):
                    found.append(resolved)
            except OSError:
                continue
    return found


def _now() -> str:
    utc = datetime.now(UTC)
    return f"{utc:%Y-%m-%d %H:%M:%S} UTC ({utc.astimezone():%Y-%m-%d %H:%M:%S %Z} local)"
