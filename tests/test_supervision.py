"""Supervision, attacked through real processes: a session whose log can no longer be written
closes alone (`session_failed`) while loopd and every other session go on; only what leaves
loopd unable to serve anyone (its store folder, its socket gone, a slot pool that keeps
failing) stops it, saying why.
docs/architecture.md's supervision table names these tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import NO_SLOT_FILES, StartDaemon
from loopd.session.baseline import DEFAULT_SYSTEM_PROMPT, make_baseline
from loopd.session.records import (
    ApprovalRequestRecord,
    ToolResultRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store, parse_log
from support.daemon import Daemon, LineClient
from support.failing_writes import build as failing_writes_library
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

POOL_BUG = Path(__file__).resolve().parent / "support" / "pool_bug.py"

AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounts a small tmpfs in a private mount namespace: needs root and unshare",
)


async def _hello(d: Daemon, session: str) -> tuple[LineClient, str]:
    client = await d.connect()
    await client.send({"type": "hello", "session": session})
    welcome = (await client.until("welcome"))[-1]
    return client, str(welcome["session"])


async def _answer(client: LineClient, kind: str) -> dict[str, Any]:
    """The next line of type `kind`, the events before it skipped."""
    return (await client.until(kind))[-1]


def _fill(folder: Path) -> Path:
    """Fill the file system of `folder` to the last block; the file that does it."""
    filler = folder / "filler"
    space = os.statvfs(folder)
    filler.write_bytes(b"\0" * (space.f_bavail * space.f_frsize))
    assert os.statvfs(folder).f_bavail == 0
    return filler


async def _with_a_log_on_a_small_disk(
    tmp_path: Path, server: ReplayServer
) -> tuple[Daemon, Path, Path]:
    """loopd, in a mount namespace of its own, with one session's log on a small tmpfs
    (bind-mounted over its file; every other log on the real disk); the log's path, and the
    folder of the tmpfs as the test reaches it (through loopd's root in /proc)."""
    store = Store(tmp_path / "loopd" / "sessions")
    with await store.create(make_baseline(DEFAULT_SYSTEM_PROMPT)) as made:
        log_path = made.path
    small = tmp_path / "small"
    small.mkdir()
    mounts = (
        f"mount -t tmpfs -o size=256k tmpfs {small} && cp {log_path} {small}/ && "
        f'mount --bind {small / log_path.name} {log_path} && exec "$@"'
    )
    d = Daemon(
        tmp_path / "loopd",
        server.url,
        slots=NO_SLOT_FILES,
        wrap=("unshare", "--mount", "--propagation", "private", "sh", "-c", mounts, "sh"),
    )
    await d.start()
    assert d.process is not None
    return d, log_path, Path(f"/proc/{d.process.pid}/root") / small.relative_to("/")


@AS_ROOT
async def test_a_session_on_a_full_disk_fails_alone_and_opens_again_once_space_is_back(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """One session's log lives on a small tmpfs, the others on the real disk. The tmpfs fills
    up: that session gets `session_failed` while two others finish their turns and a third
    opens, and loopd answers `status` throughout; once space is back it opens again and goes
    on, its log whole."""
    answer = Reply(content=" ".join(f"w{n}" for n in range(30)), delay=0.02)
    server = ReplayServer([FakeLlama([answer] * 12)] * 12, slots=4)
    await nursery.start(server.run)
    d, log_path, small = await _with_a_log_on_a_small_disk(tmp_path, server)
    assert d.process is not None
    failing = log_path.name.removesuffix(".jsonl")
    try:
        a, _ = await _hello(d, failing)
        assert (await a.turn("a1", "remember: the kettle is blue"))[-1]["type"] == "turn_done"
        b, _ = await _hello(d, "new")
        c, _ = await _hello(d, "new")
        filler = _fill(small)

        await b.send({"type": "send", "id": "b1", "content": "a long answer, please"})
        await c.send({"type": "send", "id": "c1", "content": "another long answer"})
        await a.send({"type": "send", "id": "a2", "content": "x" * 20_000})
        failed = await _answer(a, "session_failed")
        assert failed["session"] == failing
        assert failed["fault"] == "disk_full"
        assert failed["message"].startswith("the disk is full: ")
        ended = await _answer(a, "turn_failed")
        assert (ended["id"], ended["kind"]) == ("a2", "error")

        assert (await _answer(b, "turn_done"))["id"] == "b1"
        assert (await _answer(c, "turn_done"))["id"] == "c1"
        await b.send({"type": "status"})
        assert (await _answer(b, "status"))["turns"] == 1
        _, third = await _hello(d, "new")
        assert third != failing
        await a.send({"type": "send", "id": "a3", "content": "hello?"})
        refused = await _answer(a, "error")
        assert refused["code"] == "session_unavailable"
        assert "the disk is full" in refused["message"]
        assert d.process.poll() is None

        filler.unlink()
        await a.send({"type": "open_session", "id": failing})
        assert (await _answer(a, "welcome"))["session"] == failing
        assert (await a.turn("a4", "what colour is the kettle?"))[-1]["type"] == "turn_done"
        data = (small / log_path.name).read_bytes()  # loopd's log, as loopd sees it
        _, records, torn = parse_log(log_path, data, failing)
        assert torn == 0
        assert conversation_problems(records) == []
        said = [r.content for r in records if isinstance(r, UserRecord)]
        assert said == ["remember: the kettle is blue", "what colour is the kettle?"]
        assert f"session {failing} failed: the disk is full" in d.log.read_text()
    finally:
        await d.end()


@pytest.fixture(scope="module")
def failing_writes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """loopd's environment with writes of a marked record failing (support.failing_writes)."""
    library = failing_writes_library(tmp_path_factory.mktemp("preload"))
    return {**os.environ, "LD_PRELOAD": str(library)}


@pytest.mark.parametrize(
    ("mark", "fault", "message"),
    [
        ("EIO", "io_error", "an I/O error on the session's log: "),
        ("EROFS", "read_only", "the session's log folder is read-only: "),
    ],
)
async def test_a_session_whose_log_write_fails_fails_alone_and_opens_again(
    daemon: StartDaemon, failing_writes: dict[str, str], mark: str, fault: str, message: str
) -> None:
    """A record of one session fails to write (an I/O error, a folder gone read-only): that
    session ends in `session_failed` while another's turn is answered and a third opens; the
    same session opens again and goes on, its log whole."""
    d = await daemon(FakeLlama([Reply(content="fine")]), env=failing_writes)
    assert d.process is not None
    a, failing = await _hello(d, "new")
    assert (await a.turn("a1", "first"))[-1]["type"] == "turn_done"
    b, _ = await _hello(d, "new")

    await a.send({"type": "send", "id": "a2", "content": f"this one fails @@{mark}@@"})
    failed = await _answer(a, "session_failed")
    assert (failed["session"], failed["fault"]) == (failing, fault)
    assert failed["message"].startswith(message)
    assert (await _answer(a, "turn_failed"))["id"] == "a2"
    assert (await b.turn("b1", "still there?"))[-1]["type"] == "turn_done"
    _, third = await _hello(d, "new")
    assert third != failing
    assert d.process.poll() is None

    await a.send({"type": "open_session", "id": failing})
    assert (await _answer(a, "welcome"))["session"] == failing
    assert (await a.turn("a3", "third"))[-1]["type"] == "turn_done"
    _, records, torn = Store(d.home / "sessions").read(failing)
    assert (torn, conversation_problems(list(records))) == (0, [])
    assert [r.content for r in records if isinstance(r, UserRecord)] == ["first", "third"]
    assert f"session {failing} failed: {message}" in d.log.read_text()


async def test_a_call_whose_approval_request_cannot_be_written_does_not_run(
    daemon: StartDaemon, failing_writes: dict[str, str], tmp_path: Path
) -> None:
    """The approval request of an edit (its preview shows the file's marked line) fails to
    write: the edit is not made, and the session ends in `session_failed`."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.md").write_text("@@EIO@@\nbuy milk\n")
    edit = {"path": "todo.md", "edits": [{"old_text": "milk", "new_text": "bread"}]}
    arguments = json.dumps({"name": "edit_file", "arguments": edit})
    call = Reply(tool_calls=(("c1", "call_tool", arguments),))
    tools = f'roots = ["{notes}"]\n[tools.policies.edit_file]\naction = "ask"'
    d = await daemon(FakeLlama([call, Reply(content="done")]), tools=tools, env=failing_writes)
    a, failing = await _hello(d, "new")
    await a.send({"type": "send", "id": "t1", "content": "buy bread instead"})
    failed = await _answer(a, "session_failed")
    assert (failed["session"], failed["fault"]) == (failing, "io_error")
    assert (await _answer(a, "turn_failed"))["id"] == "t1"
    assert (notes / "todo.md").read_text() == "@@EIO@@\nbuy milk\n"
    _, records, _ = Store(d.home / "sessions").read(failing)
    assert not any(isinstance(r, ApprovalRequestRecord) for r in records)


async def test_a_write_whose_file_change_record_cannot_be_written_changes_nothing(
    daemon: StartDaemon, failing_writes: dict[str, str], tmp_path: Path
) -> None:
    """A write runs without asking; its `file_change` record (the file's absolute path, in a
    folder whose name carries the mark) fails to write: the file is not made, and the session
    ends in `session_failed` rather than the model reading of a failed tool."""
    folder = tmp_path / "project-@@EIO@@"
    folder.mkdir()
    write = {"path": "todo.md", "content": "buy bread\n"}
    call = Reply(
        tool_calls=(("c1", "call_tool", json.dumps({"name": "write_file", "arguments": write})),)
    )
    tools = f'roots = ["{folder}"]\n[tools.policies.write_file]\naction = "allow"'
    d = await daemon(FakeLlama([call, Reply(content="done")]), tools=tools, env=failing_writes)
    a, failing = await _hello(d, "new")
    await a.send({"type": "send", "id": "t1", "content": "note it"})
    failed = await _answer(a, "session_failed")
    assert (failed["session"], failed["fault"]) == (failing, "io_error")
    assert (await _answer(a, "turn_failed"))["id"] == "t1"
    assert not (folder / "todo.md").exists()
    _, records, _ = Store(d.home / "sessions").read(failing)
    assert not any(isinstance(r, ToolResultRecord) and "failed" in r.content for r in records)


async def test_a_new_session_whose_log_cannot_be_made_is_refused_and_loopd_serves_the_rest(
    daemon: StartDaemon, failing_writes: dict[str, str], tmp_path: Path
) -> None:
    """Every new session's header fails to write (its system prompt carries the mark, as a full
    disk would fail it): `new` is answered `session_unavailable` saying why, nothing half made
    is left, and a session made before opens and answers."""
    store = Store(tmp_path / "loopd-0" / "sessions")  # the first daemon's
    with await store.create(make_baseline(DEFAULT_SYSTEM_PROMPT)) as made:
        before = made.id
    session = 'system_prompt = "You help. @@ENOSPC@@"\n'
    d = await daemon(FakeLlama([Reply(content="fine")]), session=session, env=failing_writes)
    assert d.home / "sessions" == store.directory
    client = await d.connect()
    await client.send({"type": "hello", "session": "new"})
    refused = await _answer(client, "error")
    assert refused["code"] == "session_unavailable"
    assert refused["message"].startswith("a new session could not be created: the disk is full: ")
    assert [p.name for p in store.directory.glob("*.jsonl*")] == [f"{before}.jsonl"]
    old, _ = await _hello(d, before)
    assert (await old.turn("t1", "hello"))[-1]["type"] == "turn_done"


async def _stops_saying(d: Daemon, client: LineClient, why: str) -> None:
    """loopd says `why` to its client, exits 1, and says it again in its log."""
    bye = await _answer(client, "bye")
    assert bye["reason"] == f"loopd stops: {why}"
    assert d.process is not None
    with trio.fail_after(30):
        assert await d.process.wait() == 1
    assert f"loopd: loopd stopped: {why}" in d.log.read_text()


async def test_loopd_stops_saying_why_when_its_store_folder_is_removed(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([Reply(content="fine")]))
    client = await d.connect()
    assert (await client.turn("t1", "hello"))[-1]["type"] == "turn_done"
    folder = d.home / "sessions"
    shutil.rmtree(folder)
    await _stops_saying(d, client, f"its store folder {folder} was removed")


async def test_loopd_stops_saying_why_when_its_socket_is_removed(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([]))
    client, _ = await _hello(d, "new")
    d.socket.unlink()
    await _stops_saying(d, client, f"its socket {d.socket} was removed")


def test_every_row_of_the_supervision_table_names_tests_that_exist() -> None:
    """docs/architecture.md's supervision table stays honest: each row names the tests that
    inject its fault, and each of them is a test function of that file."""
    docs = Path(__file__).parent.parent / "docs" / "architecture.md"
    table = docs.read_text().split("## Supervision", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 5
    for row in rows[1:]:
        cell = row.rstrip(" |").rsplit("|", 1)[1]
        named = re.findall(r"`(test_\w+\.py)::(\w+)`|`(test_\w+)`", cell)
        assert named, f"a row of the supervision table names no test: {row[:80]}"
        file = None
        for path, name, same_file in named:
            file = path or file
            assert file, f"a test named without its file: {row[:80]}"
            source = (Path(__file__).parent / file).read_text()
            assert f"def {name or same_file}(" in source, f"{file} has no {name or same_file}"


async def test_a_slot_pool_that_fails_is_restarted_and_past_its_bound_stops_loopd_saying_why(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A bug in the slot pool trips on every `status`: each is answered `busy` while the pool
    restarts, and another session's turn goes on; the sixth failure within a minute stops
    loopd, naming the pool and the error."""
    server = ReplayServer([FakeLlama([Reply(content="fine")])] * 10)
    await nursery.start(server.run)
    d = Daemon(
        tmp_path / "loopd", server.url, slots=NO_SLOT_FILES, wrap=(sys.executable, str(POOL_BUG))
    )
    await d.start()
    try:
        a, _ = await _hello(d, "new")
        for _ in range(5):
            await a.send({"type": "status"})
            refused = await _answer(a, "error")
            assert refused["code"] == "busy"
            assert refused["message"] == (
                "the slot pool failed (KeyError: 'a bug') while it held this request: send it again"
            )
        b, _ = await _hello(d, "new")
        assert (await b.turn("b1", "hello"))[-1]["type"] == "turn_done"
        await a.send({"type": "status"})
        why = "the slot pool failed 6 times within 60 s, the last time with KeyError: 'a bug'"
        await _stops_saying(d, a, why)
        assert "the slot pool failed, and starts again (5 of 5 restarts within 60 s)" in (
            d.log.read_text()
        )
    finally:
        await d.end()
