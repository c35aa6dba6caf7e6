"""A llama-server that loopd starts and stops itself: the embedded default, and the tests' server.

The child gets the slots loopd's pool lends (`-np`), each with the whole `n_ctx`; no context
shift (a full context is an error loopd reports, not a silent loss of the conversation's
start), a slot-save path, and for loopd's own server `--swa-full`. Its
output goes to a log file, whose tail is shown when it fails to start.

llama-server runs under a small watchdog, in a process group of its own: the watchdog passes
signals on, and ends llama-server when its stdin (a pipe from loopd) reaches end of file,
which happens however loopd ends, `kill -9` included. Without it, a killed loopd would leave
its llama-server running, holding memory (or a GPU) and its port. Stopping signals the whole
group, so nothing is left behind when the watchdog itself is killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

log = logging.getLogger(__name__)

__all__ = [
    "LaunchSpec",
    "RunningServer",
    "ServerStartError",
    "free_port",
    "managed_server",
    "start_server",
    "stop",
]

# A process that ignores SIGTERM this long gets SIGKILL.
STOP_GRACE = 5.0
# Binding a port we just found free can still lose a race; try a few.
PORT_ATTEMPTS = 3
# Seconds between two looks at whether the server's processes are gone.
GROUP_POLL = 0.02

# The watchdog reads its stdin from the file descriptor itself: a daemon thread blocked in
# `sys.stdin.buffer.read()` holds the buffered reader's lock, and the interpreter's shutdown,
# once llama-server has exited, then aborts ("Fatal Python error: _enter_buffered_busy").
_WATCHDOG = """
import os, signal, subprocess, sys, threading
child = subprocess.Popen(sys.argv[1:])
for number in (signal.SIGTERM, signal.SIGINT):
    signal.signal(number, lambda n, _: child.send_signal(n))
def orphaned():
    while os.read(0, 4096):  # end of file: the process that started us is gone
        pass
    child.terminate()
threading.Thread(target=orphaned, daemon=True).start()
sys.exit(child.wait())
"""


class ServerStartError(Exception):
    """llama-server exited or did not become healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class LaunchSpec:
    binary: Path
    model: Path
    n_ctx: int = 8192
    """Tokens of context of each slot."""
    parallel: int = 1
    """Slots (`-np`); the server's context is `n_ctx` for each (`-c n_ctx * parallel`)."""
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    """None: a free port on `host`."""
    slot_save_path: Path | None = None
    chat_template_file: Path | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)
    ready_timeout: float = 60.0
    swa_full: bool = False
    """`--swa-full`: a sliding-window model keeps every token's cache, not only the window's,
    so a slot file restores what it saved (llama-server ignores it for other models)."""

    def command(self, port: int) -> list[str]:
        args = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(port),
            "-np",
            str(self.parallel),
            "-c",
            str(self.n_ctx * self.parallel),
            "--jinja",
            "--no-context-shift",
            "--metrics",
            "--no-ui",
        ]
        if self.threads is not None:
            args += ["-t", str(self.threads)]
        if self.slot_save_path is not None:
            args += ["--slot-save-path", str(self.slot_save_path)]
        if self.chat_template_file is not None:
            args += ["--chat-template-file", str(self.chat_template_file)]
        if self.swa_full:
            args.append("--swa-full")
        return [*args, *self.extra_args]


@dataclass
class RunningServer:
    url: str
    port: int
    process: trio.Process
    log_path: Path

    def kill(self) -> None:
        """SIGKILL llama-server and its watchdog at once (for tests of a crashing server)."""
        _signal_group(self.process, signal.SIGKILL)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def managed_server(spec: LaunchSpec, log_path: Path) -> AsyncIterator[RunningServer]:
    """Start llama-server, wait until `/health` says ok, and stop it on the way out."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = spec.port or free_port(spec.host)
        server = await start_server(spec, port, log_path)
        try:
            await _wait_healthy(server, spec.ready_timeout)
        except ServerStartError:
            await stop(server.process)
            if spec.port is not None or attempt == PORT_ATTEMPTS or "bind" not in server.log_tail():
                raise
            continue
        break
    try:
        yield server
    finally:
        await stop(server.process)


async def start_server(spec: LaunchSpec, port: int, log_path: Path) -> RunningServer:
    """Start llama-server under its watchdog; `stop` ends both."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if spec.slot_save_path is not None:
        spec.slot_save_path.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", _WATCHDOG, *spec.command(port)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    return RunningServer(f"http://{spec.host}:{port}", port, process, log_path)


async def _wait_healthy(server: RunningServer, timeout: float) -> None:
    async with httpx.AsyncClient(timeout=2.0) as http:
        with trio.move_on_after(timeout):
            while server.process.poll() is None:
                try:
                    response = await http.get(f"{server.url}/health")
                    if response.status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                await trio.sleep(0.05)
            raise ServerStartError(
                f"llama-server exited with status {server.process.returncode}:\n{server.log_tail()}"
            )
    raise ServerStartError(f"llama-server was not healthy after {timeout} s:\n{server.log_tail()}")


async def stop(process: trio.Process) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left after a grace period; reaps the
    watchdog, closes its pipe, and waits until llama-server itself is gone too. The watchdog
    may have died first (killed on its own): then only the group shows whether llama-server
    still runs, holding the port a restart would bind."""
    with trio.CancelScope(shield=True):
        _signal_group(process, signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE):
            await process.wait()
            await _group_gone(process)
        _signal_group(process, signal.SIGKILL)
        await process.wait()
        if process.stdin is not None:
            await process.stdin.aclose()
        with trio.move_on_after(STOP_GRACE):
            await _group_gone(process)
            return
        log.warning("llama-server (process group %d) is still there after SIGKILL", process.pid)


async def _group_gone(process: trio.Process) -> None:
    """Until no process of the watchdog's group is left. Its members are not our children
    (llama-server is the watchdog's), so there is nothing to wait on but a look now and then."""
    while True:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass  # it exists, though not ours to signal
        await trio.sleep(GROUP_POLL)


def _signal_group(process: trio.Process, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)
