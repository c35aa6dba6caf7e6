"""An editor's session follows its rewinds and compactions across restarts: the old session's
log says where it went on (`continued` records), and `bxctl acp`'s `session/load` and
`session/resume` of the editor's id open the newest session of that chain, while a client
that does not ask to follow (`bxctl chat --continue ID`) still opens the old session itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from acp import text_block

from bxctl.connection import Connection
from loopd.session.baseline import make_baseline
from loopd.session.continued import newest_now, record_went_on
from loopd.session.fork import fork
from loopd.session.records import (
    AssistantRecord,
    ContinuedRecord,
    Record,
    TurnEndRecord,
    UserRecord,
)
from loopd.session.store import Store
from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply
from test_acp import Editor, forks_of, with_editor
from test_hands import notes_folder
from test_sessions import records

StartDaemon = Callable[..., Awaitable[Daemon]]


def users(log: list[Record]) -> list[str]:
    return [r.content for r in log if isinstance(r, UserRecord)]


def shown_users(editor: Editor) -> list[str]:
    shown = editor.shown()
    return [u.content.text for u in shown if u.session_update == "user_message_chunk"]


def continued(log: list[Record]) -> list[ContinuedRecord]:
    return [r for r in log if isinstance(r, ContinuedRecord)]


def continuation_of(d: Daemon, session: str) -> str:
    (made,) = [s.id for s in Store(d.home / "sessions").sessions_now() if s.continues == session]
    return made


def prompts(*texts: str, cwd: Path) -> Callable[[Any, Editor], Awaitable[str]]:
    """An editor that makes a session in `cwd`, prompts it with each of `texts` and leaves."""

    async def run(conn: Any, _: Editor) -> str:
        session = str((await conn.new_session(cwd=str(cwd))).session_id)
        for text in texts:
            answer = await conn.prompt(session_id=session, prompt=[text_block(text)])
            assert answer.stop_reason == "end_turn"
        return session

    return run


def reopened(
    session: str, cwd: Path, how: str, text: str
) -> Callable[[Any, Editor], Awaitable[Any]]:
    """An editor that loads or resumes `session` (its id from before), then prompts `text`."""

    async def run(conn: Any, editor: Editor) -> list[str]:
        if how == "load":
            await conn.load_session(cwd=str(cwd), session_id=session)
        else:
            await conn.resume_session(cwd=str(cwd), session_id=session)
        replayed = shown_users(editor)
        answer = await conn.prompt(session_id=session, prompt=[text_block(text)])
        assert answer.stop_reason == "end_turn"
        return replayed

    return run


async def test_an_editor_restarted_after_a_rewind_goes_on_in_the_fork(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    d = await daemon(
        FakeLlama([Reply(content=f"answer-{n}") for n in range(3)]), tools=f'roots = ["{notes}"]'
    )
    session = await with_editor(d, prompts("first", "second", "/rewind 1", cwd=notes))
    (fork_id,) = forks_of(d, session)
    (went,) = continued(records(d, session))
    assert (went.session, went.by, went.at) == (fork_id, "rewind", 1)

    replayed = await with_editor(d, reopened(session, notes, "load", "third"))
    assert replayed == ["first"]
    assert users(records(d, fork_id)) == ["first", "third"]
    assert users(records(d, session)) == ["first", "second"]
    assert continued(records(d, fork_id)) == []  # the parent's record is its own

    # A client that does not ask to follow (bxctl chat --continue ID) opens the old session.
    connection = await Connection.open(d.socket)
    try:
        assert await connection.hello(session) == session
    finally:
        await connection.aclose()


async def test_an_editor_restarted_after_a_compaction_goes_on_in_the_continuation(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [Reply(content="Tea it is."), Reply(content="A summary: tea."), Reply(content="Ok.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    session = await with_editor(d, prompts("tea", "/compact", cwd=notes))
    then = continuation_of(d, session)
    (went,) = continued(records(d, session))
    assert (went.session, went.by, went.at) == (then, "compact", None)

    assert await with_editor(d, reopened(session, notes, "load", "and milk?")) == []
    assert users(records(d, then)) == ["and milk?"]
    assert users(records(d, session)) == ["tea"]


async def test_a_rewind_then_a_compaction_is_followed_to_the_end_of_the_chain(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [Reply(content="one"), Reply(content="two"), Reply(content="A summary: one.")]
    d = await daemon(FakeLlama([*script, Reply(content="three")]), tools=f'roots = ["{notes}"]')
    session = await with_editor(d, prompts("first", "second", "/rewind 1", "/compact", cwd=notes))
    (fork_id,) = forks_of(d, session)
    then = continuation_of(d, fork_id)

    await with_editor(d, reopened(session, notes, "resume", "more"))
    assert users(records(d, then)) == ["more"]
    assert users(records(d, fork_id)) == ["first"]
    assert users(records(d, session)) == ["first", "second"]


async def made(store: Store, *went_on: str | None) -> list[str]:
    """Sessions, one per item of `went_on`, each with a turn and, where the item names one, a
    `continued` record naming the session of that index (a digit) or that id."""
    ids = []
    for _ in went_on:
        with await store.create(make_baseline()) as session:
            ids.append(session.id)
    for session_id, to in zip(ids, went_on, strict=True):
        if to is None:
            continue
        target = ids[int(to)] if to.isdigit() else to
        with await store.open(session_id) as session:
            await session.append(ContinuedRecord(session=target, by="rewind", at=1))
    return ids


async def test_a_cycle_of_continued_records_ends_before_it_repeats(tmp_path: Path) -> None:
    store = Store(tmp_path)
    a, b, c = await made(store, "1", "2", "1")
    assert newest_now(store, a) == c
    assert newest_now(store, b) == c
    assert newest_now(store, c) == b
    lone, to_itself = await made(store, None, "1")
    assert newest_now(store, lone) == lone
    assert newest_now(store, to_itself) == to_itself


async def test_a_continued_record_naming_a_missing_session_ends_the_chain_before_it(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    gone, named_gone, names_a_path, names_latest = await made(
        store, None, "0", "../elsewhere", "latest"
    )
    store.path_of(gone).unlink()
    assert newest_now(store, named_gone) == named_gone
    assert newest_now(store, names_a_path) == names_a_path
    assert newest_now(store, names_latest) == names_latest
    assert newest_now(store, "no-such-session") == "no-such-session"  # opening it says so


async def test_a_missing_target_loads_the_session_that_names_it(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    d = await daemon(
        FakeLlama([Reply(content="one"), Reply(content="two")]), tools=f'roots = ["{notes}"]'
    )
    session = await with_editor(d, prompts("first", cwd=notes))
    with await Store(d.home / "sessions").open(session) as log:
        await log.append(ContinuedRecord(session="20000101T000000000Z-000000", by="rewind", at=1))

    assert await with_editor(d, reopened(session, notes, "load", "second")) == ["first"]
    assert users(records(d, session)) == ["first", "second"]


async def test_a_fork_does_not_copy_where_its_parent_went_on(tmp_path: Path) -> None:
    """A rewind while a later turn ran put the record inside the turns a later fork copies."""
    store = Store(tmp_path)
    (elsewhere,) = await made(store, None)
    with await store.create(make_baseline()) as parent:
        for turn in ("one", "two"):
            await parent.append(UserRecord(content=turn))
            if turn == "two":
                await parent.append(ContinuedRecord(session=elsewhere, by="rewind", at=1))
            await parent.append(AssistantRecord(content=turn))
            await parent.append(TurnEndRecord(reason="answer"))
    forked = await fork(store, parent.id, 2)
    assert continued(store.read(forked)[1]) == []
    assert users(store.read(forked)[1]) == ["one", "two"]
    assert newest_now(store, forked) == forked
    assert newest_now(store, parent.id) == elsewhere


async def test_a_log_that_cannot_take_where_it_went_on_is_logged_and_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The new session stands; only a client that follows the old one misses it."""
    store = Store(tmp_path)
    (elsewhere,) = await made(store, None)
    with await store.create(make_baseline()) as old:
        pass  # closed: its log takes nothing more
    await record_went_on(old, ContinuedRecord(session=elsewhere, by="compact"))
    assert f"session {old.id} could not record that it went on in {elsewhere}" in caplog.text
    assert continued(store.read(old.id)[1]) == []
    assert newest_now(store, old.id) == old.id
