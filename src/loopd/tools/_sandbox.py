"""What a command the model runs sees: the bubblewrap command line around it.

Mounts, in order of depth so that the most specific wins: the whole filesystem read-only, a
private /tmp, the roots read-write, then inside them each repository's `.git` read-only again
(its hooks and config name programs git runs as the person, outside any sandbox, and so can a
`commondir` or a submodule's folder in it), and over everything loopd's own files, the user's
keys and root's secrets hidden (an empty read-only folder; for a file, `/dev/null`, which
bubblewrap's `nodev` binds make unopenable: "Permission denied"). Every folder between a root
and a path protected inside it is bound onto itself: a mount point cannot be renamed, so a
command cannot move a protected path aside and put its own in its place. A hidden folder that
holds a root or the home folder is not hidden whole (see `_roots.hideable`); the entries named
inside it are.

Privilege: a user namespace of its own (`--unshare-user`, `--disable-userns`), every
capability dropped, no new privileges, and the seccomp filter of `_bounds`: a command that
loopd started as root cannot remount `/`, mount, trace loopd or open a Unix socket. Its own
PID, IPC, UTS and cgroup namespaces, and no network unless `[tools.run] network` is true; a
list of domains there keeps the network namespace its own too, and `_proxy` is its one way
out. Its environment is built anew (`environment`): nothing of loopd's but a few harmless
variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loopd.config import KEPT_ENV, SECRETS, RunConfig

from ._roots import hideable

__all__ = ["ROOT_SECRETS", "Sandbox", "environment", "secrets"]

TMP = "/tmp"  # noqa: S108 - the sandbox's own, empty /tmp
SHM = "/dev/shm"  # noqa: S108 - and its own shared memory
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def environment(extra: Mapping[str, str], of: Mapping[str, str] | None = None) -> dict[str, str]:
    """A command's whole environment: a few of `of`'s (loopd's) variables, `TMPDIR`, then
    `extra` (`[tools.run] env`)."""
    source = os.environ if of is None else of
    kept = {k: v for k, v in source.items() if k in KEPT_ENV or k.startswith("LC_")}
    return {"PATH": DEFAULT_PATH, **kept, "TMPDIR": TMP, **extra}


ROOT_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/security/opasswd")
"""Files only root reads, which a command started by root could read (it is uid 0 on disk)."""


def secrets(run: RunConfig) -> list[Path]:
    """The user's keys (less `allow_read`, with `deny_read`), and the machine's."""
    allowed = {p.expanduser() for p in run.allow_read}
    defaults = [Path(s).expanduser() for s in SECRETS]
    machine = [Path(s) for s in ROOT_SECRETS] + sorted(Path("/etc/ssh").glob("ssh_host_*_key"))
    mine = [p for p in defaults if p not in allowed] + [p.expanduser() for p in run.deny_read]
    return mine + machine


@dataclass(frozen=True)
class Sandbox:
    roots: Sequence[Path]
    """Writable inside; everything else read-only."""
    network: bool | tuple[str, ...] = False
    """True: the machine's network; False: none; domains: those alone, through `_proxy`."""
    enabled: bool = True
    """False: `sandbox = "none"`, the command runs unconfined."""
    hidden: Sequence[Path] = field(default_factory=lambda: secrets(RunConfig()))
    """Files and folders commands cannot read: loopd's own and the user's keys."""
    env: Mapping[str, str] = field(default_factory=lambda: environment({}))
    """The command's whole environment."""
    max_processes: int = RunConfig().max_processes
    max_memory_mb: int = RunConfig().max_memory_mb
    git_writable: bool = False
    """`[tools.run] git_writable`: the roots' `.git` folders left writable."""

    @classmethod
    def of(cls, run: RunConfig, roots: Sequence[Path], private: Sequence[Path]) -> Sandbox:
        return cls(
            roots,
            run.network if isinstance(run.network, bool) else tuple(run.network),
            run.sandbox == "bubblewrap",
            [*private, *secrets(run)],
            environment(run.env),
            run.max_processes,
            run.max_memory_mb,
            run.git_writable,
        )

    def within(self, roots: Sequence[Path]) -> Sandbox:
        """The same sandbox around other roots (a session's own folder)."""
        return Sandbox(
            roots,
            self.network,
            self.enabled,
            self.hidden,
            self.env,
            self.max_processes,
            self.max_memory_mb,
            self.git_writable,
        )

    def argv(self, bwrap: str, command: list[str], folder: Path, seccomp_fd: int) -> list[str]:
        """bubblewrap's command line (`bwrap`: its absolute path) around `command`, run in
        `folder`."""
        # /dev read-only once /dev/shm is in it: its device nodes still work, and nothing else
        # can be put in a filesystem as large as half the machine's memory.
        argv = [bwrap, *_in_order(self._mounts(folder)), "--remount-ro", "/dev"]
        argv += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if self.network is not True:
            argv.append("--unshare-net")
        argv += ["--seccomp", str(seccomp_fd), "--new-session", "--die-with-parent"]
        return [*argv, "--chdir", str(folder), "--", *command]

    def _mounts(self, folder: Path) -> list[tuple[Path, list[str]]]:
        size = str(self.max_memory_mb * 1024 * 1024)  # memory, as much as one process may take
        mounts = [(Path("/"), ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])]
        mounts.append((Path(SHM), ["--size", size, "--tmpfs", SHM]))
        mounts.append((Path(TMP), ["--size", size, "--tmpfs", TMP]))
        mounts += [(root, ["--bind", str(root), str(root)]) for root in self.roots]
        protected: list[tuple[Path, list[str]]] = []
        if not self.git_writable:
            protected += [(git, ["--ro-bind", str(git), str(git)]) for git in self._gits(folder)]
        hidden = hideable(self.hidden, self.roots)
        for path in hidden:
            if _inside_any(path, hidden):
                continue  # hidden with the folder it is in
            if path.is_dir():
                protected.append((path, ["--tmpfs", str(path), "--remount-ro", str(path)]))
            elif path.exists():
                protected.append((path, ["--ro-bind", "/dev/null", str(path)]))
        masked = [path for path, args in protected if args[0] == "--tmpfs"]
        protected = [(p, a) for p, a in protected if not _inside_any(p, masked)]
        pins = {pin for path, _ in protected for pin in self._between(path)}
        pins = {pin for pin in pins if not _inside_any(pin, masked) and pin not in masked}
        mounts += [(pin, ["--bind", str(pin), str(pin)]) for pin in sorted(pins)]
        return mounts + protected

    def _between(self, path: Path) -> list[Path]:
        """The folders strictly between `path` and the root it is in (none outside roots)."""
        for root in self.roots:
            if path.is_relative_to(root) and path != root:
                return [p for p in path.parents if p.is_relative_to(root) and p != root]
        return []

    def _gits(self, folder: Path) -> list[Path]:
        """What git reads, inside the roots, for the repositories at a root, right inside one,
        and at the command's folder and above it up to its root (`_git_paths`)."""
        found: dict[Path, None] = {}
        for root in self.roots:
            candidates = [root, *_folders_in(root)]
            if folder.is_relative_to(root):
                candidates += [p for p in (folder, *folder.parents) if p.is_relative_to(root)]
            for candidate in candidates:
                for git in _git_paths(candidate / ".git"):
                    if any(git.is_relative_to(r) for r in self.roots):
                        found[git] = None
        return list(found)


def _inside_any(path: Path, folders: list[Path]) -> bool:
    """Whether `path` is strictly inside one of `folders` (all absolute and resolved). As
    strings: pathlib's `is_relative_to` parses both paths anew each time, and this runs for
    every pair of mounts of every command."""
    text = str(path)
    return any(text.startswith(str(folder).rstrip("/") + "/") for folder in folders)


def _git_paths(dot_git: Path) -> list[Path]:
    """What git reads for a `.git`: the folder (or what a link names), or a `.git` file (a
    worktree's, a submodule's: it could be pointed at a folder a command made) and the
    folder its `gitdir` names."""
    try:
        if dot_git.is_dir():
            return [dot_git.resolve(strict=True)]
        if dot_git.is_file():
            real = dot_git.resolve(strict=True)
            text = real.read_text(errors="replace")
            if text.startswith("gitdir:"):
                named = (real.parent / text.removeprefix("gitdir:").strip()).resolve()
                return [real, named] if named.is_dir() else [real]
            return [real]
    except (OSError, RuntimeError):  # unreadable, a link loop: git cannot use it either
        pass
    return []


def _folders_in(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _in_order(mounts: list[tuple[Path, list[str]]]) -> list[str]:
    """The mounts' arguments, shallowest first: a deeper mount covers a shallower one."""
    ordered = sorted(mounts, key=lambda mount: len(mount[0].parts))
    return [arg for _, args in ordered for arg in args]
