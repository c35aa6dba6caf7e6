"""`run_command`: a shell command in a folder under the roots, in a bubblewrap sandbox
(`_sandbox`: what it sees; `_bounds`: what it may ask of the kernel, how many processes).

The command runs in a process group of its own and, as root, a pids cgroup of its own; both
are killed whole at its timeout or when the call is cancelled, and bubblewrap's PID namespace
takes every process it started with it. Its output is kept whole up to `KEEP_BYTES` of head
and of tail: a bound on loopd's memory, not the cut the model sees (that is
`[loop] tool_result_cap`, applied once to the whole result, head and tail kept). Its caller
may hear the output as it comes too (`on_output`, through `_live`), apart from that result.

With `[tools.run] network` a list of domains, the command reaches them through loopd's proxy
(`_proxy`), which runs for as long as the command does.

With `[tools.run] sandbox = "none"` the command runs as the user, unconfined: only the
timeout and the process group stand (and the network is the machine's, list or not).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

from loopd.config import RunConfig

from ._bounds import PidsCgroups, limited, seccomp_program, seccomp_unavailable
from ._hosts import Resolver, system_resolver
from ._live import LiveOutput
from ._proxy import PROXY_ENV, network_rules, proxy
from ._sandbox import Sandbox
from ._types import OnOutput, ToolFailure

__all__ = ["KEEP_BYTES", "Sandbox", "process_bound", "run_command", "sandbox_missing"]

READ_CHUNK = 65536
KEEP_BYTES = 256 * 1024
"""Bytes kept of a command's output's head, and of its tail, at most."""

MISSING = (
    "run_command needs bubblewrap (bwrap) to sandbox commands, and it is not installed: "
    "`sudo apt install bubblewrap` (Debian, Ubuntu), `sudo dnf install bubblewrap` (Fedora), "
    '`sudo pacman -S bubblewrap` (Arch). Or set [tools.run] sandbox = "none" to run commands '
    "unsandboxed, on purpose."
)


PRLIMIT_MISSING = (
    "run_command needs prlimit (util-linux) to bound a command's processes, and it is not "
    'installed: `sudo apt install util-linux`. Or set [tools.run] sandbox = "none" to run '
    "commands unsandboxed, on purpose."
)


def sandbox_missing() -> str | None:
    """Why commands cannot be sandboxed here; None when they can."""
    if not shutil.which("bwrap"):
        return MISSING
    if not shutil.which("prlimit"):
        return PRLIMIT_MISSING
    return seccomp_unavailable()


@functools.cache
def _pdeathsig_supported(setpriv: str) -> bool:
    """Whether this setpriv has --pdeathsig (util-linux 2.33 and later)."""
    done = subprocess.run([setpriv, "--help"], capture_output=True, text=True, check=False)
    return "--pdeathsig" in done.stdout


def _with_pdeathsig(roots: Sequence[Path]) -> list[str]:
    """What runs a program killed when loopd ends (empty where setpriv cannot: then only
    bubblewrap asks for that, a moment later)."""
    setpriv = _program("setpriv", roots)
    if not _pdeathsig_supported(setpriv):
        return []
    return [setpriv, "--pdeathsig", "KILL", "--"]


def _program(name: str, roots: Sequence[Path]) -> str:
    """`name`'s absolute path on loopd's own PATH (never the command's), refused when it lies
    inside a root: a command could put its own program there, one that sandboxes nothing."""
    found = shutil.which(name)
    if found is None:
        raise ToolFailure(sandbox_missing() or f"{name} is not installed")
    real = Path(found).resolve()
    if any(real.is_relative_to(root) for root in roots):
        raise ToolFailure(
            f"{name} is found at {found}, inside the folders commands may write, so a command "
            f"could replace it: install it elsewhere, or take that folder out of loopd's PATH"
        )
    return str(real)


@functools.cache
def _pids_cgroups() -> PidsCgroups | None:
    """Found once per loopd (root only)."""
    return PidsCgroups.find()


def process_bound(run: RunConfig) -> str:
    """How a command's processes are bounded here, in words (`loopd check-config`, the log)."""
    if os.geteuid() != 0:
        return f"at most {run.max_processes} processes (RLIMIT_NPROC in its user namespace)"
    if (cgroups := _pids_cgroups()) is not None:
        return f"at most {run.max_processes} processes (a pids cgroup under {cgroups.base})"
    return (
        "NO process bound: loopd runs as root, which RLIMIT_NPROC does not bind, and no pids "
        "cgroup can be made here (a fork bomb runs until the command's timeout)"
    )


def _output(head: bytes, tail: bytes, total: int) -> str:
    """The output whole, or its head and tail with a marker saying how much of the middle
    loopd did not keep."""
    if total == len(head) + len(tail):
        return (head + tail).decode(errors="replace")
    cut = total - len(head) - len(tail)
    text = f"{head.decode(errors='replace')}\n[... {cut} bytes of output not kept ...]\n"
    return text + tail.decode(errors="replace")


async def run_command(  # noqa: PLR0913 - one command's whole context
    sandbox: Sandbox,
    command: str,
    folder: Path,
    timeout: float,
    on_output: OnOutput | None = None,
    *,
    resolve: Resolver = system_resolver,
) -> tuple[int | None, str]:
    """Run it; its exit status (None: killed at its timeout) and its output, stdout and
    stderr together; `on_output` hears that output while it runs (`LiveOutput`). Cancelling
    the caller kills it at once. `resolve`: how the proxy finds a host's addresses, where
    `sandbox.network` is a list."""
    shell = ["/bin/sh", "-c", command]
    live = on_output and LiveOutput(on_output)
    if not sandbox.enabled:
        return await _run(shell, folder, timeout, None, (), live=live)
    if why := sandbox_missing():
        raise ToolFailure(why)
    program = os.memfd_create("loopd-seccomp")
    cgroups, group, bounded = _pids_cgroups(), None, False
    env, fds = sandbox.env, [program]
    try:
        async with contextlib.AsyncExitStack() as stack:
            os.write(program, seccomp_program())
            os.lseek(program, 0, os.SEEK_SET)
            roots = sandbox.roots
            if isinstance(sandbox.network, tuple):
                rules = network_rules(sandbox.network)
                gate = await stack.enter_async_context(proxy(rules, resolve, sys.executable))
                shell, env = gate.wrap(shell), {**env, **PROXY_ENV}
                fds.append(gate.fd)
            inner = limited(
                _program("prlimit", roots), shell, sandbox.max_processes, sandbox.max_memory_mb
            )
            argv = sandbox.argv(_program("bwrap", roots), inner, folder, program)
            if cgroups is not None:
                try:
                    group = cgroups.make(sandbox.max_processes)
                except OSError as e:
                    msg = f"no cgroup could be made to bound the command: {e}"
                    raise ToolFailure(msg) from e
                # Killed with loopd from its first instant: the shell that joins the cgroup
                # runs before bubblewrap can ask for that itself.
                argv = [*_with_pdeathsig(sandbox.roots), *cgroups.joined(group, argv)]
            status, output = await _run(argv, folder, timeout, env, tuple(fds), live=live)
    finally:
        os.close(program)
        if group is not None and cgroups is not None:
            bounded = cgroups.hit_limit(group)
            with trio.CancelScope(shield=True):
                await cgroups.remove(group)
    if bounded:
        output += f"\n[loopd: the command reached its bound of {sandbox.max_processes} processes]"
    return status, output


async def _run(  # noqa: PLR0913 - one process's whole context
    argv: list[str],
    folder: Path,
    timeout: float,
    env: Mapping[str, str] | None,
    fds: tuple[int, ...],
    *,
    live: LiveOutput | None = None,
) -> tuple[int | None, str]:
    # Forked here, in loopd's own thread, not by trio.lowlevel.open_process, which forks in a
    # worker thread: a parent-death signal (bubblewrap's --die-with-parent, setpriv's) is
    # bound to the thread that forked, and trio ends an idle worker thread after 10 s, which
    # killed every command that ran longer. A fork and exec is a millisecond or two.
    process = subprocess.Popen(  # noqa: ASYNC220 - see above
        argv,
        cwd=folder,
        env=env,
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a group of its own, killed whole
    )
    head, tail, total = bytearray(), bytearray(), 0
    try:
        assert process.stdout is not None  # noqa: S101 - asked for above
        with process.stdout:
            stdout = trio.lowlevel.FdStream(os.dup(process.stdout.fileno()))
        async with stdout, trio.open_nursery() as nursery:
            if live is not None:
                nursery.start_soon(live.flushing)
            with trio.move_on_after(timeout) as deadline:
                while chunk := await stdout.receive_some(READ_CHUNK):
                    total += len(chunk)
                    room = max(KEEP_BYTES - len(head), 0)
                    head += chunk[:room]
                    if len(chunk) > room:  # the middle goes: the last KEEP_BYTES are kept
                        tail = (tail + chunk[room:])[-KEEP_BYTES:]
                    if live is not None:
                        live.take(chunk)
                await _exited(process)
            nursery.cancel_scope.cancel()
    finally:
        _kill_group(process.pid)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await _exited(process)
    if live is not None:  # the last of it, before the caller reports the result
        live.flush(final=True)
    output = _output(bytes(head), bytes(tail), total)
    if deadline.cancelled_caught:
        return None, output
    return process.returncode, output


async def _exited(process: subprocess.Popen[bytes]) -> None:
    """Until `process` has ended, reaped. Through a pidfd where the kernel has them (5.3), in
    a thread otherwise; never by trio's own child watching, which is for its processes."""
    try:
        exited = os.pidfd_open(process.pid)
    except OSError:  # ENOSYS, or a sandbox that refuses it
        await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        return
    try:
        await trio.lowlevel.wait_readable(exited)
    finally:
        os.close(exited)
    process.wait()  # it has ended: no wait


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
