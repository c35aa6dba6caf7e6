"""The agent's hands, on real files and a real bubblewrap: writes and edits (planned, then
made whole through a temporary file and a rename), the refusals that keep a person's data
safe, and commands in the sandbox."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from loopd.tools import Roots, ToolFailure
from loopd.tools._run import KEEP_BYTES, Sandbox, run_command
from loopd.tools._write import WRITE_BYTES, commit, plan


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.md").write_text("one\ntwo\nthree\ntwo\n")
    return folder


def edit(roots: Roots, path: str, *pairs: tuple[str, str]) -> None:
    edits = [{"old_text": old, "new_text": new} for old, new in pairs]
    commit(plan(roots, "edit_file", {"path": path, "edits": edits}))


def test_write_creates_a_file_and_says_how_many_lines(root: Path) -> None:
    planned = plan(Roots([root]), "write_file", {"path": "new.md", "content": "a\nb\n"})
    assert planned.summary() == "Created new.md: 2 lines."
    assert "+++ b/new.md" in planned.diff
    commit(planned)
    assert (root / "new.md").read_text() == "a\nb\n"


def test_replacing_a_file_keeps_its_mode(root: Path) -> None:
    (root / "run.sh").write_text("echo hi\n")
    (root / "run.sh").chmod(0o750)
    commit(plan(Roots([root]), "write_file", {"path": "run.sh", "content": "echo bye\n"}))
    assert (root / "run.sh").read_text() == "echo bye\n"
    assert (root / "run.sh").stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in root.iterdir()) == ["notes.md", "run.sh"]  # no temp left


def test_an_edit_replaces_one_unique_piece_and_several_edits_apply_in_order(root: Path) -> None:
    roots = Roots([root])
    planned = plan(
        roots, "edit_file", {"path": "notes.md", "edits": [{"old_text": "one", "new_text": "1"}]}
    )
    assert planned.summary() == "Changed notes.md: +1 -1 lines."
    commit(planned)
    edit(roots, "notes.md", ("three", "3"), ("3\ntwo", "3\n2"))
    assert (root / "notes.md").read_text() == "1\ntwo\n3\n2\n"


def test_an_edit_whose_text_is_not_there_shows_where_it_almost_matched(root: Path) -> None:
    with pytest.raises(ToolFailure) as e:
        edit(Roots([root]), "notes.md", ("thre\ntwo", "x"))
    assert str(e.value).startswith("notes.md: the edit: old_text is not in the file.")
    assert "at line 3" in str(e.value)
    assert (root / "notes.md").read_text() == "one\ntwo\nthree\ntwo\n"


def test_an_edit_whose_text_is_not_unique_names_its_lines(root: Path) -> None:
    with pytest.raises(ToolFailure, match=r"occurs 2 times \(at lines 2, 4\)"):
        edit(Roots([root]), "notes.md", ("two", "2"))


def test_a_failing_edit_among_several_applies_none(root: Path) -> None:
    with pytest.raises(ToolFailure, match="edit 2 of 2"):
        edit(Roots([root]), "notes.md", ("one", "1"), ("missing", "x"))
    assert (root / "notes.md").read_text() == "one\ntwo\nthree\ntwo\n"


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../outside.md", "'..' is refused"),
        ("/etc/passwd", "absolute paths are refused"),
        ("link.md", "leads outside the allowed folders"),
        ("blob.bin", "is a binary file"),
        ("big.txt", "is more than loopd edits"),
        ("sub", "is a directory"),
        ("nowhere/new.md", "does not exist"),
    ],
)
def test_writes_that_could_lose_data_or_leave_the_roots_are_refused(
    root: Path, tmp_path: Path, path: str, why: str
) -> None:
    (tmp_path / "outside.md").write_text("keep\n")
    (root / "link.md").symlink_to(tmp_path / "outside.md")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / "big.txt").write_bytes(b"x" * (WRITE_BYTES + 1))
    (root / "sub").mkdir()
    with pytest.raises(ToolFailure, match=why):
        plan(Roots([root]), "write_file", {"path": path, "content": "new\n"})
    assert (tmp_path / "outside.md").read_text() == "keep\n"


def test_a_write_is_refused_when_the_file_changed_since_it_was_planned(root: Path) -> None:
    planned = plan(Roots([root]), "write_file", {"path": "notes.md", "content": "mine\n"})
    (root / "notes.md").write_text("a person's edit\n")
    with pytest.raises(ToolFailure, match="changed since this call was planned"):
        commit(planned)
    assert (root / "notes.md").read_text() == "a person's edit\n"


WRITER = """
import sys
from pathlib import Path
from loopd.tools._write import write_atomically
path = Path(sys.argv[1])
contents = [b"A" * 3_000_000, b"B" * 3_000_000]
n = 0
print("ready", flush=True)
while True:
    write_atomically(path, contents[n % 2], 0o644)
    n += 1
"""


def test_a_kill_9_in_the_middle_of_writes_leaves_the_old_or_the_new_never_a_mix(
    tmp_path: Path,
) -> None:
    target = tmp_path / "file.txt"
    target.write_bytes(b"A" * 3_000_000)
    for delay in (0.05, 0.13, 0.21, 0.37):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE
        )
        assert writer.stdout is not None
        writer.stdout.readline()
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        assert target.read_bytes() in (b"A" * 3_000_000, b"B" * 3_000_000)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "file.txt"]
    assert all(name.startswith(".file.txt.loopd-") for name in leftovers)  # never the file


# -- commands in the sandbox -------------------------------------------------------------------


async def test_a_command_sees_its_exit_status_and_output(root: Path) -> None:
    status, output = await run_command(
        Sandbox([root], network=False), "cat notes.md; exit 3", root, 10
    )
    assert (status, output) == (3, "one\ntwo\nthree\ntwo\n")


async def test_writing_outside_the_roots_fails_in_the_sandbox(root: Path, tmp_path: Path) -> None:
    elsewhere = Path.home() / f".loopd-sandbox-test-{os.getpid()}"
    beside = tmp_path / "beside.txt"  # under /tmp: the sandbox's /tmp is its own, empty one
    command = f"echo x > {elsewhere}; echo x > {beside}; echo y > inside.txt"
    status, output = await run_command(Sandbox([root], network=False), command, root, 10)
    assert "Read-only file system" in output
    assert not elsewhere.exists()
    assert not beside.exists()
    assert (root / "inside.txt").read_text() == "y\n"  # the roots are writable
    assert status == 0


async def test_the_sandbox_has_no_network_unless_asked(root: Path) -> None:
    """A server on this machine's loopback: out of reach from the sandbox's own network, in
    reach with `network = true`."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    connect = f"s = socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', {port}))"
    probe = f"{PYTHON} -c \"import socket; {connect}; print('connected')\""
    _, output = await run_command(Sandbox([root], network=False), probe, root, 10)
    assert "Connection refused" in output
    _, output = await run_command(Sandbox([root], network=True), probe, root, 10)
    assert output == "connected\n"
    for listener in listeners:
        await listener.aclose()


PYTHON = os.path.realpath(sys.executable)
"""The interpreter itself, not a venv's link to it: a venv under /tmp is out of the sandbox's
sight (its /tmp is its own)."""


async def processes() -> str:
    """Every process's command line, as `ps` shows them."""
    done = await trio.run_process(["ps", "-eo", "args"], capture_stdout=True)
    return done.stdout.decode()


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 10) -> bool:
    """Whether `check` holds within `within` seconds: a killed process is gone only once the
    kernel has delivered the signal, which a loaded machine may take a moment to do."""
    with trio.move_on_after(within):
        # Polling: nothing signals another process's end.
        while not await check():  # noqa: ASYNC110
            await trio.sleep(0.05)
        return True
    return False


SLEEPER = f"sleep 300.{os.getpid()}"
"""A command of this test run's own: another `sleep 300` on the machine is not ours."""


async def sleepers() -> list[str]:
    """Our sleepers still there, as `ps` shows them (with their parents, to say why)."""
    done = await trio.run_process(["ps", "-eo", "pid,ppid,stat,args"], capture_stdout=True)
    return [line for line in done.stdout.decode().splitlines() if SLEEPER in line]


async def no_sleeper() -> bool:
    return not await sleepers()


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped by an init that does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_a_command_past_its_timeout_is_killed_with_its_children(root: Path) -> None:
    for sandbox in (Sandbox([root], network=False), Sandbox([root], network=False, enabled=False)):
        started = time.monotonic()
        command = f"{SLEEPER} & echo $! > child.pid; wait"
        status, _ = await run_command(sandbox, command, root, 1)
        assert status is None
        assert time.monotonic() - started < 10
        if not sandbox.enabled:  # the child's pid is the machine's: it must be gone
            child = int((root / "child.pid").read_text())

            async def child_gone(child: int = child) -> bool:
                return not alive(child)

            assert await eventually(child_gone)
    assert await eventually(no_sleeper), await sleepers()


async def test_a_cancel_kills_the_command_at_once(root: Path) -> None:
    started = time.monotonic()
    with trio.move_on_after(0.5):
        await run_command(Sandbox([root], network=False), SLEEPER, root, 60)
    assert time.monotonic() - started < 5
    assert await eventually(no_sleeper), await sleepers()


async def test_output_past_what_loopd_keeps_loses_its_middle_with_a_marker(root: Path) -> None:
    command = "seq 1 300000"  # 1.9 MB
    status, output = await run_command(Sandbox([root], network=False), command, root, 30)
    assert status == 0
    assert output.startswith("1\n2\n3\n")
    assert output.endswith("299999\n300000\n")
    assert "bytes of output not kept ...]" in output
    assert len(output) < 2 * KEEP_BYTES + 100


def test_a_folder_swapped_for_a_link_during_writes_never_sends_a_write_outside(
    tmp_path: Path,
) -> None:
    """The race a model's background command can run: a folder of the root swapped, again and
    again, for a link to a folder outside, while writes into it are planned and made. Some
    writes land, some are refused; none ever lands outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            (root / "sub").rename(root / "sub.real")
            (root / "sub").symlink_to(outside)
            (root / "sub").unlink()
            (root / "sub.real").rename(root / "sub")
            time.sleep(0.0002)  # a moment as it was, for some writes to land

    swapper = threading.Thread(target=swap)
    swapper.start()
    outcomes: Counter[str] = Counter()
    try:
        for n in range(400):
            try:
                commit(plan(Roots([root]), "write_file", {"path": "sub/f.txt", "content": f"{n}"}))
                outcomes["written"] += 1
            except ToolFailure:
                outcomes["refused"] += 1
    finally:
        stop.set()
        swapper.join()
    assert list(outside.iterdir()) == []
    assert outcomes["written"] > 0
