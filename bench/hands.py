"""Figure 15: the cost of the agent's hands. A sandboxed `true` (bubblewrap: namespaces, the
mounts, the seccomp filter, the process bound, the hidden paths) against the same `true` run
bare, both through `run_command` (whole-process time, fork to exit), and against the sandbox of
the previous release (bubblewrap with namespaces and mounts only, spawned the same way); and an
edit of a 1 MB file through `write_file`'s machinery (read, edit, diff, both contents kept, the
log record, a temporary file, fsync, rename) against a plain write of the same bytes with one
fsync. Medians, alternating which goes first.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loopd.session.baseline import make_baseline
from loopd.session.records import UserRecord
from loopd.session.store import Store
from loopd.tools import Roots, Sandbox
from loopd.tools._run import _run, run_command
from loopd.turn.changes import Blobs, Hands

RUNS = 30
EDITS = 10


async def _command(sandbox: Sandbox, folder: Path) -> float:
    start = time.perf_counter()
    status, _ = await run_command(sandbox, "true", folder, 30)
    assert status == 0  # noqa: S101 - a figure of a failing command means nothing
    return time.perf_counter() - start


def _previous(folder: Path) -> list[str]:
    """The previous release's sandbox: `/` read-only, the root writable, a private /tmp, its
    own PID, IPC, UTS and network namespaces; no user namespace, seccomp or bound."""
    mounts = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]  # noqa: S108
    mounts += ["--bind", str(folder), str(folder)]
    spaces = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net"]
    return ["bwrap", *mounts, *spaces, "--die-with-parent", "--", "/bin/sh", "-c", "true"]


async def _before(folder: Path) -> float:
    start = time.perf_counter()
    status, _ = await _run(_previous(folder), folder, 30, None, ())
    assert status == 0  # noqa: S101 - as above
    return time.perf_counter() - start


def _plain(path: Path, data: bytes) -> float:
    start = time.perf_counter()
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


async def measure() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        folder = Path(tmp) / "work"
        folder.mkdir()
        sandboxed, bare = (
            Sandbox([folder], network=False),
            Sandbox([folder], network=False, enabled=False),
        )
        inside, outside, before = [], [], []
        for n in range(RUNS):
            if n % 2:
                outside.append(await _command(bare, folder))
                before.append(await _before(folder))
                inside.append(await _command(sandboxed, folder))
            else:
                inside.append(await _command(sandboxed, folder))
                before.append(await _before(folder))
                outside.append(await _command(bare, folder))
        lines = [
            f"line {i:07d}: the quick brown fox jumps over the lazy dog\n" for i in range(16_000)
        ]
        target, plain_target = folder / "big.txt", folder / "plain.txt"
        target.write_text("".join(lines))
        hands = Hands(Roots([folder]), Blobs(Path(tmp) / "history"))
        edits, plains = [], []
        with await Store(Path(tmp) / "sessions").create(make_baseline()) as session:
            await session.append(UserRecord(content="edit"))
            for n in range(EDITS):
                old = lines[n * 997]
                change = {"old_text": old, "new_text": old.replace("fox", "cat")}
                data = target.read_bytes().replace(old.encode(), change["new_text"].encode(), 1)
                start = time.perf_counter()
                await hands.write(
                    session, n + 1, f"c{n}", "edit_file", {"path": "big.txt", "edits": [change]}
                )
                edits.append(time.perf_counter() - start)
                plains.append(_plain(plain_target, data))
    return {
        "runs": RUNS,
        "sandboxed_ms": statistics.median(inside) * 1000,
        "bare_ms": statistics.median(outside) * 1000,
        "before_ms": statistics.median(before) * 1000,
        "edits": EDITS,
        "size": len("".join(lines)),
        "edit_ms": statistics.median(edits) * 1000,
        "plain_ms": statistics.median(plains) * 1000,
    }


def table(f: dict[str, Any]) -> list[str]:
    sandbox = f"{f['sandboxed_ms']:.1f} ms | {f['bare_ms']:.1f} ms"
    edit = f"{f['edit_ms']:.1f} ms | {f['plain_ms']:.1f} ms"
    kib = f["size"] // 1024
    return [
        "| | loopd | baseline (same run) | ratio |",
        "| --- | --- | --- | --- |",
        (
            f"| `true` in the sandbox, against bare | {sandbox} "
            f"| {f['sandboxed_ms'] / f['bare_ms']:.2f} |"
        ),
        (
            f"| `true` in the sandbox, against the previous release's | "
            f"{f['sandboxed_ms']:.1f} ms | {f['before_ms']:.1f} ms "
            f"| {f['sandboxed_ms'] / f['before_ms']:.2f} |"
        ),
        (
            f"| an edit of a {kib} KiB file, against a plain write with fsync | {edit} "
            f"| {f['edit_ms'] / f['plain_ms']:.2f} |"
        ),
    ]
