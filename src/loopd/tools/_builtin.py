"""The built-in tools: reading, listing, searching, finding, writing and editing files under the
configured roots (writes in `_write`), running commands in them (`_run`), fetching a web page
(`_fetch`), and the time.
Nothing reaches outside the roots: absolute paths and `..` are refused, and a path whose
resolved form (symlinks followed) leaves its root is refused too. Reads are bounded, binary
files are named as such, and only regular files are opened (a FIFO would hang a read forever).

The tools run in threads of their own limiter, never the one the store's appends use. A thread
cannot be cancelled, so each tool also watches its own deadline: a regular expression runs in
the `regex` engine, with a timeout and without holding the GIL, since `re` can backtrack for
hours while the event loop waits for the GIL.
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import regex
import trio

from loopd.config import FetchConfig, RunConfig, ToolsConfig
from loopd.session.records import PlanStep

from ._fetch import Fetcher
from ._registry import BUILTIN, policy_for
from ._roots import SNIFF_BYTES, Roots
from ._run import Sandbox, run_command
from ._sandbox import secrets
from ._types import Judgment, OnOutput, Preview, ToolEntry, ToolFailure, ToolOutput, ToolRequest
from ._write import plan

__all__ = [
    "DELEGATE",
    "PLAN",
    "Builtins",
    "Roots",
    "builtin_entries",
    "checked_plan",
    "delegate_entry",
]

READ_LINES = 400
READ_BYTES = 256 * 1024
LIST_LIMIT = 500
SEARCH_MATCHES = 100
FIND_LIMIT = 200
SEARCH_FILE_BYTES = 2 * 1024 * 1024
# Threads for tool calls at once; an abandoned call keeps its thread until it notices its deadline.
TOOL_THREADS = 8
_SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv"})


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {
    "type": "string",
    "description": "As list_directory shows it: relative to the open folder (with several, "
    "starting with the folder's name)",
}

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
    "find_files": (
        "Find files by name: glob patterns such as *.py or src/**/test_*.py.",
        (
            "Find files under a folder of the open folders whose path matches a glob pattern: "
            "* and ? within a name, ** across folders, [abc] one of; a pattern without / is "
            f"matched against each file's name at any depth. Gives up to {FIND_LIMIT} paths, "
            "sorted."
        ),
        _schema(
            {"pattern": {"type": "string", "minLength": 1}, "path": {**_PATH, "default": "."}},
            ["pattern"],
        ),
    ),
    "write_file": (
        "Write a text file: create it, or replace all it holds.",
        (
            "Write a text file under the open folders: create it (its folder must exist) or "
            "replace everything in it with content. To change part of a file, edit_file."
        ),
        _schema({"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
    ),
    "edit_file": (
        "Edit a text file: replace exact pieces of its text.",
        (
            "Edit a text file under the open folders: each edit replaces old_text, which must "
            "occur exactly once in the file (copy it exactly, with enough around it to be "
            "unique), with new_text. Several edits of one file apply in order, all or none."
        ),
        _schema(
            {
                "path": _PATH,
                "edits": {
                    "type": "array",
                    "minItems": 1,
                    "items": _schema(
                        {"old_text": {"type": "string"}, "new_text": {"type": "string"}},
                        ["old_text", "new_text"],
                    ),
                },
            },
            ["path", "edits"],
        ),
    ),
    "run_command": (
        "Run a shell command in a folder.",
        (
            "Run a shell command (sh -c) in a folder under the open folders, in a sandbox: "
            "files outside the open folders are read-only, /tmp is its own. Gives its exit "
            "status and its output (stdout and stderr together; the head and tail when long)."
        ),
        _schema(
            {
                "command": {"type": "string", "minLength": 1},
                "folder": {**_PATH, "default": "."},
                "timeout": {"type": "number", "exclusiveMinimum": 0},
            },
            ["command"],
        ),
    ),
    "update_plan": (
        "Keep a plan of the task: its steps as a to-do list, each pending, in progress or done.",
        (
            "Set the plan of a task of several steps, which the user sees: the whole list of "
            "steps in order, each with its status (pending, in_progress, completed), at most one "
            "in_progress at a time; each call replaces the plan. An explanation says why it "
            "changed, where that helps."
        ),
        _schema(
            {
                "explanation": {"type": "string"},
                "plan": {
                    "type": "array",
                    "items": _schema(
                        {
                            "step": {"type": "string", "minLength": 1},
                            "status": {
                                "type": "string",
                                "enum": ["pending", "in_progress", "completed"],
                            },
                        },
                        ["step", "status"],
                    ),
                },
            },
            ["plan"],
        ),
    ),
    "fetch_url": (
        "Fetch a web page or text file by its URL (http or https), as Markdown or text.",
        (
            "Fetch a web page or text file over http or https: HTML comes back as Markdown, "
            "text, JSON and XML as they are, long ones cut. Hosts that are not allowed ask "
            "first or are refused."
        ),
        _schema({"url": {"type": "string", "minLength": 1}}, ["url"]),
    ),
    "current_time": (
        "Tell the current date and time.",
        "The current date and time, in UTC and in the machine's local time zone.",
        _schema({}, []),
    ),
}
_FILE_TOOLS = (
    "read_file",
    "list_directory",
    "search_text",
    "find_files",
    "write_file",
    "edit_file",
    "run_command",
)
WRITE_TOOLS = frozenset({"write_file", "edit_file"})
"""Run by the turn that calls them, which writes the change to the log first
(`loopd.turn.changes`)."""
PLAN = "update_plan"
"""Run by the turn that calls it, which keeps the plan in the session's log
(`loopd.turn.calls`)."""
PREVIEW_CHARS = 20_000
"""Characters of a diff shown for approval at most."""
RUN_MARGIN = 5.0
"""Seconds past `[tools.run] timeout` before the port stops waiting for a command (which
kills itself at its own timeout first)."""


def builtin_entries(config: ToolsConfig) -> list[ToolEntry]:
    """The built-in tools, the file tools among them: with no `[tools] roots` they work in a
    session's own folder (an editor's), and one without a folder is told so."""
    names = list(_TOOLS)
    return [
        ToolEntry(
            name,
            summary,
            description,
            schema,
            BUILTIN,
            policy_for(config, name, BUILTIN),
            timeout=config.run.timeout + RUN_MARGIN if name == "run_command" else None,
            accepting=policy_for(config, name, BUILTIN, mode="accept_edits"),
        )
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


def checked_plan(arguments: dict[str, Any]) -> tuple[str | None, tuple[PlanStep, ...]]:
    """An `update_plan` call's explanation and steps (its schema already checked); raises
    `ToolFailure`, for the model to read, where more than one step is in progress."""
    steps = tuple(PlanStep.model_validate(step) for step in arguments["plan"])
    doing = [step.step for step in steps if step.status == "in_progress"]
    if len(doing) > 1:
        raise ToolFailure(
            f"at most one step can be in_progress at a time, and {len(doing)} are "
            f"({'; '.join(doing)}); the plan was not changed. Mark one in_progress, the others "
            "pending or completed."
        )
    explanation = arguments.get("explanation")
    return explanation or None, steps


class Builtins:
    def __init__(  # noqa: PLR0913 - the tools' whole context
        self,
        roots: list[Path],
        timeout: float,
        run: RunConfig | None = None,
        threads: trio.CapacityLimiter | None = None,
        private: Sequence[Path] = (),
        *,
        fetch: Fetcher | FetchConfig | None = None,
    ) -> None:
        self.run = run or RunConfig()
        self.fetcher = fetch if isinstance(fetch, Fetcher) else Fetcher(fetch or FetchConfig())
        self._private = private
        self.roots = Roots(roots, [*private, *secrets(self.run)])
        """Where the file tools work; never in loopd's own files (`private`) or the keys."""
        self.timeout = timeout
        """`[tools] timeout`: the port stops waiting then; the tool's thread stops too."""
        self.sandbox = Sandbox.of(self.run, list(self.roots.roots.values()), private)
        self._threads = threads or trio.CapacityLimiter(TOOL_THREADS)
        self._run: dict[str, Callable[[dict[str, Any]], str]] = {
            "read_file": self.read_file,
            "list_directory": self.list_directory,
            "search_text": self.search_text,
            "find_files": self.find_files,
            "current_time": lambda _: _now(),
        }

    def within(self, cwd: Path | None) -> Builtins:
        """The same tools working in a session's own folder alone (None: in every root); they
        share the threads."""
        if cwd is None:
            return self
        return Builtins(
            [cwd], self.timeout, self.run, self._threads, self._private, fetch=self.fetcher
        )

    async def check_hidden(self) -> None:
        """Refuse while a hidden path inside the roots has a second name (`Roots.tampered`):
        a walk of the hidden folders inside the roots, in a thread of the tools'."""
        why = await trio.to_thread.run_sync(
            self.roots.tampered, abandon_on_cancel=True, limiter=self._threads
        )
        if why is not None:
            raise ToolFailure(why)

    async def preview(self, entry: ToolEntry, request: ToolRequest) -> Preview | None:
        """A write's or an edit's diff (with its basis), a command with its folder and sandbox;
        or why the call will fail."""
        tools = self.within(request.cwd)
        try:
            if entry.name in WRITE_TOOLS:
                planned = await trio.to_thread.run_sync(
                    plan,
                    tools.roots,
                    entry.name,
                    request.arguments,
                    abandon_on_cancel=True,
                    limiter=self._threads,
                )
                shown = planned.diff or "(no change)"
                if len(shown) > PREVIEW_CHARS:  # the event and the log carry it
                    cut = len(shown) - PREVIEW_CHARS
                    shown = f"{shown[:PREVIEW_CHARS]}\n[... {cut} more characters of the diff]"
                return Preview(shown, planned.basis, planned.change())
            if entry.name == "run_command":
                return Preview(tools.command_preview(request.arguments))
            if entry.name == "fetch_url":
                return Preview(self.fetcher.preview(request.arguments["url"]))
        except ToolFailure as e:
            return Preview(f"(it will fail: {e})")
        return None

    def judge(self, entry: ToolEntry, request: ToolRequest) -> Judgment | None:
        """`fetch_url`'s domain lists' say on a call (`Judges`); other tools have none."""
        if entry.name == "fetch_url":
            return self.fetcher.judge(request.arguments["url"])
        return None

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        if entry.name == "fetch_url":
            # Redirects to any host not denied, where no person would have been asked.
            unasked = entry.policy_in(request.mode).action == "allow"
            any_host = unasked or entry.name in request.granted
            return ToolOutput(await self.fetcher.fetch(request.arguments["url"], any_host=any_host))
        tools = self.within(request.cwd)
        if entry.name in _FILE_TOOLS:
            await tools.check_hidden()
        if entry.name == "run_command":
            return await tools.run_command(request.arguments, request.on_output)
        if entry.name in WRITE_TOOLS:  # the turn runs them, recording each change first
            raise ToolFailure(f"{entry.name} cannot run here: this turn keeps no file history")
        if entry.name == PLAN:  # the turn runs it, keeping the plan in the log
            raise ToolFailure(f"{PLAN} cannot run here: no session keeps this plan")
        function = tools._run[entry.name]  # noqa: SLF001 - another instance of this class
        # File I/O in a thread; abandoned on cancel, so a timeout always ends the call.
        text = await trio.to_thread.run_sync(
            function, request.arguments, abandon_on_cancel=True, limiter=self._threads
        )
        return ToolOutput(text)

    def command_folder(self, arguments: dict[str, Any]) -> tuple[Path, float]:
        """Where `run_command` would run, and for how long at most."""
        folder = self.roots.resolve(arguments.get("folder", "."))
        if not folder.is_dir():
            raise ToolFailure(f"{arguments.get('folder')}: no such folder")
        return folder, min(float(arguments.get("timeout", self.run.timeout)), self.run.timeout)

    def command_preview(self, arguments: dict[str, Any]) -> str:
        """The command as a person approves it: what, where, with what around it."""
        folder, timeout = self.command_folder(arguments)
        sandbox = "bubblewrap" if self.sandbox.enabled else "none (unconfined)"
        if self.sandbox.enabled:
            sandbox += f", at most {self.sandbox.max_processes} processes"
        network = "yes" if self.sandbox.network is True or not self.sandbox.enabled else "no"
        if self.sandbox.enabled and isinstance(self.sandbox.network, tuple):
            network = f"through loopd's proxy to {', '.join(self.sandbox.network) or 'nothing'}"
        return (
            f"$ {arguments['command']}\nin {folder}\nsandbox {sandbox}, network {network}, "
            f"stopped after {timeout:g} s"
        )

    async def run_command(
        self, arguments: dict[str, Any], on_output: OnOutput | None = None
    ) -> ToolOutput:
        folder, timeout = self.command_folder(arguments)
        command = arguments["command"]
        status, output = await run_command(self.sandbox, command, folder, timeout, on_output)
        if status is None:
            stopped = f"stopped after {timeout:g} s (its timeout), and all it had started"
            return ToolOutput(f"{stopped}\n{output}")
        return ToolOutput(f"exit status {status}\n{output}")

    def read_file(self, arguments: dict[str, Any]) -> str:
        path = arguments["path"]
        start = int(arguments.get("start_line", 1))
        with self.roots.open(self.roots.resolve(path), path) as f:
            if b"\0" in f.read(SNIFF_BYTES):
                size = os.fstat(f.fileno()).st_size
                raise ToolFailure(
                    f"{path} is a binary file ({size} bytes); it cannot be shown as text"
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
            try:
                with self.roots.open(file, self.roots.shown(file)) as f:
                    data = f.read(SEARCH_FILE_BYTES)
            except ToolFailure:  # changed since it was listed: not one to search now
                continue
            if b"\0" in data[:SNIFF_BYTES]:
                continue
            for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if _search(matcher, line, deadline, pattern):
                    matches.append(f"{self.roots.shown(file)}:{number}: {line.strip()[:200]}")
                    if len(matches) == SEARCH_MATCHES:
                        stop = f"[... stopped at the first {SEARCH_MATCHES} matches]"
                        return "\n".join([*matches, stop])
        return "\n".join(matches) or f"No line under {path} matches {pattern!r}."

    def find_files(self, arguments: dict[str, Any]) -> str:
        pattern, path = arguments["pattern"], arguments.get("path", ".")
        matcher = glob_matcher(pattern)
        start = self.roots.resolve(path)
        if not start.is_dir():
            raise ToolFailure(f"{path}: no such folder")
        deadline = time.monotonic() + self.timeout
        found = []
        for file in _files(start, self.roots, deadline):
            relative = file.relative_to(start).as_posix()
            if matcher.fullmatch(relative if "/" in pattern else file.name):
                found.append(self.roots.shown(file))
        found.sort()
        if not found:
            return f"No file under {path} matches {pattern!r}."
        more = len(found) - FIND_LIMIT
        return "\n".join(found[:FIND_LIMIT] + ([f"[... and {more} more]"] if more > 0 else []))


def glob_matcher(pattern: str) -> re.Pattern[str]:
    """A glob pattern as a regular expression over a `/`-separated path: `*` and `?` within
    one name, `**` across folders (`**/` also none), `[...]` a class; the rest as it is."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1 : end]
            negated = body.startswith("!")
            body = re.escape(body[1:] if negated else body).replace("\\-", "-")
            out.append(f"[{'^' if negated else ''}{body}]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


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
    return [file.resolve() for file in _files(start, roots)]


def _files(start: Path, roots: Roots, deadline: float = math.inf) -> Iterator[Path]:
    """The regular files under `start` (not resolved: as they are named there) that are in
    a root and not hidden once their links are followed; the folders of other tools' caches
    and of version control are left out. Raises `ToolFailure` past `deadline`."""
    for directory, dirs, files in os.walk(start):  # does not follow symlinked folders
        if time.monotonic() > deadline:
            raise ToolFailure(
                f"listing {roots.shown(Path(directory))} took too long ([tools] timeout); "
                "a narrower path will do"
            )
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            file = Path(directory) / name
            try:
                resolved = file.resolve()  # a symlinked file may point anywhere: check
                inside = any(resolved.is_relative_to(r) for r in roots.roots.values())
                if inside and not roots.hides(resolved) and stat.S_ISREG(resolved.stat().st_mode):
                    yield file
            except OSError:
                continue


def _now() -> str:
    utc = datetime.now(UTC)
    return f"{utc:%Y-%m-%d %H:%M:%S} UTC ({utc.astimezone():%Y-%m-%d %H:%M:%S %Z} local)"
