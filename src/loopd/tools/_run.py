"""`run_command`: a shell command in a folder under the roots, in a bubblewrap sandbox.

The sandbox (`bwrap`): the whole filesystem read-only but the tool roots (read-write) and a
private /tmp; no network unless `[tools.run] network = true`; its own PID, IPC and UTS
namespaces, so every process the command starts lives and dies with it; `--die-with-parent`,
so it never outlives loopd. The command runs in a process group of its own, killed whole at
its timeout or when the call is cancelled. What it does not protect: anything the roots hold
(the command may change or delete it, which is why `run` asks by default), reading files the
user can read anywhere on the machine, and the CPU and memory it takes until its timeout.

With `[tools.run] sandbox = "none"` the command runs as the user, unconfined: only the
timeout and the process group stand.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from ._port import ToolFailure

__all__ = ["OUTPUT_CHARS", "Sandbox", "missing_bubblewrap", "run_command"]

OUTPUT_CHARS = 16_000
"""Output the model sees at most: its head and its tail, with a marker between."""
READ_CHUNK = 65536
KEEP_BYTES = 4 * OUTPUT_CHARS
"""Bytes kept of the output's head, and of its tail: enough for the characters shown."""

MISSING = (
    "run_command needs bubblewrap (bwrap) to sandbox commands, and it is not installed: "
    "`sudo apt install bubblewrap` (Debian, Ubuntu), `sudo dnf install bubblewrap` (Fedora), "
    '`sudo pacman -S bubblewrap` (Arch). Or set [tools.run] sandbox = "none" to run commands '
    "unsandboxed, on purpose."
)


def missing_bubblewrap() -> str | None:
    """Why commands cannot be sandboxed here; None when they can."""
    return None if shutil.which("bwrap") else MISSING


@dataclass(frozen=True)
class Sandbox:
    roots: Sequence[Path]
    """Writable inside; everything else read-only."""
    network: bool
    enabled: bool = True
    """False: `sandbox = "none"`, the command runs unconfined."""

    def argv(self, command: str, folder: Path) -> list[str]:
        shell = ["/bin/sh", "-c", command]
        if not self.enabled:
            return shell
        argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        argv += ["--tmpfs", "/tmp"]  # noqa: S108 - a private, empty /tmp inside the sandbox
        for root in self.roots:
            argv += ["--bind", str(root), str(root)]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        if not self.network:
            argv.append("--unshare-net")
        argv += ["--die-with-parent", "--chdir", str(folder), "--", *shell]
        return argv


def _capped(head: bytes, tail: bytes, total: int) -> str:
    """The output as the model sees it: whole, or its head and tail with a marker saying how
    much of the middle was cut."""
    text = (head + tail).decode(errors="replace") if len(head) == total else None
    if text is not None and len(text) <= OUTPUT_CHARS:
        return text
    half = OUTPUT_CHARS // 2
    start = head.decode(errors="replace")[:half]
    end = (tail or head).decode(errors="replace")[-half:]
    cut = total - len(start.encode(errors="replace")) - len(end.encode(errors="replace"))
    return f"{start}\n[... {cut} bytes of output cut ...]\n{end}"


async def run_command(
    sandbox: Sandbox, command: str, folder: Path, timeout: float
) -> tuple[int | None, str]:
    """Run it; its exit status (None: killed at its timeout) and its output, stdout and
    stderr together, capped. Cancelling the caller kills it at once."""
    if sandbox.enabled and (why := missing_bubblewrap()):
        raise ToolFailure(why)
    process = await trio.lowlevel.open_process(
        sandbox.argv(command, folder),
        cwd=folder,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a group of its own, killed whole
    )
    head, tail, total = bytearray(), bytearray(), 0
    assert process.stdout is not None  # noqa: S101 - asked for above
    try:
        with trio.move_on_after(timeout) as deadline:
            while chunk := await process.stdout.receive_some(READ_CHUNK):
                total += len(chunk)
                if len(head) < KEEP_BYTES:
                    head += chunk
                else:  # the middle goes: only the head and the last KEEP_BYTES are kept
                    tail = (tail + chunk)[-KEEP_BYTES:]
            await process.wait()
    finally:
        _kill_group(process)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await process.wait()
    output = _capped(bytes(head), bytes(tail), total)
    if deadline.cancelled_caught:
        return None, output
    return process.returncode, output


def _kill_group(process: trio.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
