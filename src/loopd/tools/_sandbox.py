"""What a command the model runs sees: the bubblewrap command line around it.

Mounts, in order of depth so that the most specific wins: the whole filesystem read-only, a
private /tmp, the roots read-write, then inside them `.git/hooks` and `.git/config` read-only
again (a hook runs as the person at their next commit, outside any sandbox), and over
everything loopd's own files and the user's keys hidden (an empty folder, an empty file).
A hidden folder that holds a root or the home folder is not hidden whole (see
`_roots.hideable`); the entries named inside it are.

Privilege: a user namespace of its own (`--unshare-user`, `--disable-userns`), every
capability dropped, no new privileges, and the seccomp filter of `_bounds`: a command that
loopd started as root cannot remount `/`, mount, trace loopd or open a Unix socket. Its own
PID, IPC, UTS and cgroup namespaces, and no network unless `[tools.run] network`. Its
environment is built anew (`environment`): nothing of loopd's but a few harmless variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loopd.config import KEPT_ENV, SECRETS, RunConfig

from ._roots import hideable

__all__ = ["Sandbox", "environment"]

TMP = "/tmp"  # noqa: S108 - the sandbox's own, empty /tmp
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def environment(extra: Mapping[str, str], of: Mapping[str, str] | None = None) -> dict[str, str]:
    """A command's whole environment: a few of `of`'s (loopd's) variables, `TMPDIR`, then
    `extra` (`[tools.run] env`)."""
    source = os.environ if of is None else of
    kept = {k: v for k, v in source.items() if k in KEPT_ENV or k.startswith("LC_")}
    return {"PATH": DEFAULT_PATH, **kept, "TMPDIR": TMP, **extra}


def _secrets(run: RunConfig) -> list[Path]:
    allowed = {p.expanduser() for p in run.allow_read}
    defaults = [Path(s).expanduser() for s in SECRETS]
    return [p for p in defaults if p not in allowed] + [p.expanduser() for p in run.deny_read]


@dataclass(frozen=True)
class Sandbox:
    roots: Sequence[Path]
    """Writable inside; everything else read-only."""
    network: bool = False
    enabled: bool = True
    """False: `sandbox = "none"`, the command runs unconfined."""
    hidden: Sequence[Path] = field(default_factory=lambda: _secrets(RunConfig()))
    """Files and folders commands cannot read: loopd's own and the user's keys."""
    env: Mapping[str, str] = field(default_factory=lambda: environment({}))
    """The command's whole environment."""
    max_processes: int = RunConfig().max_processes
    max_memory_mb: int = RunConfig().max_memory_mb

    @classmethod
    def of(cls, run: RunConfig, roots: Sequence[Path], private: Sequence[Path]) -> Sandbox:
        return cls(
            roots,
            run.network,
            run.sandbox == "bubblewrap",
            [*private, *_secrets(run)],
            environment(run.env),
            run.max_processes,
            run.max_memory_mb,
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
        )

    def argv(self, command: list[str], folder: Path, seccomp_fd: int) -> list[str]:
        """bubblewrap's command line around `command`, run in `folder`."""
        argv = ["bwrap", *_in_order(self._mounts(folder))]
        argv += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.network:
            argv.append("--unshare-net")
        argv += ["--seccomp", str(seccomp_fd), "--new-session", "--die-with-parent"]
        return [*argv, "--chdir", str(folder), "--", *command]

    def _mounts(self, folder: Path) -> list[tuple[Path, list[str]]]:
        mounts = [(Path("/"), ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])]
        mounts.append((Path(TMP), ["--tmpfs", TMP]))
        mounts += [(root, ["--bind", str(root), str(root)]) for root in self.roots]
        for git in self._repositories(folder):
            hooks, config = git / "hooks", git / "config"
            if hooks.is_dir() and not hooks.is_symlink():
                mounts.append((hooks, ["--ro-bind", str(hooks), str(hooks)]))
            else:  # made, empty and read-only: nothing can be put there to run later
                mounts.append((hooks, ["--tmpfs", str(hooks), "--remount-ro", str(hooks)]))
            if config.is_file() and not config.is_symlink():
                mounts.append((config, ["--ro-bind", str(config), str(config)]))
        hidden = hideable(self.hidden, self.roots)
        for path in hidden:
            if any(path != other and path.is_relative_to(other) for other in hidden):
                continue  # hidden with the folder it is in
            if path.is_dir():
                mounts.append((path, ["--tmpfs", str(path), "--remount-ro", str(path)]))
            elif path.exists():
                mounts.append((path, ["--ro-bind", "/dev/null", str(path)]))
        return mounts

    def _repositories(self, folder: Path) -> list[Path]:
        """The `.git` folders of the roots, of the folders right inside them, and of the
        command's folder and those above it up to its root."""
        found: dict[Path, None] = {}
        for root in self.roots:
            candidates = [root, *_folders_in(root)]
            if folder.is_relative_to(root):
                candidates += [p for p in (folder, *folder.parents) if p.is_relative_to(root)]
            for candidate in candidates:
                git = candidate / ".git"
                if git.is_dir() and not git.is_symlink():
                    found[git] = None
        return list(found)


def _folders_in(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _in_order(mounts: list[tuple[Path, list[str]]]) -> list[str]:
    """The mounts' arguments, shallowest first: a deeper mount covers a shallower one."""
    ordered = sorted(mounts, key=lambda mount: len(mount[0].parts))
    return [arg for _, args in ordered for arg in args]
