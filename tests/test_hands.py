"""The agent's hands through loopd: writes and edits that ask first (with their diff), go to
the log before the file, and can be undone; commands run through the port; a crash in the
middle of a write. On the scripted server and real files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import StartDaemon
from loopd.actors import (
    Busy,
    CannotUndo,
    Core,
    FolderNotAllowed,
    SessionHandle,
    Subscription,
    TurnDone,
    open_core,
)
from loopd.config import Config, Policy, ToolsConfig
from loopd.infer import Client
from loopd.session.closing import close_interrupted_turn
from loopd.session.records import (
    ApprovalRequestRecord,
    AssistantRecord,
    FileChangeRecord,
    Record,
    ToolResultRecord,
    UndoRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.tools import (
    NEW_FILE,
    Builtins,
    Roots,
    ToolFailure,
    ToolRequest,
    builtin_entries,
    digest,
    read_only_refusal,
    sandbox_missing,
)
from loopd.tools._builtin import PREVIEW_CHARS
from loopd.turn.changes import Blobs, Hands, NothingToUndo, UndoRefused, undo
from loopd.wire.events import ApprovalNeeded
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer
from test_actors import collect, next_of
from test_agents import delegate, scripted
from test_bxctl import Tmux, bxctl


def call(tool: str, arguments: dict[str, Any], call_id: str = "c1") -> Reply:
    payload = json.dumps({"name": tool, "arguments": arguments})
    return Reply(tool_calls=((call_id, "call_tool", payload),))


def write(path: str, content: str, call_id: str = "c1") -> Reply:
    return call("write_file", {"path": path, "content": content}, call_id)


def edit(path: str, old: str, new: str) -> Reply:
    return call("edit_file", {"path": path, "edits": [{"old_text": old, "new_text": new}]})


class Desk:
    """A core with a session, its scripted model, and a folder of notes to change."""

    def __init__(
        self, tmp_path: Path, fake: FakeLlama, core: Core, handle: SessionHandle, first: str
    ) -> None:
        self.notes = tmp_path / "notes"
        self.fake, self.core, self.handle, self.first = fake, core, handle, first
        self.store = Store(tmp_path / "sessions")
        self.events: Subscription | None = None

    def log(self) -> list[Record]:
        return self.store.read(self.first)[1]

    async def turn(self, turn: str, text: str) -> list[Any]:
        assert self.events is not None
        await self.handle.send(turn, text)
        with trio.fail_after(10):
            return [m.item for m in await collect(self.events, 1)]


@asynccontextmanager
async def hands(tmp_path: Path, **tools: Any) -> AsyncIterator[Desk]:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "today.md").write_text("buy milk\n")
    cfg = Config.model_validate(
        {
            "tools": {"roots": [str(notes)], "approval_timeout": 5, **tools},
            "session": {"history": "template"},
            "slots": {"save": "never"},
            "store": {"directory": str(tmp_path / "sessions")},
        }
    )
    fake = FakeLlama([])
    server = ReplayServer([fake] * 50)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        store = Store(tmp_path / "sessions")
        async with Client(server.url) as client, open_core(cfg, store, [client]) as core:
            handle, first = await core.sessions.attach("new")
            h = Desk(tmp_path, fake, core, handle, first)
            h.events = await handle.subscribe(100)
            yield h
        nursery.cancel_scope.cancel()


def test_writing_editing_and_running_ask_by_default_and_a_policy_says_otherwise() -> None:
    config = Config.model_validate({"tools": {"roots": ["/tmp"]}}).tools  # noqa: S108
    actions = {e.name: e.policy.action for e in builtin_entries(config)}
    assert actions["write_file"] == actions["edit_file"] == actions["run_command"] == "ask"
    assert actions["read_file"] == actions["list_directory"] == "allow"
    config = Config.model_validate(
        {"tools": {"roots": ["/tmp"], "policies": {"edit_file": {"action": "allow"}}}}  # noqa: S108
    ).tools
    assert {e.name: e.policy.action for e in builtin_entries(config)}["edit_file"] == "allow"


HANDS = ("write_file", "edit_file", "run_command")


def policies_of(tools: dict[str, Any]) -> dict[str, Policy]:
    config = Config.model_validate({"tools": {"roots": ["/tmp"], **tools}}).tools  # noqa: S108
    return {e.name: e.policy for e in builtin_entries(config)}


def test_a_builtin_policy_that_sets_only_a_class_keeps_writing_and_running_asking() -> None:
    """`[tools.policies.builtin] class = "private"` sets the class, never the action."""
    policies = policies_of({"policies": {"builtin": {"class": "private", "untrusted": True}}})
    for name in HANDS:
        assert policies[name] == Policy(action="ask", data_class="private", untrusted=True)
    assert policies["read_file"] == Policy(action="allow", data_class="private", untrusted=True)


def test_a_builtin_policy_can_deny_writing_and_running_but_never_allow_them() -> None:
    allowed = policies_of({"policies": {"builtin": {"action": "allow"}}})
    assert [allowed[name].action for name in HANDS] == ["ask", "ask", "ask"]
    denied = policies_of({"policies": {"builtin": {"action": "deny"}}})
    assert [denied[name].action for name in HANDS] == ["deny", "deny", "deny"]


def test_a_tool_policy_that_sets_only_a_class_keeps_it_asking() -> None:
    policies = policies_of({"policies": {name: {"class": "secret"} for name in HANDS}})
    for name in HANDS:
        assert policies[name] == Policy(action="ask", data_class="secret")


def test_a_table_says_only_what_it_sets_the_rest_comes_from_its_source() -> None:
    """A tool's table that sets only a class keeps its source's action: `builtin` denying,
    read_file and run_command with a class of their own still deny."""
    policies = policies_of(
        {
            "policies": {
                "builtin": {"action": "deny", "untrusted": True},
                "read_file": {"class": "private"},
                "run_command": {"class": "secret"},
            }
        }
    )
    assert policies["read_file"] == Policy(action="deny", data_class="private", untrusted=True)
    assert policies["run_command"] == Policy(action="deny", data_class="secret", untrusted=True)


def test_a_tool_policy_that_allows_lets_it_run_without_asking() -> None:
    """Its own `action` wins, over the default and over the `builtin` policy's."""
    own = {name: {"action": "allow"} for name in HANDS}
    policies = policies_of({"policies": {"builtin": {"action": "deny"}, **own}})
    assert [policies[name].action for name in HANDS] == ["allow", "allow", "allow"]


async def test_a_write_waits_with_its_diff_and_once_approved_the_log_has_it_first(
    tmp_path: Path,
) -> None:
    async with hands(tmp_path) as h:
        h.fake.replies = [edit("today.md", "milk", "oat milk"), Reply(content="done")]
        await h.handle.send("t1", "oat milk, please")
        assert h.events is not None
        with trio.fail_after(10):
            needed = await next_of(h.events, ApprovalNeeded)
        assert needed.tool == "edit_file"
        assert needed.preview is not None
        assert "-buy milk\n+buy oat milk\n" in needed.preview
        assert (h.notes / "today.md").read_text() == "buy milk\n"  # nothing before the answer
        assert await h.handle.decide(needed.call, "once")
        with trio.fail_after(10):
            await collect(h.events, 1)
    assert (h.notes / "today.md").read_text() == "buy oat milk\n"
    log = h.log()
    kinds = [r.kind for r in log]
    assert kinds.index("file_change") < kinds.index("tool_result")
    change = next(r for r in log if isinstance(r, FileChangeRecord))
    assert change.path == str(h.notes / "today.md")
    assert (change.before, change.after) == (digest(b"buy milk\n"), digest(b"buy oat milk\n"))
    result = next(r for r in log if isinstance(r, ToolResultRecord))
    assert result.content == "Changed today.md: +1 -1 lines."
    (request,) = [r for r in log if isinstance(r, ApprovalRequestRecord)]
    assert request.preview == needed.preview


def changed_meanwhile(path: str) -> str:
    """What the model reads when `path` changed while its write's approval waited."""
    return (
        f"The tool failed: {path} changed while the approval waited, so what was approved is "
        "not what would be written; nothing was written. Read it again and plan the change anew."
    )


async def approved_after_a_person_wrote(h: Desk, reply: Reply, path: str, text: str) -> str:
    """The model's result for `reply`'s call, approved once a person wrote `text` to `path`
    while the approval waited."""
    h.fake.replies = [reply, Reply(content="ok")]
    await h.handle.send("t1", "change it")
    assert h.events is not None
    with trio.fail_after(10):
        needed = await next_of(h.events, ApprovalNeeded)
    await trio.Path(h.notes / path).write_text(text)  # the person, while loopd waits
    assert await h.handle.decide(needed.call, "once")
    with trio.fail_after(10):
        await collect(h.events, 1)
    (result,) = [r.content for r in h.log() if isinstance(r, ToolResultRecord)]
    return result


@pytest.mark.parametrize(
    ("path", "text"), [("today.md", "buy milk and eggs\n"), ("new.md", "a person's file\n")]
)
async def test_a_write_to_a_file_a_person_changed_while_it_waited_is_refused(
    tmp_path: Path, path: str, text: str
) -> None:
    """The approved write would replace what the person wrote meanwhile (or the file they
    created) with a change they never saw: it is refused, and the file keeps their text."""
    async with hands(tmp_path) as h:
        result = await approved_after_a_person_wrote(h, write(path, "buy bread\n"), path, text)
    assert result == changed_meanwhile(path)
    assert (h.notes / path).read_text() == text
    assert not any(isinstance(r, FileChangeRecord) for r in h.log())
    assert conversation_problems(h.log()) == []


async def test_an_edit_that_still_applies_to_the_changed_file_is_refused_all_the_same(
    tmp_path: Path,
) -> None:
    """The person changed another line: the edit would apply, but the file it would give is
    not the one the approved diff showed."""
    async with hands(tmp_path) as h:
        person = "buy milk\nand bread\n"
        reply = edit("today.md", "milk", "oat milk")
        result = await approved_after_a_person_wrote(h, reply, "today.md", person)
    assert result == changed_meanwhile("today.md")
    assert (h.notes / "today.md").read_text() == person
    assert not any(isinstance(r, FileChangeRecord) for r in h.log())


async def test_the_approval_request_records_what_its_diff_was_planned_on(tmp_path: Path) -> None:
    """A file's hash as shown, or `new` where there was no file; unchanged, the write runs."""
    async with hands(tmp_path) as h:
        h.fake.replies = [write("today.md", "eggs\n"), write("new.md", "new\n", "c2")]
        h.fake.replies += [Reply(content="ok")]
        await h.handle.send("t1", "two writes")
        assert h.events is not None
        for _ in range(2):
            with trio.fail_after(10):
                needed = await next_of(h.events, ApprovalNeeded)
            assert await h.handle.decide(needed.call, "once")
        with trio.fail_after(10):
            await collect(h.events, 1)
    requests = [r for r in h.log() if isinstance(r, ApprovalRequestRecord)]
    assert [(r.arguments["path"], r.basis) for r in requests] == [
        ("today.md", digest(b"buy milk\n")),
        ("new.md", NEW_FILE),
    ]
    assert (h.notes / "today.md").read_text() == "eggs\n"
    assert (h.notes / "new.md").read_text() == "new\n"


async def test_a_write_that_did_not_wait_for_approval_still_writes(tmp_path: Path) -> None:
    async with hands(tmp_path, policies={"edit_file": {"action": "allow"}}) as h:
        h.fake.replies = [edit("today.md", "milk", "oat milk"), Reply(content="ok")]
        await h.turn("t1", "oat milk")
    assert (h.notes / "today.md").read_text() == "buy oat milk\n"
    assert not any(isinstance(r, ApprovalRequestRecord) for r in h.log())
    assert [r.kind for r in h.log()].count("file_change") == 1


async def test_a_sub_agents_write_to_a_file_changed_while_it_waited_is_refused(
    tmp_path: Path,
) -> None:
    scripts = {
        "Bread, please.": [delegate("Write bread to today.md."), Reply(content="asked")],
        "Write bread to today.md.": [write("today.md", "buy bread\n"), Reply(content="no")],
    }
    async with scripted(tmp_path, scripts) as s:
        await s.parent.send("t1", "Bread, please.")
        with trio.fail_after(10):
            needed = await next_of(s.events, ApprovalNeeded)
        (child,) = s.children()
        await trio.Path(tmp_path / "notes" / "today.md").write_text("buy eggs\n")
        assert await s.parent.decide(needed.call, "once", session=child)
        with trio.fail_after(10):
            await collect(s.events, 1)
        assert s.results(child) == [changed_meanwhile("today.md")]
        assert not any(isinstance(r, FileChangeRecord) for r in s.log(child))
    assert (tmp_path / "notes" / "today.md").read_text() == "buy eggs\n"


async def test_a_denied_write_leaves_the_file_untouched_and_session_stops_asking(
    tmp_path: Path,
) -> None:
    async with hands(tmp_path) as h:
        h.fake.replies = [write("today.md", "gone\n"), Reply(content="ok")]
        await h.handle.send("t1", "wipe it")
        assert h.events is not None
        with trio.fail_after(10):
            needed = await next_of(h.events, ApprovalNeeded)
        assert await h.handle.decide(needed.call, "deny")
        with trio.fail_after(10):
            await collect(h.events, 1)
        assert (h.notes / "today.md").read_text() == "buy milk\n"
        h.fake.replies = [write("a.md", "a\n"), Reply(content="ok"), write("b.md", "b\n")]
        h.fake.replies += [Reply(content="ok")]
        await h.handle.send("t2", "write a")
        with trio.fail_after(10):
            needed = await next_of(h.events, ApprovalNeeded)
        assert await h.handle.decide(needed.call, "session")
        with trio.fail_after(10):
            await collect(h.events, 1)
        items = await h.turn("t3", "write b")
    assert not any(isinstance(i, ApprovalNeeded) for i in items)
    assert (h.notes / "a.md").read_text() == "a\n"
    assert (h.notes / "b.md").read_text() == "b\n"
    assert not any(isinstance(r, FileChangeRecord) and r.path.endswith("today.md") for r in h.log())


async def test_undo_puts_back_the_last_turns_changes_and_refuses_when_a_file_changed_since(
    tmp_path: Path,
) -> None:
    allow = {"policies": {"write_file": {"action": "allow"}, "edit_file": {"action": "allow"}}}
    async with hands(tmp_path, **allow) as h:
        h.fake.replies = [edit("today.md", "milk", "eggs"), write("new.md", "new\n", "c2")]
        h.fake.replies += [Reply(content="done"), write("new.md", "newer\n"), Reply(content="ok")]
        await h.turn("t1", "two changes")
        await h.turn("t2", "one more")
        assert (h.notes / "new.md").read_text() == "newer\n"
        (h.notes / "new.md").write_text("a person's own\n")
        with pytest.raises(CannotUndo, match=r"new\.md changed since the call wrote it"):
            await h.handle.undo()
        assert (h.notes / "new.md").read_text() == "a person's own\n"
        (h.notes / "new.md").write_text("newer\n")
        done = await h.handle.undo()  # the second turn's
        assert (h.notes / "new.md").read_text() == "new\n"
        again = await h.handle.undo()  # then the first's
        with pytest.raises(CannotUndo, match="no turn of this session changed a file"):
            await h.handle.undo()
    assert done.paths == (str(h.notes / "new.md"),)
    assert sorted(again.paths) == sorted([str(h.notes / "new.md"), str(h.notes / "today.md")])
    assert (h.notes / "today.md").read_text() == "buy milk\n"
    assert not (h.notes / "new.md").exists()  # it did not exist before the first turn
    assert [r.kind for r in h.log()].count("undo") == 2
    assert conversation_problems(h.log()) == []


async def test_undo_waits_for_no_turn(tmp_path: Path) -> None:
    async with hands(tmp_path) as h:
        h.fake.replies = [Reply(kind="stall")]
        await h.handle.send("t1", "hang")
        await trio.sleep(0.2)
        with pytest.raises(Busy, match="a turn is running"):
            await h.handle.undo()
        await h.handle.cancel("t1")


async def test_a_command_runs_in_its_folder_and_the_model_reads_its_exit_status(
    tmp_path: Path,
) -> None:
    allow = {"policies": {"run_command": {"action": "allow"}}}
    async with hands(tmp_path, **allow) as h:
        h.fake.replies = [call("run_command", {"command": "cat today.md; exit 4"})]
        h.fake.replies += [Reply(content="ok")]
        items = await h.turn("t1", "what is in it?")
    assert isinstance(items[-1], TurnDone)
    result = next(r for r in h.log() if isinstance(r, ToolResultRecord))
    assert result.content == "exit status 4\nbuy milk\n"


def test_without_bubblewrap_commands_are_refused_with_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert sandbox_missing() is None  # installed here, as the setup installs it
    monkeypatch.setenv("PATH", "/nonexistent")
    why = sandbox_missing()
    assert why is not None
    assert "sudo apt install bubblewrap" in why
    assert 'sandbox = "none"' in why


async def test_a_write_cut_short_by_a_crash_is_closed_saying_what_the_file_holds(
    tmp_path: Path,
) -> None:
    """The record is written before the file: loopd killed between the two leaves a log that
    says what was meant, and the reopened session says what happened."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.md").write_text("old\n")
    store = Store(tmp_path / "sessions")
    from loopd.session.baseline import make_baseline  # noqa: PLC0415 - one test's need

    with await store.create(make_baseline()) as session:
        await session.append(UserRecord(content="change a and b"))
        calls = (("w1", "call_tool", "{}"), ("w2", "call_tool", "{}"))
        await session.append(
            AssistantRecord.model_validate(
                {
                    "content": None,
                    "tool_calls": [{"id": i, "name": n, "arguments": a} for i, n, a in calls],
                }
            )
        )
        a, b = notes / "a.md", notes / "b.md"
        for number, (path, done) in enumerate(((a, False), (b, True)), start=1):
            await session.append(
                FileChangeRecord(
                    call=number,
                    tool_call_id=f"w{number}",
                    path=str(path),
                    before=digest(b"old\n") if path == a else None,
                    after=digest(b"new\n"),
                )
            )
            if done:
                path.write_text("new\n")
        assert await close_interrupted_turn(session)
        results = [r.content for r in session.records if isinstance(r, ToolResultRecord)]
        assert conversation_problems(list(session.records)) == []
    assert results == [
        f"Interrupted: loopd stopped while it wrote {a}; the file holds its old content.",
        f"Interrupted: loopd stopped while it wrote {b}; the file holds the new content.",
    ]


# -- undo, over generated sequences of changes ------------------------------------------------

FILES = ("a.md", "b.md", "c.md")
changes = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from(FILES), st.sampled_from(["write", "edit"]), st.text("xyz\n", max_size=8)
        ),
        min_size=1,
        max_size=3,
    ),
    min_size=1,
    max_size=4,
)


async def _play(turns: list[list[tuple[str, str, str]]], tmp: Path, meddle: int | None) -> None:
    root = tmp / "root"
    root.mkdir()
    for name in FILES[:2]:  # c.md does not exist at first
        (root / name).write_text(f"{name} at first\n")
    start = {p.name: p.read_bytes() for p in root.iterdir()}
    store = Store(tmp / "sessions")
    writer = Hands(Roots([root]), Blobs(tmp / "history"))
    from loopd.session.baseline import make_baseline  # noqa: PLC0415 - one test's need

    states = [start]
    number = 0
    with await store.create(make_baseline()) as session:
        for turn in turns:
            await session.append(UserRecord(content="change"))
            recorded = len(session.records)
            for name, how, text in turn:
                number += 1
                current = root / name
                if how == "edit" and current.exists() and current.read_text():
                    old = current.read_text()
                    arguments: dict[str, Any] = {
                        "path": name,
                        "edits": [{"old_text": old, "new_text": text}],
                    }
                    tool = "edit_file"
                else:
                    arguments, tool = {"path": name, "content": text}, "write_file"
                with contextlib.suppress(ToolFailure):  # an edit that finds nothing to replace
                    await writer.write(session, number, f"c{number}", tool, arguments)
            if any(isinstance(r, FileChangeRecord) for r in session.records[recorded:]):
                states.append({p.name: p.read_bytes() for p in root.iterdir()})
        if meddle is not None:
            changed = [r for r in session.records if isinstance(r, FileChangeRecord)]
            if changed:
                target = Path(changed[-1].path)
                await trio.Path(target).write_text("a person's edit\n")
                before = {p.name: p.read_bytes() for p in root.iterdir()}
                with pytest.raises(UndoRefused):
                    await undo(session, writer)
                assert {p.name: p.read_bytes() for p in root.iterdir()} == before
                return
        for state in reversed(states[:-1]):
            await undo(session, writer)
            assert {p.name: p.read_bytes() for p in root.iterdir()} == state
        with pytest.raises(NothingToUndo):
            await undo(session, writer)
        assert sum(isinstance(r, UndoRecord) for r in session.records) == len(states) - 1


@pytest.mark.parametrize("put", ["fifo", "folder"])
async def test_undo_refuses_what_stands_where_the_file_was_and_never_hangs(
    tmp_path: Path, put: str
) -> None:
    """A FIFO would block a read forever in a thread nothing can cancel, and the session
    with it; a folder is no file to put back."""
    from loopd.session.baseline import make_baseline  # noqa: PLC0415 - as _play

    root = tmp_path / "root"
    root.mkdir()
    writer = Hands(Roots([root]), Blobs(tmp_path / "history"))
    with await Store(tmp_path / "sessions").create(make_baseline()) as session:
        await session.append(UserRecord(content="write"))
        await writer.write(session, 1, "c1", "write_file", {"path": "f.txt", "content": "x\n"})
        (root / "f.txt").unlink()
        if put == "fifo":
            os.mkfifo(root / "f.txt")
        else:
            (root / "f.txt").mkdir()
        with trio.fail_after(10), pytest.raises(UndoRefused, match=r"f\.txt"):
            await undo(session, writer)


async def test_undo_through_a_folder_swapped_for_a_link_puts_nothing_outside(
    tmp_path: Path,
) -> None:
    """A model's command may swap the folder of a written file for a link to one outside that
    holds the same text; undo refuses rather than write there."""
    from loopd.session.baseline import make_baseline  # noqa: PLC0415 - as _play

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    writer = Hands(Roots([root]), Blobs(tmp_path / "history"))
    with await Store(tmp_path / "sessions").create(make_baseline()) as session:
        await session.append(UserRecord(content="write"))
        arguments = {"path": "sub/f.txt", "content": "written\n"}
        await writer.write(session, 1, "c1", "write_file", arguments)
        (root / "sub").rename(root / "sub.real")
        (root / "sub").symlink_to(outside)
        (outside / "f.txt").write_text("written\n")
        with pytest.raises(UndoRefused, match="no longer a folder"):
            await undo(session, writer)
    assert (outside / "f.txt").read_text() == "written\n"
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns=changes, meddle=st.one_of(st.none(), st.just(1)))
def test_undo_of_each_turn_in_turn_restores_every_file_byte_for_byte(
    tmp_path_factory: pytest.TempPathFactory,
    turns: list[list[tuple[str, str, str]]],
    meddle: int | None,
) -> None:
    trio.run(_play, turns, tmp_path_factory.mktemp("undo"), meddle)


# -- bxctl -----------------------------------------------------------------------------------


def notes_folder(tmp_path: Path) -> Path:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "today.md").write_text("buy milk\n")
    return notes


async def test_a_session_in_a_folder_of_its_own_works_there_alone(tmp_path: Path) -> None:
    async with hands(tmp_path, policies={"write_file": {"action": "allow"}}) as h:
        project = h.notes / "project"
        project.mkdir()
        (project / "plan.md").write_text("plan\n")
        handle, session = await h.core.sessions.attach("new", str(project))
        events = await handle.subscribe(100)
        h.fake.replies = [
            call("list_directory", {"path": "."}),
            call("read_file", {"path": "../today.md"}),
            write("today.md", "in the project\n"),
            Reply(content="done"),
        ]
        await handle.send("t1", "work here")
        with trio.fail_after(10):
            await collect(events, 1)
        records = h.store.read(session)[1]
        results = [r.content for r in records if isinstance(r, ToolResultRecord)]
        assert results[0] == "plan.md (5 bytes)"
        assert (
            results[1]
            == "The tool failed: ../today.md: '..' is refused; paths stay inside the roots"
        )
        assert (project / "today.md").read_text() == "in the project\n"
        assert (h.notes / "today.md").read_text() == "buy milk\n"
        assert h.store.read(session)[0].cwd == str(project)


async def test_a_sessions_folder_outside_the_roots_or_not_a_folder_is_refused(
    tmp_path: Path,
) -> None:
    async with hands(tmp_path) as h:
        refusals = {
            str(tmp_path): f"{tmp_path} is not inside the folders loopd's tools may use",
            "notes": "notes: a session's folder is an absolute path",
            str(h.notes / "nope"): f"{h.notes / 'nope'}: no such folder",
            str(h.notes / "today.md"): f"{h.notes / 'today.md'}: no such folder",
        }
        for cwd, why in refusals.items():
            with pytest.raises(FolderNotAllowed) as refused:
                await h.core.sessions.attach("new", cwd)
            assert str(refused.value).startswith(why)
        assert h.core.sessions.live == 1


async def test_bxctl_chat_m_stops_at_a_write_unless_yes_and_bxctl_undo_puts_it_back(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [edit("today.md", "milk", "tea"), Reply(content="done")]
    script += [edit("today.md", "tea", "coffee"), Reply(content="done")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    code, _, err = await bxctl(d, "chat", "-m", "tea, please")
    assert code == 6
    assert "call 1 (edit_file) waits for approval" in err
    assert (notes / "today.md").read_text() == "buy milk\n"
    first = Store(d.home / "sessions").latest()
    assert first is not None
    assert (await bxctl(d, "approve", "1", "--once"))[0] == 0
    with trio.fail_after(10):
        while (notes / "today.md").read_text() != "buy tea\n":  # noqa: ASYNC110 - a file
            await trio.sleep(0.05)
    code, out, _ = await bxctl(d, "chat", "-m", "coffee, then", "--yes")  # a new session
    assert (code, out) == (0, "done\n")
    assert (notes / "today.md").read_text() == "buy coffee\n"
    code, out, _ = await bxctl(d, "undo")  # in the latest session
    assert code == 0
    assert out == f"put back what call 1 changed:\n  {notes / 'today.md'}\n"
    assert (notes / "today.md").read_text() == "buy tea\n"
    (notes / "today.md").write_text("my own\n")
    code, _, err = await bxctl(d, "undo", "--in", first)
    assert code == 1
    assert "today.md changed since the call wrote it; nothing was put back" in err
    assert (notes / "today.md").read_text() == "my own\n"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_the_live_chat_shows_a_writes_diff_and_y_n_and_undo_do_what_they_say(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [edit("today.md", "milk", "oat milk"), Reply(content="Edited.")]
    script += [write("today.md", "nothing left\n"), Reply(content="Not written.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    tmux = Tmux(f"hands-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", rows=40)
    try:
        await tmux.wait_for("/help for help")
        await tmux.keys("oat milk", "Enter")
        screen = await tmux.wait_for("approve call 1?")
        assert "-buy milk" in screen
        assert "+buy oat milk" in screen
        await tmux.keys("y")
        await tmux.wait_for("Edited.")
        assert (notes / "today.md").read_text() == "buy oat milk\n"
        await tmux.keys("wipe it", "Enter")
        screen = await tmux.wait_for("approve call 2?")
        assert "+nothing left" in screen
        await tmux.keys("n")
        await tmux.wait_for("Not written.")
        assert (notes / "today.md").read_text() == "buy oat milk\n"
        await tmux.keys("/undo", "Enter")
        await tmux.wait_for("put back what call 1 changed")
        assert (notes / "today.md").read_text() == "buy milk\n"
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()


async def test_a_long_diff_is_cut_for_approval(tmp_path: Path) -> None:
    notes = notes_folder(tmp_path)
    builtins = Builtins([notes], 5.0)
    (entry,) = [e for e in builtin_entries(ToolsConfig(roots=[notes])) if e.name == "write_file"]
    content = "".join(f"line {n}\n" for n in range(20_000))
    arguments = {"path": "today.md", "content": content}
    preview = await builtins.preview(entry, ToolRequest("s", 1, "write_file", arguments))
    assert preview is not None
    assert preview.text.startswith("--- a/today.md\n+++ b/today.md\n")
    assert preview.text.endswith(" more characters of the diff]")
    assert len(preview.text) < PREVIEW_CHARS + 100


async def test_a_read_only_sessions_sub_agents_change_nothing(tmp_path: Path) -> None:
    """They start in its mode, and one set while they run holds for their next call: the
    child's first write asked before the parent went read-only, its second is refused."""
    scripts = {
        "Plan it.": [
            delegate("Write the plan."),
            Reply(content="planned"),
            delegate("Write it again."),
            Reply(content="refused"),
        ],
        "Write the plan.": [
            write("a.md", "a\n"),
            write("b.md", "b\n", "c2"),
            Reply(content="wrote a"),
        ],
        "Write it again.": [write("c.md", "c\n"), Reply(content="could not")],
    }
    async with scripted(tmp_path, scripts) as s:
        await s.parent.send("t1", "Plan it.")
        with trio.fail_after(10):
            needed = await next_of(s.events, ApprovalNeeded)
        assert (await s.parent.set_mode("read_only")).mode == "read_only"
        assert await s.parent.decide(needed.call, "once", needed.session)
        with trio.fail_after(10):
            await collect(s.events, 1)
        items = await s.turn("t2", "Plan again.")
    assert not any(isinstance(i, ApprovalNeeded) for i in items)
    first, second = s.children()
    assert s.header(first).mode == "ask"
    assert s.header(second).mode == "read_only"
    refused = f"The call was denied: {read_only_refusal('write_file')}"
    assert s.results(first)[1:] == [refused]
    assert s.results(second) == [refused]
    notes = tmp_path / "notes"
    assert [p.name for p in sorted(notes.iterdir())] == ["a.md", "today.md"]
