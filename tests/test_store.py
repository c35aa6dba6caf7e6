"""The append-only store: whole records on disk, torn tails cut, one writer per session."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from loopd.infer import Timings
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    FORMAT,
    AssistantRecord,
    ModeRecord,
    PromptRecord,
    Record,
    ToolResultRecord,
    TurnEndRecord,
    UsageRecord,
    UserRecord,
    dump,
)
from loopd.session.store import (
    CorruptLog,
    Fork,
    Listing,
    ParentCall,
    Session,
    SessionLocked,
    Store,
    StoreError,
    UnknownSession,
    new_session_id,
)
from support.records import records

BASELINE = make_baseline("Be brief.")


async def test_a_new_session_is_a_log_with_its_header(tmp_path: Path) -> None:
    store = Store(tmp_path / "sessions")
    with await store.create(BASELINE) as session:
        lines = session.path.read_bytes().splitlines()
    assert len(lines) == 1
    header = json.loads(lines[0])
    assert header["kind"] == "session"
    assert header["id"] == session.id
    assert header["baseline"]["system"] == "Be brief."
    assert header["format"] == FORMAT
    assert session.path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in session.path.parent.iterdir()] == [session.path.name]


async def test_an_append_is_on_disk_when_it_returns(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        await session.append(UserRecord(content="hello"))
        on_disk = session.path.read_bytes().splitlines()
    assert json.loads(on_disk[-1])["content"] == "hello"


async def test_a_record_added_is_written_at_once_and_durable_after_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's question: written at once, fsynced while its request goes."""
    synced: list[int] = []  # the log's size each fsync made durable
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", fsync)
    with await Store(tmp_path).create(BASELINE) as session:
        synced.clear()
        await session.add(UserRecord(content="hello"))
        assert session.records[-1].kind == "user"
        assert json.loads(session.path.read_bytes().splitlines()[-1])["content"] == "hello"
        assert synced == []  # not waited for
        await session.sync()
        assert json.loads(session.path.read_bytes().splitlines()[-1])["content"] == "hello"
        assert synced == [session.path.stat().st_size]
        await session.sync()  # nothing new to write
        await session.add(UserRecord(content="again"))
        await session.append(TurnEndRecord(reason="answer"))  # writes what was added first
        assert synced == [synced[0], session.path.stat().st_size]
    with await Store(tmp_path).open(session.id) as reopened:
        assert [r.kind for r in reopened.records] == ["user", "user", "turn_end"]


async def test_a_sync_that_fails_keeps_what_was_added_for_the_next_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def fsync(_fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with await Store(tmp_path).create(BASELINE) as session:
        await session.add(UserRecord(content="hello"))
        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(StoreError, match="cannot append a record"):
            await session.sync()
        assert session.records[-1].kind == "user"
        monkeypatch.setattr(os, "fsync", real_fsync)
        await session.append(TurnEndRecord(reason="error"))
    with await Store(tmp_path).open(session.id) as reopened:
        assert [r.kind for r in reopened.records] == ["user", "turn_end"]


async def test_an_add_that_cannot_write_keeps_nothing_and_leaves_the_log_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write

    def full(_fd: int, _data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with await Store(tmp_path).create(BASELINE) as session:
        await session.add(UserRecord(content="kept"))
        size = session.path.stat().st_size
        monkeypatch.setattr(os, "write", full)
        with pytest.raises(StoreError, match="No space left"):
            await session.add(UserRecord(content="lost"))
        assert [r.kind for r in session.records] == ["user"]
        monkeypatch.setattr(os, "write", real_write)
        # The failed write cut the log back to its durable end; what was added before is
        # written again ahead of the next record.
        assert session.path.stat().st_size < size
        await session.append(TurnEndRecord(reason="error"))
    with await Store(tmp_path).open(session.id) as reopened:
        assert [(r.kind, getattr(r, "content", None)) for r in reopened.records] == [
            ("user", "kept"),
            ("turn_end", None),
        ]


async def test_a_record_added_is_in_the_log_of_a_process_killed_before_any_fsync(
    tmp_path: Path,
) -> None:
    """kill -9 between a question's write and its fsync (a request under way): the kernel
    holds what was written, so the log a restart opens has the question."""
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    with running(ADDER, str(tmp_path), session.id) as adder:
        adder.wait()  # it kills itself, the fsync never made
    with await store.open(session.id) as reopened:
        assert [(r.kind, getattr(r, "content", None)) for r in reopened.records] == [
            ("user", "asked")
        ]


async def test_a_record_added_while_an_append_is_written_keeps_the_logs_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A question added while another task's record is being written (a slow disk): it is
    neither lost nor put before that record, in memory or in the log."""
    real_fsync, writing = os.fsync, threading.Event()

    def slow_fsync(fd: int) -> None:
        writing.set()
        time.sleep(0.2)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    with await Store(tmp_path).create(BASELINE) as session:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.append, TurnEndRecord(reason="answer"))
            await trio.to_thread.run_sync(writing.wait)
            await session.add(UserRecord(content="next"))
        await session.sync()
        kinds = [r.kind for r in session.records]
    with await Store(tmp_path).open(session.id) as reopened:
        assert [r.kind for r in reopened.records] == kinds == ["turn_end", "user"]


async def test_a_reopened_session_has_the_same_records(tmp_path: Path) -> None:
    store = Store(tmp_path)
    appended: list[Record] = [
        UserRecord(content="a"),
        ToolResultRecord(call=1, tool_call_id="c", name="t", content="r", data_class="secret"),
    ]
    with await store.create(BASELINE) as session:
        for record in appended:
            await session.append(record)
    with await store.open(session.id) as reopened:
        assert list(reopened.records) == appended
        assert reopened.header == session.header


async def test_a_session_keeps_its_token_exact_prompt_as_records_come(tmp_path: Path) -> None:
    """The prompt up to the last answer is kept, not read out of the whole log before each
    request; kept and reopened, it is what the records say."""
    store = Store(tmp_path)
    answer = AssistantRecord(content="a", tokens=(1, 2), ended=True)

    def kept(session: Session) -> tuple[list[object], AssistantRecord, int] | None:
        last = session.trail.last()
        return None if last is None else (list(last[0]), last[1], last[2])

    with await store.create(BASELINE) as session:
        assert kept(session) is None
        await session.add(UserRecord(content="q"))
        await session.append(PromptRecord(text="<q>", full=True))
        await session.append(answer)
        assert kept(session) == (["<q>"], answer, 2)
        await session.add(UserRecord(content="r"))
        await session.append(PromptRecord(text="<r>", trim=1))
        assert kept(session) is None  # its answer is to come
        await session.append(answer)
        assert kept(session) == (["<q>", 1, "<r>"], answer, 5)
    with await store.open(session.id) as reopened:
        assert kept(reopened) == (["<q>", 1, "<r>"], answer, 5)


async def test_tool_result_class_is_written_as_class(tmp_path: Path) -> None:
    with await Store(tmp_path).create(BASELINE) as session:
        await session.append(
            ToolResultRecord(call=1, tool_call_id="c", name="t", content="r", data_class="private")
        )
        line = json.loads(session.path.read_bytes().splitlines()[-1])
    assert line["class"] == "private"
    assert "data_class" not in line


async def test_next_call_numbers_calls_across_the_session_and_a_restart(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        assert [session.next_call(), session.next_call()] == [1, 2]
        await session.append(ToolResultRecord(call=2, tool_call_id="c", name="t", content=""))
    with await store.open(session.id) as reopened:
        assert reopened.next_call() == 3


async def test_last_usage_is_the_latest_usage_record(tmp_path: Path) -> None:
    t = Timings(cache_n=1, prompt_n=2, prompt_ms=1, predicted_n=3, predicted_ms=1)
    with await Store(tmp_path).create(BASELINE) as session:
        assert session.last_usage() is None
        await session.append(UsageRecord(timings=t, reasoning_tokens=1))
        await session.append(UsageRecord(timings=t, reasoning_tokens=2))
        await session.append(UserRecord(content="x"))
        usage = session.last_usage()
    assert usage is not None
    assert usage.reasoning_tokens == 2


async def test_a_second_header_cannot_be_appended(tmp_path: Path) -> None:
    with (
        await Store(tmp_path).create(BASELINE) as session,
        pytest.raises(StoreError, match="one header"),
    ):
        await session.append(session.header)


async def test_sessions_lists_turns_and_last_activity_oldest_first(tmp_path: Path) -> None:
    store = Store(tmp_path)
    assert await store.sessions() == []
    assert store.latest() is None
    with await store.create(BASELINE) as first:
        await first.append(UserRecord(content='he said "kind":"user"'))
        await first.append(UserRecord(content="again"))
    with await store.create(BASELINE) as second:
        pass
    listed = await store.sessions()
    assert [(s.id, s.turns) for s in listed] == [(first.id, 2), (second.id, 0)]
    assert listed[0].last_activity >= listed[0].created
    assert store.latest() == second.id


async def test_the_list_says_which_turn_is_open_and_keeps_a_log_with_a_torn_tail(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        await session.append(UserRecord(content="one"))
        await session.append(TurnEndRecord(reason="answer"))
        await session.append(UserRecord(content="two"))
    (listed,) = await store.sessions()
    assert (listed.turns, listed.open_turn) == (2, True)
    with session.path.open("ab") as log:
        log.write(b'{"kind":"turn_end","reason":"ans')  # torn: the crash came mid-write
    (listed,) = await store.sessions()
    assert (listed.turns, listed.open_turn) == (2, True)
    assert listed.last_activity == session.records[-1].time


async def test_the_list_says_which_logs_do_not_read_and_why_in_a_line(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as good:
        await good.append(UserRecord(content="one"))
    bad = {
        "20260101T000000000Z-000001": b"not a log\n",
        "20260101T000000000Z-000002": b"",
        "20260101T000000000Z-000003": dump(UserRecord(content="hi")),
        "20260101T000000000Z-000004": good.path.read_bytes(),
        "20260101T000000000Z-000005": good.path.read_bytes().replace(
            good.id.encode(), b"20260101T000000000Z-000005"
        )
        + b"{}\n",
    }
    for name, data in bad.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
    listing = await store.listing()
    assert [s.id for s in listing.sessions] == [good.id]
    assert [(u.id, u.reason) for u in listing.unreadable] == [
        (
            "20260101T000000000Z-000001",
            "line 1: not a record: Invalid JSON: expected ident at line 1 column 2",
        ),
        ("20260101T000000000Z-000002", "line 1: the log is empty: it has no session header"),
        (
            "20260101T000000000Z-000003",
            "line 1: the first record is 'user', not the session header",
        ),
        ("20260101T000000000Z-000004", f"line 1: the header names another session, {good.id}"),
        (
            "20260101T000000000Z-000005",
            "line 3: not a record: Unable to extract tag using discriminator 'kind'",
        ),
    ]


async def test_a_session_that_continues_another_names_it_in_header_and_list(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as first:
        pass
    with await store.create(BASELINE, continues=first.id) as second:
        pass
    header, _, _ = store.read(second.id)
    assert (header.continues, store.read(first.id)[0].continues) == (first.id, None)
    listed = await store.sessions()
    assert [(s.id, s.continues) for s in listed] == [(first.id, None), (second.id, first.id)]


async def test_a_session_of_its_header_alone_is_removed_and_no_longer_listed(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as empty:
        pass
    assert await store.discard_if_empty(empty.id)
    assert not empty.path.exists()
    assert await store.listing() == Listing([], [])
    assert not await store.discard_if_empty(empty.id)  # gone already: nothing to do


async def test_a_sub_agent_made_to_follow_its_parent_keeps_the_stricter_of_their_modes(
    tmp_path: Path,
) -> None:
    """Its parent is given when it is made (`follows`), never written into it afterwards."""
    store = Store(tmp_path)
    with await store.create(BASELINE, mode="accept_edits") as parent:
        call = ParentCall(parent.id, 1, "c1")
        with await store.create(
            BASELINE, parent=call, mode="accept_edits", follows=parent
        ) as child:
            await parent.append(ModeRecord(mode="read_only"))
            assert (child.follows, child.mode, child.own_mode) == (
                parent,
                "read_only",
                "accept_edits",
            )


async def test_a_session_with_any_record_is_never_removed(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        await session.append(ModeRecord(mode="read_only"))
    assert not await store.discard_if_empty(session.id)
    assert [s.id for s in await store.sessions()] == [session.id]


async def test_an_empty_session_that_another_names_or_that_continues_one_is_kept(
    tmp_path: Path,
) -> None:
    """Neither the session a continuation, a fork or a sub-agent's names, nor one of those."""
    store = Store(tmp_path)
    named = []
    for relation in ("continues", "parent", "fork"):
        with await store.create(BASELINE) as first:
            pass
        named.append(first.id)
        if relation == "continues":
            made = await store.create(BASELINE, continues=first.id)
        elif relation == "parent":
            made = await store.create(BASELINE, parent=ParentCall(first.id, 1, "c1"))
        else:
            made = await store.create(BASELINE, fork=Fork(first.id, 1, []))
        made.close()
        named.append(made.id)
    for session_id in named:
        assert not await store.discard_if_empty(session_id)
    assert [s.id for s in await store.sessions()] == named


async def test_an_empty_session_held_open_is_not_removed(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        assert not await store.discard_if_empty(session.id)
        assert session.path.exists()


def test_session_ids_sort_by_creation_time() -> None:
    t = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    ids = [new_session_id(t + timedelta(milliseconds=ms)) for ms in (0, 1, 999, 1000, 86_400_000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


async def test_ids_made_in_one_millisecond_sort_in_the_order_they_were_made(
    tmp_path: Path,
) -> None:
    ids = [new_session_id() for _ in range(200)]
    assert ids == sorted(ids)
    store = Store(tmp_path)
    made = []
    for _ in range(50):  # as fast as the store makes them: many in one millisecond
        with await store.create(BASELINE) as session:
            made.append(session.id)
    assert made == sorted(made)
    assert [s.id for s in await store.sessions()] == made


async def test_opening_an_unknown_session_says_so(tmp_path: Path) -> None:
    with pytest.raises(UnknownSession):
        await Store(tmp_path).open("20261130T000000000Z-000000")
    with pytest.raises(UnknownSession):
        await Store(tmp_path).open("../elsewhere")


async def test_a_corrupt_line_in_the_middle_names_the_file_and_line(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        for n in range(3):
            await session.append(UserRecord(content=str(n)))
    lines = session.path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"kind": "user", "content": 5}\n'
    session.path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptLog, match=rf"{session.path.name}:3: not a record") as caught:
        await store.open(session.id)
    assert caught.value.line == 3
    assert session.path.read_bytes() == b"".join(lines)  # nothing was cut or changed


async def test_a_log_whose_first_line_is_not_a_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "20261130T000000000Z-000000.jsonl"
    path.write_bytes(dump(UserRecord(content="hi")))
    with pytest.raises(CorruptLog, match=":1: the first record is 'user'"):
        await Store(tmp_path).open(path.stem)


async def test_a_log_of_a_newer_format_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    header = session.header.model_copy(update={"format": FORMAT + 1})
    session.path.write_bytes(dump(header))
    with pytest.raises(CorruptLog, match="upgrade loopd"):
        await store.open(session.id)


async def test_old_records_without_newer_fields_still_load(tmp_path: Path) -> None:
    """A tool_result written before `class`, `untrusted` and `truncated` existed."""
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    old = {
        "kind": "tool_result",
        "time": "2026-01-01T00:00:00Z",
        "call": 1,
        "tool_call_id": "c",
        "name": "t",
        "content": "r",
        "from_the_future": 1,
    }
    with session.path.open("ab") as f:
        f.write(json.dumps(old).encode() + b"\n")
    with await store.open(session.id) as reopened:
        (record,) = reopened.records
    assert isinstance(record, ToolResultRecord)
    assert (record.data_class, record.untrusted, record.truncated) == ("public", False, False)


async def test_cancelling_appends_never_leaves_the_log_and_memory_apart(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        for n in range(20):
            with trio.move_on_after(0.0001 * n):
                await session.append(UserRecord(content="x" * 100_000))
        in_memory = list(session.records)
    with await store.open(session.id) as reopened:
        assert list(reopened.records) == in_memory


# -- torn last lines -------------------------------------------------------------------------


def _write_log(directory: Path, appended: list[Record]) -> tuple[Store, str]:
    async def write() -> tuple[Store, str]:
        store = Store(directory)
        with await store.create(BASELINE) as session:
            for record in appended:
                await session.append(record)
        return store, session.id

    return trio.run(write)


def _reopen(store: Store, session_id: str) -> list[Record]:
    async def read() -> list[Record]:
        with await store.open(session_id) as session:
            return list(session.records)

    return trio.run(read)


@settings(max_examples=40, deadline=None)
@given(appended=st.lists(records, min_size=1, max_size=6))
def test_a_cut_anywhere_in_the_last_record_keeps_every_record_before_it(
    appended: list[Record],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store, session_id = _write_log(Path(tmp), appended)
        path = store.path_of(session_id)
        whole = path.read_bytes()
        last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
        for cut in range(last_start, len(whole)):
            path.write_bytes(whole[:cut])
            assert _reopen(store, session_id) == appended[:-1]
            assert path.read_bytes() == whole[:last_start]  # the torn tail is gone


@settings(max_examples=40, deadline=None)
@given(appended=st.lists(records, min_size=1, max_size=8), data=st.data())
def test_a_cut_at_any_offset_keeps_exactly_the_whole_records_before_it(
    appended: list[Record], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store, session_id = _write_log(Path(tmp), appended)
        path = store.path_of(session_id)
        whole = path.read_bytes()
        header_end = whole.index(b"\n") + 1
        cut = data.draw(st.integers(min_value=header_end, max_value=len(whole)), label="cut")
        path.write_bytes(whole[:cut])
        complete_lines = whole[:cut].count(b"\n") - 1  # less the header
        assert _reopen(store, session_id) == appended[:complete_lines]


async def test_a_log_torn_inside_its_header_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    session.path.write_bytes(session.path.read_bytes()[:20])
    with pytest.raises(CorruptLog, match="no session header"):
        await store.open(session.id)


# -- real processes --------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, trio
    from pathlib import Path
    from loopd.session.store import Store
    async def main():
        with await Store(Path(sys.argv[1])).open(sys.argv[2]):
            print("holding", flush=True)
            await trio.sleep(60)
    trio.run(main)
""")

APPENDER = textwrap.dedent("""
    import sys, trio
    from pathlib import Path
    from loopd.session.store import Store
    from loopd.session.records import UserRecord
    async def main():
        with await Store(Path(sys.argv[1])).open(sys.argv[2]) as session:
            print("appending", flush=True)
            n = 0
            while True:
                n += 1
                await session.append(UserRecord(content=f"{n:06d}" * 50_000))
    trio.run(main)
""")

ADDER = textwrap.dedent("""
    import os, signal, sys, trio
    from pathlib import Path
    from loopd.session.store import Store
    from loopd.session.records import UserRecord
    async def main():
        with await Store(Path(sys.argv[1])).open(sys.argv[2]) as session:
            print("holding", flush=True)
            os.fsync = lambda fd: signal.pause()  # a disk that never finishes
            await session.add(UserRecord(content="asked"))
            os.kill(os.getpid(), signal.SIGKILL)
    trio.run(main)
""")


@contextmanager
def running(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child that says it is ready on its first line; SIGKILLed on the way out."""
    with subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline().strip() in {"holding", "appending"}
            yield process
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait()


async def test_a_second_process_cannot_take_the_writer_lock(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    with (
        running(HOLDER, str(tmp_path), session.id),
        pytest.raises(SessionLocked, match="open for writing by another process"),
    ):
        await store.open(session.id)
    with await store.open(session.id):  # free again once the holder is gone
        pass


async def test_a_process_killed_mid_append_leaves_a_log_that_opens(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    with running(APPENDER, str(tmp_path), session.id):
        # Let it write a good number of large records, then kill it wherever it is.
        while session.path.stat().st_size < 21 * 300_000:  # noqa: ASYNC110 - another process
            await trio.sleep(0.01)
    with await store.open(session.id) as reopened:
        contents = [r.content for r in reopened.records if isinstance(r, UserRecord)]
    assert len(contents) >= 20
    assert contents == [f"{n:06d}" * 50_000 for n in range(1, len(contents) + 1)]
    assert session.path.stat().st_size == session.path.read_bytes().rfind(b"\n") + 1


async def test_a_line_holding_two_records_is_corrupt(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with await store.create(BASELINE) as session:
        pass
    one = dump(UserRecord(content="a")).rstrip(b"\n")
    with session.path.open("ab") as f:
        f.write(one + b"\n" + one + b"," + one + b"\n")
    with pytest.raises(CorruptLog, match=":3: not a record"):
        await store.open(session.id)
