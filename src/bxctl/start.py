"""loopd started on demand: when no loopd answers on the socket, `bxctl chat` and `bxctl acp`
start `loopd serve` in the background and go on once it answers.

It runs in a session of its own (a terminal's Ctrl-C and hang-up, an editor stopping
`bxctl acp`, never reach it), with stdin from /dev/null and its output appended to `loopd.log`
in loopd's state folder (the folder above `[store] directory`, `~/.local/state/loopd` by
default), never to the client's stdout, which for `bxctl acp` carries JSON-RPC alone. Its pid
goes to `loopd.pid` there (`bxctl stop`, and so `just stop`, reads it). Clients starting at
the same moment take turns on a lock file in that folder, so one starts loopd and the others
find it answering; loopd itself also refuses a second daemon on a live socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket as stdsocket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from bxctl.connection import Connection, Unreachable
from bxctl.oneshot import serve_command
from loopd.wire.proto import SessionsRequest

__all__ = ["START_WAIT", "STOP_WAIT", "Starter", "StopFailed"]

START_WAIT = 120.0
"""Seconds a started loopd has to answer (the embedded llama-server loads its model first)."""
POLL = 0.05
ASK_WAIT = 5.0
"""Seconds one probe waits for loopd's answer before asking again."""
LOG_TAIL = 20
"""Lines of the log quoted when loopd does not come up."""
STOP_WAIT = 60.0
"""Seconds a loopd has to exit once told to stop (it ends its turns and its llama-server)."""


class StopFailed(Exception):
    """The loopd told to stop is still there."""


@dataclass
class Starter:
    """How to start the loopd that `socket` belongs to."""

    socket: Path
    state: Path
    """loopd's state folder: its log, its pid file and the start lock go there."""
    config_file: Path | None = None
    """`--config`, given to the started loopd too."""
    socket_given: bool = False
    """The socket came from `--socket`: the started loopd listens there too."""
    say: Callable[[str], None] = lambda line: _to_stderr(f"bxctl: {line}\n")

    @property
    def log(self) -> Path:
        return self.state / "loopd.log"

    @property
    def pid_file(self) -> Path:
        return self.state / "loopd.pid"

    def command(self) -> list[str]:
        """`loopd serve` of this install: the `loopd` beside this Python, else `-m loopd`."""
        command = serve_command()
        if self.config_file is not None:
            command += ["--config", str(self.config_file)]
        if self.socket_given:
            command += ["--socket", str(self.socket)]
        return command

    async def ensure(self) -> None:
        """Return once a loopd answers on the socket, starting one when none does. Raises
        `Unreachable`, saying where its log is and what it said, when it does not come up."""
        if await _connects(self.socket):
            return
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _lock(self.state / "loopd.start.lock") as taken:
            # Another client starts it, and it answers once this one has the lock.
            while not taken():  # noqa: ASYNC110 - another process's lock: polled
                await trio.sleep(POLL)
            if await _answering(self.socket) is not None:
                return
            await self._start()

    async def _start(self) -> None:
        self.say(f"starting loopd (log: {self.log})")
        with self.log.open("ab") as log:
            offset = log.tell()
            # A session of its own, stdin from /dev/null, output to the log alone: nothing of
            # this client's terminal or pipes, so it outlives the client.
            # Popen returns once loopd is exec'd: nothing here waits on it.
            process = subprocess.Popen(  # noqa: ASYNC220
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        with trio.move_on_after(START_WAIT):
            while True:
                if (pid := await _answering(self.socket)) is not None:
                    if pid == process.pid:  # ours, not one started some other way meanwhile
                        self.pid_file.write_text(f"{pid}\n")
                    return
                code = process.poll()
                if code is not None and not await _connects(self.socket):
                    raise Unreachable(
                        f"loopd did not start: `{' '.join(self.command())}` exited with "
                        f"status {code}; its log {self.log} says:\n{self._said(offset)}"
                    )
                await trio.sleep(POLL)
        raise Unreachable(
            f"loopd (pid {process.pid}) did not answer at {self.socket} within "
            f"{START_WAIT:g} s; its log {self.log} says:\n{self._said(offset)}"
        )

    def stop(self) -> int | None:
        """Stop the loopd this folder's pid file names (SIGTERM), and return its pid once it
        has exited; None where none runs. A pid file whose process is gone, or is no longer a
        loopd (its pid reused), is removed and nothing is signalled. Raises `StopFailed`."""
        try:
            pid = int(self.pid_file.read_text())
            process = os.pidfd_open(pid)  # held: the pid cannot be reused under us from here
        except (OSError, ValueError):
            self.pid_file.unlink(missing_ok=True)
            return None
        try:
            if not _is_loopd(pid):
                self.pid_file.unlink(missing_ok=True)
                return None
            signal.pidfd_send_signal(process, signal.SIGTERM)
            if not select.select([process], [], [], STOP_WAIT)[0]:  # readable once it exits
                raise StopFailed(
                    f"loopd (pid {pid}) did not exit within {STOP_WAIT:g} s of SIGTERM; "
                    f"its log is {self.log}"
                )
        except ProcessLookupError:
            pass  # it exited meanwhile
        finally:
            os.close(process)
        self.pid_file.unlink(missing_ok=True)
        return pid

    def _said(self, offset: int) -> str:
        try:
            with self.log.open("rb") as log:
                log.seek(offset)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError as e:
            return f"(it cannot be read: {e.strerror})"
        return "\n".join(lines[-LOG_TAIL:]) or "(nothing)"


async def _connects(socket: Path) -> bool:
    """Something accepts connections on the socket (a stale socket file does not count)."""
    try:
        connection = await Connection.open(socket)
    except Unreachable:
        return False
    await connection.aclose()
    return True


async def _answering(socket: Path) -> int | None:
    """The pid of the loopd that serves on the socket: it answers a `sessions` request (one
    still starting, or failing to, accepts the connection and says nothing, or closes it);
    None when none does."""
    try:
        connection = await Connection.open(socket)
    except Unreachable:
        return None
    answer = None
    try:
        with trio.move_on_after(ASK_WAIT):
            answer = await connection.request(SessionsRequest())
        credentials = connection.stream.socket.getsockopt(
            stdsocket.SOL_SOCKET, stdsocket.SO_PEERCRED, struct.calcsize("3i")
        )
    except (Unreachable, OSError, trio.BrokenResourceError):
        return None
    finally:
        await connection.aclose()
    if answer is None:  # an error answers too: a loopd serves
        return None
    pid: int = struct.unpack("3i", credentials)[0]
    return pid


def _is_loopd(pid: int) -> bool:
    """The process runs `loopd serve` (as `loopd serve` or `python -m loopd serve`)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    names = [Path(w.decode(errors="replace")).name for w in words]
    return "serve" in names and "loopd" in names


def _to_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[Callable[[], bool]]:
    """A lock file: the block gets a function that tries to take it (without waiting), and
    it is released when the block ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def take() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    try:
        yield take
    finally:
        os.close(fd)
