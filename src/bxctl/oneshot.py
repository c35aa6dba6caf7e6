"""`bxctl status` and `bxctl sessions` in a blink: a blocking Unix socket, one JSON line each
way, no trio, no pydantic, no rich. A whole process of it costs a few times what the
interpreter does to start, where the full client's imports cost half a second.

The shapes stay `loopd.wire.proto`'s: an answer is read as JSON into attribute namespaces
and handed on typed as proto's model, so mypy checks every field this reads against the one
definition (and the tests feed real answers of a real loopd through it). What it cannot do
plainly goes to the full command (`bxctl.commands`): a config that is not plain TOML (which it
then reports), and `sessions` with no loopd answering (which it then reads from the store).

The errors a user meets are the same either way, and defined here: `Unreachable` (no loopd
answers, or it sends what bxctl cannot read) and `SessionRefused` (loopd would not open the
session).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from bxctl.exits import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from bxctl.text import (
    approve_command,
    context_line,
    session_lines,
    turns_text,
    unreadable_line,
)
from loopd import __version__
from loopd.groups import innermost
from loopd.locations import configured
from loopd.wire import PROTOCOL
from loopd.wire.lines import Lines, TooLong

if TYPE_CHECKING:
    from collections.abc import Sequence

    from loopd.wire.events import PlanUpdate
    from loopd.wire.proto import Error, SessionInfo, Sessions, Status, Unreadable

__all__ = [
    "MAX_LINE",
    "SessionRefused",
    "Unreachable",
    "check_owner",
    "connection_closed",
    "exit_for",
    "hello",
    "latest",
    "not_running",
    "plan_lines",
    "print_sessions",
    "read_message",
    "run",
    "serve_command",
    "sessions",
    "status",
    "status_lines",
]

MAX_LINE = 64 * 1024 * 1024
"""The daemon's lines can be long (a history page, a big tool result preview)."""
READ_SIZE = 1 << 16


class Unreachable(Exception):
    """No daemon answers on the socket."""


class SessionRefused(Exception):
    """loopd would not open the session; the message says why."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.code = error.code


def serve_command() -> list[str]:
    """`loopd serve` of this install: the `loopd` beside this Python (a venv's, which need
    not be on PATH), else `python -m loopd`."""
    sibling = Path(sys.executable).parent / "loopd"
    loopd = [str(sibling)] if os.access(sibling, os.X_OK) else [sys.executable, "-m", "loopd"]
    return [*loopd, "serve"]


def not_running(path: Path, error: OSError) -> Unreachable:
    return Unreachable(
        f"loopd is not running at {path} ({error.strerror}): start it with "
        f"`{' '.join(serve_command())}`"
    )


def connection_closed(path: Path) -> Unreachable:
    return Unreachable(f"loopd at {path} closed the connection")


def check_owner(path: Path) -> None:
    """Talk only to a socket of this user's: another user's could be anyone's daemon."""
    try:
        info = path.lstat()
    except OSError:
        return  # nothing there: connecting says so
    if info.st_uid != os.getuid():
        raise Unreachable(
            f"{path} belongs to another user (uid {info.st_uid}), not to you: not connecting"
        )


def hello(session: str, cwd: str | None = None, client: str = "bxctl") -> dict[str, Any]:
    """The `hello` line: into session `session` (an id, `latest` or `new`, in folder `cwd`)."""
    return {
        "type": "hello",
        "protocol": PROTOCOL,
        "client": f"{client} {__version__}",
        "session": session,
        "cwd": cwd,
    }


def exit_for(error: BaseException) -> int:
    """The exit status for what ended a command, told in one line; anything else is raised."""
    error = innermost(error)
    if isinstance(error, SessionRefused):
        print(f"bxctl: {error}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(error, Unreachable):
        print(f"bxctl: {error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if isinstance(error, BrokenPipeError):  # the reader of our output left: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    if isinstance(error, KeyboardInterrupt):
        return EXIT_FAILED
    raise error


def read_message(line: bytes) -> SimpleNamespace:
    """A daemon message as plain JSON: each object a namespace of its fields, as
    `loopd.wire.proto`'s model of it names them."""
    try:
        message = json.loads(line, object_hook=lambda fields: SimpleNamespace(**fields))
    except ValueError as e:
        raise Unreachable(f"loopd sent a line bxctl cannot read: {e}") from e
    if not isinstance(getattr(message, "type", None), str):
        raise Unreachable(f"loopd sent a line bxctl cannot read: {line[:200]!r}")
    return cast("SimpleNamespace", message)


class _Client:
    """One blocking connection: a line out, lines in until the answer."""

    def __init__(self, path: Path) -> None:
        check_owner(path)
        self.path = path
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(str(path))
        except OSError as e:
            self._socket.close()
            raise not_running(path, e) from None
        self._lines = Lines(MAX_LINE)
        self._ready: deque[bytes | TooLong] = deque()

    def request(self, message: dict[str, Any], answer: str) -> SimpleNamespace:
        """Send, then read up to the first message of type `answer` (or an `error`)."""
        try:
            self._socket.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            raise connection_closed(self.path) from None
        while (got := self._receive()).type not in (answer, "error"):
            pass
        return got

    def _receive(self) -> SimpleNamespace:
        while not self._ready:
            try:
                data = self._socket.recv(READ_SIZE)
            except OSError:
                data = b""
            if not data:
                raise connection_closed(self.path)
            self._ready.extend(self._lines.feed(data))
        line = self._ready.popleft()
        if isinstance(line, TooLong):
            raise Unreachable(f"loopd sent a line longer than {line.cap} bytes")
        return read_message(line)

    def close(self) -> None:
        self._socket.close()


def run(args: argparse.Namespace) -> int | None:
    """`bxctl status`'s or `bxctl sessions`' exit status; None when the full command is to run
    (a config that is not plain TOML, or `sessions` with no loopd answering)."""
    places = configured(args.config)
    if places is None:
        return None
    socket_path = args.socket or places.socket
    try:
        if args.command == "status":
            return status(socket_path, args.where)
        return sessions(socket_path, places.store)
    except BaseException as e:  # noqa: BLE001 - what a user meets gets one line; the rest is raised
        return exit_for(e)


def status(path: Path, where: str) -> int:
    """Print what loopd is doing in session `where`."""
    client = _Client(path)
    try:
        welcome = client.request(hello(where), "welcome")
        if welcome.type == "error":
            raise SessionRefused(cast("Error", welcome))
        answer = client.request({"type": "status"}, "status")
    finally:
        client.close()
    if answer.type != "status":
        raise Unreachable(f"loopd answered {answer.type}, not status")
    for line in status_lines(cast("Status", answer)):
        print(line)
    return EXIT_OK


ENGINE_NAMES = {"llama": "llama-server", "vllm": "vLLM", "openai": "OpenAI-compatible"}
PLAN_MARKS = {"completed": "✔", "in_progress": "▸", "pending": "□"}
"""Each status of a step of the model's plan, as its mark (Codex's ✔ and □, and one for the
step under way)."""


def plan_lines(plan: PlanUpdate) -> list[str]:
    """The model's plan: its explanation, then each step with its mark."""
    said = [plan.explanation] if plan.explanation else []
    steps = [f"{PLAN_MARKS[s.status]} {s.step}" for s in plan.steps]
    return said + (steps or ["(no steps: the plan was cleared)"])


def status_lines(status: Status) -> list[str]:
    """What `bxctl status` prints: the session, the model, the slots, the last request's
    figures, the calls that wait for approval and the model's plan."""
    slot = "none" if status.slot is None else status.slot
    window = "" if status.context_size is None else f", a window of {status.context_size} tokens"
    engine = ENGINE_NAMES.get(status.engine or "", "engine not known yet")
    lines = [
        f"session  {status.session} ({turns_text(status.turns)})",
        f"server   {status.server}  ({engine})",
        f"model    {status.model or '?'}{window}  slot {slot}",
        *([f"runs on  {status.session_model}"] if status.session_model else []),
        f"turn     {'running' if status.busy else 'idle'}, {status.queue} waiting",
    ]
    servers = {view.server for view in status.slots}
    for view in status.slots:
        held = "free" if view.session is None else f"session {view.session}"
        tokens = "" if view.tokens is None else f", {view.tokens} tokens"
        server = f"{view.server} " if len(servers) > 1 else ""
        lines.append(
            f"slot {server}{view.slot}   {'busy' if view.busy else 'idle'}, {held}{tokens}"
        )
    if u := status.last_usage:
        lines.append(
            f"last     {u.prompt_n} prompt tokens processed, "
            f"{'cache not reported' if u.cache_n is None else f'{u.cache_n} cached'}, "
            f"{u.predicted_n} generated"
        )
    if status.context is not None:
        said = context_line(status.context, status.past_reasoning, status.context_size)
        lines.append(f"context  {said}")
    asking = [p.event for p in status.pending if p.event.kind == "approval_needed"]
    lines += (
        f"waiting  call {a.call}: {a.tool} {json.dumps(a.arguments, default=vars)} "
        f"({approve_command(a, status.session)})"
        for a in asking
    )
    if status.plan is not None:
        shown = plan_lines(status.plan)
        lines += [f"{'plan' if n == 0 else '':<9}{line}" for n, line in enumerate(shown)]
    return lines


def sessions(path: Path, store: Path) -> int | None:
    """Print the sessions loopd lists; None when no loopd answers (the full command then reads
    them from the store)."""
    try:
        client = _Client(path)
    except Unreachable:
        return None
    try:
        answer = client.request({"type": "sessions"}, "sessions")
    finally:
        client.close()
    if answer.type != "sessions":
        raise Unreachable(f"loopd answered {answer.type}, not sessions")
    listing = cast("Sessions", answer)
    print_sessions(listing.sessions, listing.unreadable, listing.current, store)
    return EXIT_OK


def print_sessions(
    listed: Sequence[SessionInfo],
    unreadable: Sequence[Unreadable],
    current: str | None,
    store: Path,
) -> None:
    """The sessions, the most recent first, each sub-agent's under the session that started
    it and each fork under the session it forks, with their titles, each in a line that fits
    the terminal; the latest (the one `chat --continue` takes, when `current` is None)
    marked."""
    current = current or latest(listed)
    width = shutil.get_terminal_size().columns
    for _, line in session_lines(listed, current, width):
        print(line)
    for bad in unreadable:
        print(unreadable_line(bad.id, bad.reason))  # whole: why matters more than width
    if not listed and not unreadable:
        print(f"no sessions in {store}")


def latest(listed: Sequence[SessionInfo]) -> str | None:
    """The session `chat --continue` takes (`Store.latest`): the newest that is no sub-agent's
    (an id starts with its creation time)."""
    return max((s.id for s in listed if s.parent is None), default=None)
