"""What a sandboxed command may ask of the kernel, and how many processes it may have.

The seccomp filter refuses (EPERM) what no command of the model's needs and an escape would:
every socket but the internet's and netlink (no Unix sockets: every daemon's door, loopd's
own included; no vsock; `socketpair` makes streams only, a datagram pair could be sent to any
socket's path), io_uring (which makes sockets past those rules),
tracing other processes, mounting, new namespaces, the kernel's keyrings, BPF and perf, and
setuid or setgid modes on files (`openat2`, whose mode it cannot see, answers ENOSYS). It is
compiled once by libseccomp (through `pyseccomp`) and handed to bubblewrap as a BPF program;
other architectures' system calls (32-bit ones on a 64-bit kernel) are killed.

The process bound: `RLIMIT_NPROC` counts a user's processes per user namespace, and each
command has a namespace of its own, so set inside it (by `prlimit`, after the namespace
exists) it bounds that command's tree alone. The kernel exempts uid 0 from it, though, so
when loopd runs as root each command gets a pids cgroup of its own instead (cgroup v2 or v1's
`pids` hierarchy; where neither can be made, `check` says so). Memory is bounded per process
(`RLIMIT_DATA`, which root cannot raise without capabilities).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import signal
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

__all__ = ["PidsCgroups", "limited", "seccomp_program", "seccomp_unavailable"]

log = logging.getLogger(__name__)

REFUSED_CALLS = (
    *("io_uring_setup", "io_uring_enter", "io_uring_register"),
    *("ptrace", "process_vm_readv", "process_vm_writev"),
    *("mount", "umount2", "pivot_root", "open_tree", "move_mount", "mount_setattr"),
    *("fsopen", "fsconfig", "fsmount", "fspick"),
    *("unshare", "setns"),
    *("keyctl", "add_key", "request_key"),
    *("bpf", "perf_event_open", "userfaultfd"),
    *("kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module"),
)
"""System calls a sandboxed command gets EPERM for, besides `socket(AF_UNIX)`."""

SOCKET_FAMILIES = frozenset({socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK})
"""The only sockets a command may make: no Unix sockets (every daemon's door, loopd's own
included), no vsock (which no network namespace bounds), no raw packets or Bluetooth."""
FAMILIES = 64
"""Above every address family Linux has (46 in 6.x)."""

MODE_ARGUMENT = {
    "chmod": 1,
    "fchmod": 1,
    "fchmodat": 2,
    "fchmodat2": 2,
    "creat": 1,
    "open": 2,
    "openat": 3,
    "mknod": 1,
    "mknodat": 2,
}
"""Where each call that sets a file's mode takes it: a mode with the setuid or setgid bit is
refused (a command loopd started as root is uid 0 on disk, and would leave a setuid-root
program in the roots for anyone to run)."""


def seccomp_unavailable() -> str | None:
    """Why no seccomp filter can be made here; None when one can."""
    try:
        seccomp_program()
    except (ImportError, RuntimeError, OSError) as e:
        return (
            f"run_command needs libseccomp to filter a command's system calls ({e}): "
            "`sudo apt install libseccomp2` (Debian, Ubuntu), `sudo dnf install libseccomp` "
            '(Fedora). Or set [tools.run] sandbox = "none" to run commands unsandboxed, on '
            "purpose."
        )
    return None


@functools.cache
def seccomp_program() -> bytes:
    """The filter as the BPF program bubblewrap's `--seccomp` reads."""
    import pyseccomp as seccomp  # noqa: PLC0415 - raises where libseccomp is missing

    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    arch = seccomp.system_arch()
    known = {name for name in (*REFUSED_CALLS, *MODE_ARGUMENT, "openat2") if _known(arch, name)}
    for name in sorted(known & set(REFUSED_CALLS)):
        rules.add_rule(refuse, name)
    _socket_rules(rules, refuse)
    # openat2 takes its mode in a struct a filter cannot read: programs fall back to openat.
    if "openat2" in known:
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "openat2")
    for name, position in MODE_ARGUMENT.items():
        if name in known:
            for bit in (stat.S_ISUID, stat.S_ISGID):
                rules.add_rule(refuse, name, seccomp.Arg(position, seccomp.MASKED_EQ, bit, bit))
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def _known(arch: int, name: str) -> bool:
    """Whether `name` is a system call of this machine."""
    import pyseccomp as seccomp  # noqa: PLC0415 - as seccomp_program

    return bool(seccomp.resolve_syscall(arch, name) >= 0)


def _socket_rules(rules: Any, refuse: int) -> None:
    import pyseccomp as seccomp  # noqa: PLC0415 - as seccomp_program

    # Sockets of the internet (in the command's own network namespace) and netlink only; the
    # kernel reads the domain as 32 bits, so the upper ones must not make it another number.
    for family in range(FAMILIES):
        if family not in SOCKET_FAMILIES:
            rules.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.MASKED_EQ, 0xFFFFFFFF, family))
    # A pair of connected streams, not datagrams, which can be sent to any socket's path.
    for kind in range(16):
        if kind not in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
            rules.add_rule(refuse, "socketpair", seccomp.Arg(1, seccomp.MASKED_EQ, 0xF, kind))


def limited(prlimit: str, argv: list[str], max_processes: int, max_memory_mb: int) -> list[str]:
    """`argv` under the process and memory rlimits, set by `prlimit` where it runs (inside the
    sandbox's user namespace, so the process count is the command's alone)."""
    memory = max_memory_mb * 1024 * 1024
    return [prlimit, f"--nproc={max_processes}", f"--data={memory}", "--", *argv]


@dataclass(frozen=True)
class PidsCgroups:
    """A pids cgroup per command, under one of loopd's own (root only: see the module)."""

    base: Path
    v2: bool
    _names = itertools.count(1)

    @classmethod
    def find(cls) -> PidsCgroups | None:
        """The cgroups commands can be put in here, or None."""
        if os.geteuid() != 0:
            return None
        top = Path("/sys/fs/cgroup")
        with contextlib.suppress(OSError):
            if "pids" in (top / "cgroup.subtree_control").read_text().split():
                base = top / "loopd.commands"
                base.mkdir(exist_ok=True)
                (base / "cgroup.subtree_control").write_text("+pids")
                return cls(base, v2=True)
        with contextlib.suppress(OSError):
            if (top / "pids" / "cgroup.procs").exists():
                base = top / "pids" / "loopd.commands"
                base.mkdir(exist_ok=True)
                return cls(base, v2=False)
        return None

    def make(self, max_processes: int) -> Path:
        """A new, empty cgroup of at most `max_processes` processes."""
        group = self.base / f"command-{os.getpid()}-{next(self._names)}"
        group.mkdir()
        try:
            (group / "pids.max").write_text(str(max_processes))
        except OSError:
            group.rmdir()
            raise
        return group

    @staticmethod
    def joined(group: Path, argv: list[str]) -> list[str]:
        """`argv`, started inside `group` (the shell joins it, then becomes `argv`)."""
        procs = str(group / "cgroup.procs")
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    @staticmethod
    def hit_limit(group: Path) -> bool:
        """Whether a fork in `group` was refused for its bound."""
        with contextlib.suppress(OSError, ValueError):
            for line in (group / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value) > 0
        return False

    async def remove(self, group: Path) -> None:
        """Kill what is left in `group`, then remove it (a cgroup goes once it is empty)."""
        pause = 0.0002  # its last processes are usually gone within a millisecond or two
        with trio.move_on_after(5):
            while True:
                try:
                    group.rmdir()  # noqa: ASYNC240 - cgroupfs: no disk, no wait
                except FileNotFoundError:
                    return
                except OSError:
                    _kill_all(group)
                    await trio.sleep(pause)
                    pause = min(pause * 2, 0.05)
                else:
                    return
        log.warning("could not remove the cgroup %s of a finished command", group)


def _kill_all(group: Path) -> None:
    with contextlib.suppress(OSError):
        if (group / "cgroup.kill").exists():
            (group / "cgroup.kill").write_text("1")
            return
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
