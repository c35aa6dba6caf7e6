"""`bxctl acp` driven by the `agent-client-protocol` package's own client-side connection (the
editor's end, written by others), against a real `loopd serve` on a scripted model; and raw
lines on its stdin, for what no well-behaved client sends."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from acp import PROTOCOL_VERSION, image_block, spawn_agent_process, text_block
from acp.schema import (
    AllowedOutcome,
    DeniedOutcome,
    PermissionOption,
    RequestPermissionResponse,
    ToolCallUpdate,
)

from bxctl import rewind
from bxctl.acp import LOOPD_UNREACHABLE, MAX_LINE, RESOURCE_NOT_FOUND
from bxctl.acp_map import LIST_PAGE
from bxctl.jsonrpc import INVALID_PARAMS, INVALID_REQUEST
from conftest import ROOT, Unstarted
from loopd.infer import slot_tokens
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    GivenServer,
    McpServersRecord,
    ModeRecord,
    ToolResultRecord,
    UsageRecord,
    UserRecord,
)
from loopd.session.store import ParentCall, SessionLocked, Store
from loopd.tools import read_only_refusal
from support.daemon import Daemon, loopds_of
from support.fake_llama import FakeLlama, Reply
from test_bxctl import bxctl
from test_fork import files_in
from test_hands import call as tool_call
from test_hands import edit, notes_folder, write
from test_sessions import assert_no_loss, embedded, records
from test_tools_given import gone
from test_tools_mcp import SERVER

StartDaemon = Callable[..., Awaitable[Daemon]]


ASIDE = ("available_commands_update", "usage_update", "session_info_update")


@dataclass
class Editor:
    """The editor's side: what it was shown, and how it answers permission requests."""

    decision: str | None = "once"
    """The option it picks; None: it cancels the request."""
    updates: list[Any] = field(default_factory=list)
    asked: list[ToolCallUpdate] = field(default_factory=list)

    async def request_permission(
        self,
        session_id: str,  # noqa: ARG002 - the package calls it by these names
        tool_call: ToolCallUpdate,
        options: list[PermissionOption],  # noqa: ARG002
        **_: Any,
    ) -> RequestPermissionResponse:
        self.asked.append(tool_call)
        if self.decision is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(
            outcome=AllowedOutcome(outcome="selected", option_id=self.decision)
        )

    async def session_update(self, session_id: str, update: Any, **_: Any) -> None:  # noqa: ARG002
        self.updates.append(update)

    def kinds(self) -> list[str]:
        """The kinds of update that show the session, a run of chunks as one (not those that
        tell its commands, its usage and its title)."""
        kinds = [u.session_update for u in self.shown()]
        return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or "chunk" not in k]

    def shown(self) -> list[Any]:
        """The updates that show the session."""
        return [u for u in self.updates if u.session_update not in ASIDE]

    def told(self, kind: str) -> list[Any]:
        return [u for u in self.updates if u.session_update == kind]

    def said(self) -> str:
        return "".join(
            u.content.text for u in self.updates if u.session_update == "agent_message_chunk"
        )


Script = Callable[[Any, Editor], Awaitable[Any]]


async def with_editor(d: Daemon, script: Script, editor: Editor | None = None, *args: str) -> Any:
    """Run `script(connection, editor)` against a `bxctl acp` of its own (`args` after `acp`),
    from asyncio in a thread (the package's connections are asyncio's), while this test's trio
    loop serves the scripted model."""
    editor = editor or Editor()

    async def run() -> Any:
        command = ["-m", "bxctl", "--config", str(d.config), "acp", *args]
        spawned = spawn_agent_process(editor, sys.executable, *command)  # type: ignore[arg-type]
        async with spawned as (conn, _):
            await conn.initialize(protocol_version=PROTOCOL_VERSION)
            return await asyncio.wait_for(script(conn, editor), 60)

    return await trio.to_thread.run_sync(lambda: asyncio.run(run()))


async def test_a_turn_with_a_write_asks_the_editor_and_the_answer_streams_back(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [write("today.md", "buy tea\n"), Reply(reasoning="Done it.", content="Tea it is.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')

    async def turn(conn: Any, editor: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        answer = await conn.prompt(session_id=session.session_id, prompt=[text_block("tea")])
        return session.session_id, answer

    editor = Editor()
    session, answer = await with_editor(d, turn, editor)
    assert answer.stop_reason == "end_turn"
    assert answer.usage is not None
    assert answer.usage.output_tokens > 0
    assert (notes / "today.md").read_text() == "buy tea\n"
    (asked,) = editor.asked
    assert (asked.title, asked.kind, asked.status) == ("write_file", "edit", "pending")
    assert asked.content is not None
    (diff,) = asked.content  # ACP's own diff, which the editor shows as a reviewable one
    assert diff.type == "diff"
    assert (diff.path, diff.old_text, diff.new_text) == (
        str(notes / "today.md"),
        "buy milk\n",
        "buy tea\n",
    )
    assert editor.kinds() == [
        "tool_call",
        "tool_call_update",
        "agent_thought_chunk",
        "agent_message_chunk",
    ]
    started, result = editor.shown()[:2]
    assert (started.tool_call_id, started.title, started.kind) == ("1", "write_file", "edit")
    assert (result.tool_call_id, result.status) == ("1", "completed")
    summary, made = result.content  # what the model read, and the change as it was made
    assert summary.content.text == "Changed today.md: +1 -1 lines."
    assert (made.type, made.path, made.old_text, made.new_text) == (
        "diff",
        str(notes / "today.md"),
        "buy milk\n",
        "buy tea\n",
    )
    assert editor.said() == "Tea it is."
    header = Store(d.home / "sessions").read(session)[0]
    assert header.cwd == str(notes)


async def test_a_rejected_or_cancelled_permission_leaves_the_file_alone(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [write("today.md", "buy tea\n"), Reply(content="Not done.")] * 2
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    for decision in ("deny", None):

        async def turn(conn: Any, editor: Editor) -> Any:
            session = await conn.new_session(cwd=str(notes))
            return await conn.prompt(session_id=session.session_id, prompt=[text_block("tea")])

        editor = Editor(decision)
        answer = await with_editor(d, turn, editor)
        assert answer.stop_reason == "end_turn"
        assert len(editor.asked) == 1
        assert (notes / "today.md").read_text() == "buy milk\n"
        result = editor.shown()[1]
        assert (result.status, result.content[0].content.text) == (
            "failed",
            "The call was denied: the user did not approve it",
        )


async def test_a_folder_outside_the_roots_is_refused_saying_why(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    d = await daemon(FakeLlama([]), tools=f'roots = ["{notes}"]')

    async def refused(conn: Any, _: Editor) -> str:
        try:
            await conn.new_session(cwd=str(tmp_path))
        except Exception as e:  # noqa: BLE001 - the package's RequestError
            return f"{e.code}: {e}"  # type: ignore[attr-defined]
        return "accepted"

    answer = await with_editor(d, refused)
    assert answer.startswith(f"{INVALID_PARAMS}: ")
    assert f"{tmp_path} is not inside the folders loopd's tools may use ({notes})" in answer


async def test_an_image_is_refused_as_invalid_params_and_nothing_is_written(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """loopd's prompt capabilities say image: false; a client that sends one anyway gets an
    error, and the session neither holds its placeholder nor takes it as its title."""
    notes = notes_folder(tmp_path)
    d = await daemon(FakeLlama([Reply(content="Seen.")]), tools=f'roots = ["{notes}"]')

    async def with_image(conn: Any, _: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        picture = image_block(base64.b64encode(b"\x89PNG").decode(), "image/png")
        try:
            prompt = [text_block("what is in it?"), picture]
            await conn.prompt(session_id=session.session_id, prompt=prompt)
        except Exception as e:  # noqa: BLE001 - the package's RequestError
            refused = f"{e.code}: {e}"  # type: ignore[attr-defined]
        else:
            refused = "accepted"
        answer = await conn.prompt(session_id=session.session_id, prompt=[text_block("hi")])
        listed = await conn.list_sessions(cwd=str(notes))
        return session.session_id, refused, answer, listed

    session, refused, answer, listed = await with_editor(d, with_image)
    assert refused.startswith(f"{INVALID_PARAMS}: ")
    assert "images are not supported" in refused
    assert answer.stop_reason == "end_turn"
    said = [r.content for r in records(d, session) if isinstance(r, UserRecord)]
    assert said == ["hi"]
    assert [s.title for s in listed.sessions] == ["hi"]


async def test_cancel_ends_the_prompt_as_cancelled(daemon: StartDaemon, tmp_path: Path) -> None:
    notes = notes_folder(tmp_path)
    slow = Reply(content="word " * 400, delay=0.05)
    d = await daemon(FakeLlama([slow]), tools=f'roots = ["{notes}"]')

    async def cancelled(conn: Any, editor: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        prompt = asyncio.ensure_future(
            conn.prompt(session_id=session.session_id, prompt=[text_block("talk")])
        )
        while "agent_message_chunk" not in editor.kinds():  # noqa: ASYNC110 - the editor's list
            await asyncio.sleep(0.02)
        await conn.cancel(session_id=session.session_id)
        return await prompt

    answer = await with_editor(d, cancelled)
    assert answer.stop_reason == "cancelled"


async def test_a_commands_output_shows_in_its_call_while_it_runs(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    command = "for i in 1 2 3; do echo line $i; sleep 0.4; done"
    script = [tool_call("run_command", {"command": command}), Reply(content="Ran it.")]
    allow = '[tools.policies.run_command]\naction = "allow"'
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]\n{allow}')

    async def turn(conn: Any, _: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        await conn.prompt(session_id=session.session_id, prompt=[text_block("run it")])
        return session.session_id

    editor = Editor()
    session = await with_editor(d, turn, editor)
    updates = editor.told("tool_call_update")
    running = updates[:-1]
    assert len(running) >= 2  # the sleeps part the output
    assert [u.status for u in updates] == ["in_progress"] * len(running) + ["completed"]
    # Each carries the output so far, the last all of it.
    shown = [u.content[0].content.text for u in running]
    assert shown[0].startswith("```\nline 1")
    assert shown[-1] == "```\nline 1\nline 2\nline 3\n```"
    (result,) = [r for r in records(d, session) if isinstance(r, ToolResultRecord)]
    assert result.content == "exit status 0\nline 1\nline 2\nline 3\n"


async def test_load_replays_the_history_then_goes_on(daemon: StartDaemon, tmp_path: Path) -> None:
    notes = notes_folder(tmp_path)
    script = [write("today.md", "buy tea\n"), Reply(content="Tea it is."), Reply(content="Sure.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')

    async def first(conn: Any, _: Editor) -> str:
        session = await conn.new_session(cwd=str(notes))
        await conn.prompt(session_id=session.session_id, prompt=[text_block("tea")])
        return str(session.session_id)

    session = await with_editor(d, first)

    async def again(conn: Any, editor: Editor) -> Any:
        await conn.load_session(cwd=str(notes), session_id=session)
        replayed = list(editor.kinds())
        answer = await conn.prompt(session_id=session, prompt=[text_block("and milk?")])
        return replayed, answer

    editor = Editor()
    replayed, answer = await with_editor(d, again, editor)
    assert replayed == ["user_message_chunk", "tool_call", "agent_message_chunk"]
    call = editor.shown()[1]
    assert (call.title, call.kind, call.status) == ("write_file", "edit", "completed")
    assert call.raw_input == {"path": "today.md", "content": "buy tea\n"}
    assert editor.shown()[0].content.text == "tea"
    assert answer.stop_reason == "end_turn"
    assert editor.said() == "Tea it is.Sure."


async def test_a_fork_has_the_history_up_to_there_and_the_editor_goes_on_in_it(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    fake = FakeLlama([Reply(content=f"answer-{n}") for n in range(3)])
    d = await daemon(fake, tools=f'roots = ["{notes}"]')

    async def fork(conn: Any, _: Editor) -> tuple[str, str]:
        parent = (await conn.new_session(cwd=str(notes))).session_id
        for text in ("first", "second"):
            await conn.prompt(session_id=parent, prompt=[text_block(text)])
        forked = await conn.fork_session(session_id=parent, cwd=str(notes))
        answer = await conn.prompt(session_id=forked.session_id, prompt=[text_block("third")])
        assert answer.stop_reason == "end_turn"
        return parent, forked.session_id

    parent, forked = await with_editor(d, fork, Editor())
    assert forked != parent
    said = [r.content for r in records(d, forked) if isinstance(r, UserRecord)]
    assert said == ["first", "second", "third"]
    assert [r.content for r in records(d, parent) if isinstance(r, UserRecord)] == [
        "first",
        "second",
    ]
    # The fork's request extends the parent's last one, its answer and the new message.
    assert fake.prompts[2].startswith(fake.prompts[1])
    assert fake.bodies[2]["messages"][-1]["content"] == "third"


def forks_of(d: Daemon, session: str) -> list[str]:
    return [s.id for s in Store(d.home / "sessions").sessions_now() if s.forked_from == session]


async def test_rewind_lists_the_turns_and_goes_on_from_one_in_a_fork_under_the_editors_id(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    fake = FakeLlama([Reply(content=f"answer-{n}") for n in range(3)])
    d = await daemon(fake, tools=f'roots = ["{notes}"]')

    def users(editor: Editor) -> list[str]:
        shown = editor.shown()
        return [u.content.text for u in shown if u.session_update == "user_message_chunk"]

    async def rewound(conn: Any, editor: Editor) -> Any:
        session = (await conn.new_session(cwd=str(notes))).session_id
        for text in ("first", "second"):
            await conn.prompt(session_id=session, prompt=[text_block(text)])
        said = []
        for command in ("/rewind", "/rewind 1"):
            before = len(editor.said())
            answer = await conn.prompt(session_id=session, prompt=[text_block(command)])
            said.append((answer.stop_reason, editor.said()[before:]))
        await conn.prompt(session_id=session, prompt=[text_block("third")])
        loaded = []
        for _ in range(2):  # loaded while it is open, then once it was closed
            editor.updates.clear()
            await conn.load_session(cwd=str(notes), session_id=session)
            loaded.append(users(editor))
            await conn.close_session(session_id=session)
        return session, said, loaded

    session, (listed, went), loaded = await with_editor(d, rewound)
    assert listed == ("end_turn", f"  1. first\n  2. second\n{rewind.HELP}")
    (fork,) = forks_of(d, session)
    said = "Rewound to the end of turn 1: the next prompt goes on from there, in loopd session "
    said += f"{fork} (a fork of {session}, which keeps the later turns).\nNo file was put back."
    assert went == ("end_turn", said)
    assert [r.content for r in records(d, fork) if isinstance(r, UserRecord)] == ["first", "third"]
    assert [r.content for r in records(d, session) if isinstance(r, UserRecord)] == [
        "first",
        "second",
    ]
    # The fork's request extends turn 1's exactly: its answer, then the new message.
    turn_1, forked = fake.bodies[0]["messages"], fake.bodies[2]["messages"]
    assert forked[: len(turn_1)] == turn_1
    assert [m["content"] for m in forked[len(turn_1) :]] == ["answer-0", "third"]
    assert fake.prompts[2].startswith(fake.prompts[0])
    assert loaded == [["first", "third"], ["first", "third"]]

    # A new bxctl acp finds where the editor's id went on from the logs: the fork.
    async def load(conn: Any, editor: Editor) -> list[str]:
        await conn.load_session(cwd=str(notes), session_id=session)
        return users(editor)

    assert await with_editor(d, load) == ["first", "third"]


async def test_rewind_with_files_puts_them_back_or_refuses_saying_why_and_changes_nothing(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [
        Reply(content="answer-1"),
        edit("today.md", "milk", "tea"),
        write("new.md", "hello\n", "c2"),
        Reply(content="changed them"),
        Reply(content="from turn 1"),
    ]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    before = files_in(notes)

    async def rewound(conn: Any, editor: Editor) -> Any:
        session = (await conn.new_session(cwd=str(notes))).session_id
        for text in ("first", "change"):
            await conn.prompt(session_id=session, prompt=[text_block(text)])
        changed = files_in(notes)
        (notes / "new.md").write_bytes(b"changed by hand\n")
        said = []
        for command in ("/rewind 1 files", "/rewind 3", "/rewind 1 x", "fix", "/rewind 1 files"):
            if command == "fix":
                forks = forks_of(d, session)
                (notes / "new.md").write_bytes(b"hello\n")
                continue
            start = len(editor.said())
            answer = await conn.prompt(session_id=session, prompt=[text_block(command)])
            said.append((answer.stop_reason, editor.said()[start:]))
        put_back = files_in(notes)
        await conn.prompt(session_id=session, prompt=[text_block("again")])
        return session, changed, forks, said, put_back

    session, changed, forks, said, put_back = await with_editor(d, rewound)
    assert changed == {"new.md": b"hello\n", "today.md": b"buy tea\n"}
    assert forks == []  # the refusals made no fork
    hand, out_of_range, usage, went = said
    assert hand[0] == "end_turn"
    assert hand[1].startswith("loopd refused it (undo_refused): ")
    assert "new.md changed since" in hand[1]
    no_turn = f"session {session} has turns 1 to 2: there is no turn 3"
    assert out_of_range == ("end_turn", f"loopd refused it (fork_refused): {no_turn}")
    assert usage == ("end_turn", rewind.USAGE)
    (fork,) = forks_of(d, session)
    assert went[1].endswith(
        f"(a fork of {session}, which keeps the later turns).\nPut back as they were at the end "
        f"of turn 1:\n- {notes / 'new.md'}\n- {notes / 'today.md'}"
    )
    assert put_back == before  # byte for byte, new.md gone again
    said_there = [r.content for r in records(d, fork) if isinstance(r, UserRecord)]
    assert said_there == ["first", "again"]
    assert [r.content for r in records(d, session) if isinstance(r, UserRecord)] == [
        "first",
        "change",
    ]


async def test_resume_goes_on_without_the_history_and_finds_the_cache(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [Reply(content="Tea it is."), Reply(content="Sure.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')

    async def first(conn: Any, _: Editor) -> str:
        session = await conn.new_session(cwd=str(notes))
        await conn.prompt(session_id=session.session_id, prompt=[text_block("tea")])
        await conn.close_session(session_id=session.session_id)
        return str(session.session_id)

    session = await with_editor(d, first)

    async def again(conn: Any, editor: Editor) -> Any:
        await conn.resume_session(cwd=str(notes), session_id=session)
        shown = list(editor.kinds())
        answer = await conn.prompt(session_id=session, prompt=[text_block("and milk?")])
        return shown, answer

    editor = Editor()
    shown, answer = await with_editor(d, again, editor)
    assert not [k for k in shown if "message" in k or "tool_call" in k]  # nothing replayed
    assert len(editor.told("available_commands_update")) == 1
    assert editor.said() == "Sure."
    usages = [r.timings for r in records(d, session) if isinstance(r, UsageRecord) and r.timings]
    assert len(usages) == 2
    assert answer.usage.cached_read_tokens == usages[1].cache_n == slot_tokens(usages[0])
    (usage,) = editor.told("usage_update")  # before the prompt's answer
    assert (usage.used, usage.size) == (slot_tokens(usages[1]), 8192)  # the server's n_ctx
    assert usage.field_meta["loopd"] == {
        "promptTokens": answer.usage.input_tokens,
        "cachedTokens": slot_tokens(usages[0]),
    }


async def test_close_cancels_the_turn_and_leaves_the_session(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    slow = Reply(content="word " * 400, delay=0.05)
    d = await daemon(FakeLlama([slow]), tools=f'roots = ["{notes}"]')

    async def closed(conn: Any, editor: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        prompt = asyncio.ensure_future(
            conn.prompt(session_id=session.session_id, prompt=[text_block("talk")])
        )
        while "agent_message_chunk" not in editor.kinds():  # noqa: ASYNC110 - the editor's list
            await asyncio.sleep(0.02)
        await conn.close_session(session_id=session.session_id)
        answer = await prompt
        try:
            await conn.prompt(session_id=session.session_id, prompt=[text_block("hi")])
        except Exception as e:  # noqa: BLE001 - the package's RequestError
            return session.session_id, answer, e.code  # type: ignore[attr-defined]
        return session.session_id, answer, None

    session, answer, code = await with_editor(d, closed)
    assert answer.stop_reason == "cancelled"
    assert code == RESOURCE_NOT_FOUND
    with trio.fail_after(10):  # nobody is in it: loopd stops it and lets its log go
        while True:
            try:
                (await Store(d.home / "sessions").open(session)).close()
                break
            except SessionLocked:
                await trio.sleep(0.05)


async def test_an_editors_session_never_prompted_stays_for_a_later_prompt(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """acpx makes a session with one `bxctl acp` and prompts it with the next: a session the
    editor made is kept, empty or not (only a chat's empty session goes)."""
    notes = notes_folder(tmp_path)
    d = await daemon(FakeLlama([]), tools=f'roots = ["{notes}"]')

    async def opened(conn: Any, _: Editor) -> Any:
        return (await conn.new_session(cwd=str(notes))).session_id

    session = await with_editor(d, opened)
    await d.stop()  # every session's actor stops: an empty session would go by now
    assert Store(d.home / "sessions").path_of(session).exists()


async def test_loopds_commands_are_offered_and_run_as_prompts(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [write("today.md", "buy tea\n"), Reply(content="Tea it is."), Reply(content="Tea.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')

    async def commands(conn: Any, editor: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        while not editor.told("available_commands_update"):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await conn.prompt(session_id=session.session_id, prompt=[text_block("tea")])
        said = []
        for command in ("/status", "/undo", "/undo x", "/compact"):
            before = len(editor.said())
            answer = await conn.prompt(session_id=session.session_id, prompt=[text_block(command)])
            said.append((answer.stop_reason, editor.said()[before:]))
        return session.session_id, said

    editor = Editor()
    session, said = await with_editor(d, commands, editor)
    (offered,) = editor.told("available_commands_update")
    assert [c.name for c in offered.available_commands] == ["compact", "undo", "rewind", "status"]
    status, undo, bad_undo, compact = said
    assert status[0] == "end_turn"
    assert status[1].startswith(f"Session {session}: 1 turn, ")
    assert undo == ("end_turn", "Put back the changes of call 1:\n- " + str(notes / "today.md"))
    assert (notes / "today.md").read_text() == "buy milk\n"
    assert bad_undo == ("end_turn", "/undo, or /undo N for call N's changes alone")
    (continued,) = [s for s in Store(d.home / "sessions").sessions_now() if s.continues == session]
    compacted = f"Compacted: the session goes on in loopd session {continued.id}, from the "
    assert compact == ("end_turn", compacted + "model's summary of this one.")


async def test_an_unknown_session_is_not_found(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([]))

    async def unknown(conn: Any, _: Editor) -> list[str]:
        errors = []
        for call in (
            conn.load_session(cwd="/", session_id="20260101T000000000Z-aaaaaa"),
            conn.prompt(session_id="nope", prompt=[text_block("hi")]),
        ):
            try:
                await call
            except Exception as e:  # noqa: BLE001 - the package's RequestError
                errors.append(f"{e.code}")  # type: ignore[attr-defined]
        return errors

    assert await with_editor(d, unknown) == ["-32002", "-32002"]


async def terminal_session(d: Daemon, cwd: Path, prompt: str) -> str:
    """A session made by `bxctl chat -m PROMPT` run in folder `cwd`; its id."""
    logs = d.home / "sessions"
    before = set(logs.glob("*.jsonl"))
    code, _, said = await bxctl(d, "chat", "-m", prompt, cwd=cwd)
    assert code == 0, said
    (made,) = set(logs.glob("*.jsonl")) - before
    return made.stem


async def test_list_gives_a_folders_sessions_latest_first_a_page_at_a_time(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes, other = notes_folder(tmp_path), tmp_path / "other"
    other.mkdir()
    script = [Reply(content=said) for said in ("Here.", "There.", "Nowhere.", "Tea it is.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}", "{other}"]')
    store = Store(d.home / "sessions")
    older = []
    for _ in range(LIST_PAGE - 1):
        with await store.create(make_baseline(), cwd=notes) as made:
            older.append(made.id)
    terminal = await terminal_session(d, notes, "from the terminal\nand more")
    # A compaction goes on in a session that stands for the one it continues; a sub-agent's
    # session is its parent's business; a session of no folder matches none.
    with await store.create(make_baseline(), continues=terminal, cwd=notes) as made:
        compacted = made.id
    with await store.create(make_baseline(), parent=ParentCall(compacted, 1, "c1"), cwd=notes):
        pass
    elsewhere = await terminal_session(d, other, "over there")
    await terminal_session(d, tmp_path, "nowhere")  # outside the roots: a session of no folder
    logs = len(list((d.home / "sessions").glob("*.jsonl")))

    async def listing(conn: Any, _: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        await conn.prompt(session_id=session.session_id, prompt=[text_block("tea for two")])
        first = await conn.list_sessions(cwd=str(notes))
        second = await conn.list_sessions(cwd=str(notes), cursor=first.next_cursor)
        there = await conn.list_sessions(cwd=str(other) + "/")
        everywhere = await conn.list_sessions()
        rest = await conn.list_sessions(cursor=everywhere.next_cursor)
        return session.session_id, first, second, there, everywhere, rest

    editor, first, second, there, everywhere, rest = await with_editor(d, listing)
    assert len(list((d.home / "sessions").glob("*.jsonl"))) == logs + 1  # listing opened none
    assert len(first.sessions) == LIST_PAGE
    assert first.next_cursor is not None
    assert [s.session_id for s in second.sessions] == [older[0]]
    assert second.next_cursor is None
    listed = first.sessions + second.sessions
    assert [s.session_id for s in listed] == [editor, compacted, *reversed(older)]
    assert {s.cwd for s in listed} == {str(notes)}
    assert [s.title for s in listed[:3]] == ["tea for two", "from the terminal", None]
    assert all(s.updated_at for s in listed)
    assert listed[0].updated_at > listed[1].updated_at > listed[2].updated_at
    assert [(s.session_id, s.cwd) for s in there.sessions] == [(elsewhere, str(other))]
    assert len(everywhere.sessions) == LIST_PAGE
    assert len(rest.sessions) == 2
    assert rest.next_cursor is None
    assert {s.session_id for s in everywhere.sessions + rest.sessions} == {
        *(s.session_id for s in listed),
        elsewhere,
    }


class Raw:
    """`bxctl acp` with the test at its stdin: lines no client library would send."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.buffer = b""
        self.lines: list[bytes] = []
        """Every line it wrote on stdout, as it wrote it."""

    async def close(self) -> None:
        self.process.kill()
        await self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                await pipe.aclose()

    async def send(self, line: bytes) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(line + b"\n")

    async def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        with trio.fail_after(30):
            while b"\n" not in self.buffer:
                self.buffer += await self.process.stdout.receive_some(65536)
        line, self.buffer = self.buffer.split(b"\n", 1)
        self.lines.append(line)
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def to_the_end(self) -> None:
        """Close its stdin (the editor goes), and read its stdout until it exits."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        await self.process.stdin.aclose()
        with trio.fail_after(30):
            while data := await self.process.stdout.receive_some(65536):
                self.buffer += data
            await self.process.wait()
        self.lines += self.buffer.splitlines()
        self.buffer = b""

    async def request(self, id: int, method: str, params: Any) -> dict[str, Any]:  # noqa: A002
        """Its answer, past the notifications before it."""
        message = {"jsonrpc": "2.0", "id": id, "method": method, "params": params}
        await self.send(json.dumps(message).encode())
        while "id" not in (answer := await self.receive()):
            pass
        return answer

    async def answer(self, id: int, method: str, params: Any) -> dict[str, Any]:  # noqa: A002
        """The answer to a request, past the notifications that come before it."""
        answer = await self.request(id, method, params)
        while answer.get("id") != id:
            answer = await self.receive()
        return answer


async def raw_acp(
    d: Daemon, *args: str, bxctl: tuple[str, ...] = ("-m", "bxctl"), stderr: Any = None
) -> Raw:
    """`bxctl acp ARGS` on `d`'s config (`bxctl`: how Python runs it)."""
    command = [sys.executable, *bxctl, "--config", str(d.config), "acp", *args]
    process = await trio.lowlevel.open_process(command, stdin=-1, stdout=-1, stderr=stderr)
    return Raw(process)


def json_rpc(line: bytes) -> bool:
    """The line is one JSON-RPC 2.0 message: a request, a notification or an answer."""
    try:
        message = json.loads(line)
    except ValueError:
        return False
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return False
    return "method" in message or (
        "id" in message and ("result" in message) != ("error" in message)
    )


async def test_bad_lines_get_errors_and_bxctl_acp_goes_on(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([]))
    acp = await raw_acp(d)
    try:
        await acp.send(b"this is not JSON")
        assert (await acp.receive())["error"]["code"] == -32700
        await acp.send(b"[1, 2]")
        assert (await acp.receive())["error"]["code"] == INVALID_REQUEST
        answer = await acp.request(1, "session/fly", {})
        assert answer["id"] == 1
        assert answer["error"]["code"] == -32601
        answer = await acp.request(1, "session/delete", {"sessionId": "20261202T000000000Z-abc"})
        assert answer["error"]["code"] == -32601
        assert "append-only" in answer["error"]["message"]
        answer = await acp.request(2, "session/prompt", {"sessionId": 3})
        assert answer["error"]["code"] == INVALID_PARAMS
        assert answer["error"]["message"].startswith("session/prompt: sessionId: ")
        await acp.send(b'{"jsonrpc": "2.0", "id": 3, "method": "x", "params": "' + b"y" * MAX_LINE)
        answer = await acp.receive()
        assert answer["error"]["code"] == INVALID_REQUEST
        assert answer["error"]["message"] == f"a line may be at most {MAX_LINE} bytes"
        answer = await acp.request(4, "initialize", {"protocolVersion": 1})
        assert answer["result"]["agentCapabilities"]["loadSession"] is True
        sessions = answer["result"]["agentCapabilities"]["sessionCapabilities"]
        assert (sessions["list"], sessions["resume"], sessions["close"]) == ({}, {}, {})
        assert "delete" not in sessions
        assert answer["result"]["protocolVersion"] == 1
        answer = await acp.request(5, "session/list", {"cursor": "not ours"})
        assert answer["error"]["code"] == INVALID_PARAMS
        assert "not a cursor that session/list gave" in answer["error"]["message"]
    finally:
        await acp.close()


async def test_loopd_gone_is_an_error_and_a_new_prompt_works_once_it_is_back(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    slow = Reply(content="word " * 400, delay=0.05)
    d = await daemon(FakeLlama([slow, Reply(content="Back.")]), tools=f'roots = ["{notes}"]')
    acp = await raw_acp(d, "--no-start")
    new = {"cwd": str(notes), "mcpServers": []}
    try:
        session = (await acp.request(1, "session/new", new))["result"]
        prompt = {"sessionId": session["sessionId"], "prompt": [{"type": "text", "text": "hi"}]}
        await acp.send(
            json.dumps(
                {"jsonrpc": "2.0", "id": 2, "method": "session/prompt", "params": prompt}
            ).encode()
        )
        while (await acp.receive())["params"]["update"]["sessionUpdate"] in ASIDE:
            pass  # until the answer streams
        await d.kill()
        while "error" not in (answer := await acp.receive()):
            pass
        assert answer["id"] == 2
        assert answer["error"]["code"] == LOOPD_UNREACHABLE
        assert "loopd went away during the turn" in answer["error"]["message"]
        answer = await acp.request(3, "session/new", new)
        assert answer["error"]["code"] == LOOPD_UNREACHABLE
        assert "loopd is not running" in answer["error"]["message"]
        await d.start()
        answer = await acp.request(4, "session/prompt", prompt)
        while "id" not in answer:  # its answer's updates first
            answer = await acp.receive()
        assert answer["result"]["stopReason"] == "end_turn"
    finally:
        await acp.close()


@pytest.mark.llama
async def test_a_loaded_session_finds_its_whole_history_in_the_cache(tmp_path: Path) -> None:
    """A real llama-server of one slot: session A, then B takes the slot (A's cache goes to
    its slot file), then another `bxctl acp` loads A and prompts: the request finds all A's
    previous request left in the slot, restored."""
    notes = notes_folder(tmp_path)
    d = embedded(tmp_path / "loopd")
    config = d.config.read_text().replace("[server]\n", "[server]\nslots = 1\n", 1)
    d.config.write_text(config + f'[tools]\nroots = ["{notes}"]\n')
    await d.start()
    try:

        async def first(conn: Any, _: Editor) -> str:
            a = await conn.new_session(cwd=str(notes))
            await conn.prompt(session_id=a.session_id, prompt=[text_block("Name a colour.")])
            b = await conn.new_session(cwd=str(notes))
            await conn.prompt(session_id=b.session_id, prompt=[text_block("Name a fruit.")])
            return str(a.session_id)

        session = await with_editor(d, first)

        async def again(conn: Any, _: Editor) -> Any:
            await conn.load_session(cwd=str(notes), session_id=session)
            return await conn.prompt(session_id=session, prompt=[text_block("Another one.")])

        answer = await with_editor(d, again)
    finally:
        await d.end()
    usages = [r.timings for r in records(d, session) if isinstance(r, UsageRecord) and r.timings]
    assert len(usages) == 2
    assert answer.usage.cached_read_tokens == usages[1].cache_n == slot_tokens(usages[0])
    assert "restored the slot of session" in d.log.read_text()
    assert_no_loss(d, session)


@pytest.mark.llama
async def test_zeds_settings_from_just_zed_need_nothing_else(tmp_path: Path) -> None:
    """The entry `just zed` prints, run as Zed runs it: its command, args and env in a fresh
    home with no loopd config and no loopd running, in a project folder. The first prompt is
    answered by the bundled model, through a loopd that `bxctl acp` started itself."""
    shown = await trio.run_process(
        [sys.executable, str(ROOT / "scripts" / "assets.py"), "zed-settings"], capture_stdout=True
    )
    zed = json.loads(shown.stdout)["agent_servers"]["loopd"]
    home, run = tmp_path / "home", tmp_path / "run"
    project = home / "project"
    project.mkdir(parents=True)
    run.mkdir(mode=0o700)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(run)}

    async def chat() -> Any:
        editor = Editor()
        agent = spawn_agent_process(
            editor,  # type: ignore[arg-type]
            zed["command"],
            *zed["args"],
            env=env | zed["env"],
            cwd=project,
        )
        async with agent as (conn, _):
            await conn.initialize(protocol_version=PROTOCOL_VERSION)
            session = await conn.new_session(cwd=str(project), mcp_servers=[])
            answer = await conn.prompt(
                session_id=session.session_id,
                prompt=[text_block("What is the capital of France?")],
            )
            return answer, editor.said()

    pid_file = home / ".local" / "state" / "loopd" / "loopd.pid"
    try:
        answer, said = await trio.to_thread.run_sync(
            lambda: asyncio.run(asyncio.wait_for(chat(), 240))
        )
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
    assert answer.stop_reason == "end_turn"
    assert "Paris" in said


# -- loopd started on demand, and the editor's folder with no [tools] roots ----------------

ALLOW_WRITES = '[tools.policies.write_file]\naction = "allow"'


async def test_with_no_loopd_bxctl_acp_starts_one_that_works_in_the_editors_folder(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    """No loopd runs and no [tools] roots are set: the editor's session works in its folder,
    writing there (allowed by policy), and a write outside it is refused."""
    notes = notes_folder(tmp_path)
    script = [
        write("today.md", "buy tea\n"),
        Reply(content="Tea it is."),
        write("../outside.md", "escaped\n", "c2"),
        Reply(content="Could not."),
    ]
    d = await unstarted(FakeLlama(script), ALLOW_WRITES)
    assert not loopds_of(d.config)

    async def turns(conn: Any, _: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        first = await conn.prompt(session_id=session.session_id, prompt=[text_block("tea")])
        second = await conn.prompt(session_id=session.session_id, prompt=[text_block("out")])
        return session.session_id, first, second

    editor = Editor()
    session, first, second = await with_editor(d, turns, editor)
    assert (first.stop_reason, second.stop_reason) == ("end_turn", "end_turn")
    assert (notes / "today.md").read_text() == "buy tea\n"
    assert not (tmp_path / "outside.md").exists()
    assert editor.asked == []  # the policy allows writes
    results = [u for u in editor.updates if u.session_update == "tool_call_update"]
    assert [r.status for r in results] == ["completed", "failed"]
    assert "'..' is refused" in results[1].content[0].content.text
    assert editor.said() == "Tea it is.Could not."
    (pid,) = loopds_of(d.config)
    assert int((d.home / "loopd.pid").read_text()) == pid  # it goes on after bxctl acp
    assert Store(d.home / "sessions").read(session)[0].cwd == str(notes)
    assert "listening on" in (d.home / "loopd.log").read_text()


async def test_two_bxctl_acp_at_once_start_one_loopd_and_say_only_json_rpc(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    d = await unstarted(FakeLlama([Reply(content="Hi.")]))
    both = [await raw_acp(d), await raw_acp(d)]
    lines: list[dict[str, Any]] = []
    try:
        for acp in both:  # both ask at once, while no loopd runs
            await acp.send(json.dumps(_rpc(1, "initialize", {"protocolVersion": 1})).encode())
            new = {"cwd": str(notes), "mcpServers": []}
            await acp.send(json.dumps(_rpc(2, "session/new", new)).encode())
        for acp in both:
            while (line := await acp.receive()).get("id") != 2:  # json.loads: JSON, or fails
                lines.append(line)
            lines.append(line)
    finally:
        for acp in both:
            await acp.close()
    assert all(line["jsonrpc"] == "2.0" for line in lines)
    answers = [line for line in lines if line.get("id") == 2]
    assert [set(a) for a in answers] == [{"jsonrpc", "id", "result"}] * 2, answers
    assert len(loopds_of(d.config)) == 1


def outputs_of(pid: int) -> set[Path]:
    """What a process's stdout and stderr are."""
    return {Path(f"/proc/{pid}/fd/{fd}").readlink() for fd in (1, 2)}


async def test_a_loopd_that_bxctl_acp_starts_writes_to_its_log_never_to_the_editor(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    """Through initialize, session/new and a prompt, with the loopd it started logging: every
    line on stdout is JSON-RPC, and loopd's stdout and stderr are its log, not bxctl's pipes."""
    notes = notes_folder(tmp_path)
    d = await unstarted(FakeLlama([Reply(content="Hi.")]))
    acp = await raw_acp(d)
    try:
        await acp.answer(1, "initialize", {"protocolVersion": 1})
        new = await acp.answer(2, "session/new", {"cwd": str(notes), "mcpServers": []})
        session = new["result"]["sessionId"]
        prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "hi"}]}
        answer = await acp.answer(3, "session/prompt", prompt)
        (pid,) = loopds_of(d.config)
        outputs = outputs_of(pid)
        await acp.to_the_end()
    finally:
        await acp.close()
    assert answer["result"]["stopReason"] == "end_turn"
    assert outputs == {d.home / "loopd.log"}
    assert "listening on" in (d.home / "loopd.log").read_text()  # it logged, to its log
    assert acp.lines
    assert [line for line in acp.lines if not json_rpc(line)] == []


NOISY_BXCTL = """
import logging, subprocess, sys, warnings
from bxctl import acp
from bxctl.cli import main

serve = acp.Agent.serve

async def noisy(self, stdin):
    print("noise: a print")
    warnings.warn("noise: a warning", stacklevel=1)
    logging.getLogger("httpx").warning("noise: httpx")
    logging.getLogger("asyncio").error("noise: asyncio")
    subprocess.run(["echo", "noise: a child"], check=True)
    await serve(self, stdin)

acp.Agent.serve = noisy
sys.exit(main(sys.argv[1:]))
"""
"""`bxctl` whose agent, once it serves, prints, warns, logs as libraries do, and runs a child
that writes to its stdout."""


async def test_prints_warnings_logs_and_children_of_bxctl_acp_reach_stderr_not_the_editor(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    d = await unstarted(FakeLlama([]))
    with (tmp_path / "stderr").open("wb") as stderr:
        acp = await raw_acp(d, "--no-start", bxctl=("-c", NOISY_BXCTL), stderr=stderr)
        try:
            await acp.answer(1, "initialize", {"protocolVersion": 1})
            await acp.to_the_end()
        finally:
            await acp.close()
    assert acp.lines
    assert [line for line in acp.lines if not json_rpc(line)] == []
    said = (tmp_path / "stderr").read_text()
    for noise in ("a print", "a warning", "httpx", "asyncio", "a child"):
        assert f"noise: {noise}" in said


async def test_no_start_refuses_when_no_loopd_runs(unstarted: Unstarted, tmp_path: Path) -> None:
    d = await unstarted(FakeLlama([]))
    acp = await raw_acp(d, "--no-start")
    try:
        new = {"cwd": str(tmp_path), "mcpServers": []}
        answer = await acp.request(1, "session/new", new)
    finally:
        await acp.close()
    assert answer["error"]["code"] == LOOPD_UNREACHABLE
    assert "loopd is not running" in answer["error"]["message"]
    assert not loopds_of(d.config)
    assert not (d.home / "loopd.log").exists()


async def test_no_start_stays_up_and_serves_once_a_loopd_answers(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    """What `bxctl acp --help` says of --no-start: no exit, an error while no loopd runs."""
    d = await unstarted(FakeLlama([]))
    project = tmp_path / "project"
    project.mkdir()
    acp = await raw_acp(d, "--no-start")
    try:
        new = {"cwd": str(project), "mcpServers": []}
        refused = await acp.request(1, "session/new", new)
        await d.start()
        try:
            made = await acp.request(2, "session/new", new)
        finally:
            await d.end()
    finally:
        await acp.close()
    assert refused["error"]["code"] == LOOPD_UNREACHABLE
    assert made["result"]["sessionId"]


async def test_with_no_roots_a_folder_too_wide_or_holding_loopds_files_is_refused(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await daemon(FakeLlama([]))

    async def refused(conn: Any, _: Editor) -> list[str]:
        answers = []
        for cwd in ("/", str(Path.home()), str(tmp_path), str(d.home / "sessions")):
            try:
                await conn.new_session(cwd=cwd)
            except Exception as e:  # noqa: BLE001 - the package's RequestError
                answers.append(f"{e.code}: {e}")  # type: ignore[attr-defined]
            else:
                answers.append("accepted")
        return answers

    root, home, holds, inside = await with_editor(d, refused)
    assert root.startswith(f"{INVALID_PARAMS}: / is the root of the file system")
    assert f"{Path.home()} is your home folder" in home
    assert f"{tmp_path} holds loopd's own files" in holds
    assert f"{d.home / 'sessions'} is inside loopd's own files" in inside


async def test_the_editors_mcp_server_serves_its_session_alone_and_stops_when_it_closes(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes, pid_file = notes_folder(tmp_path), tmp_path / "pid"
    script = [
        tool_call("notes.read_note", {"title": "groceries"}),
        Reply(content="Eggs."),
        tool_call("notes.list_notes", {}),  # in another session
        Reply(content="No notes here."),
        Reply(tool_calls=(("c1", "find_tool", '{"query": "read a note"}'),)),
        Reply(content="None found."),
        Reply(content="Still here."),  # in a session whose server could not start
    ]
    allow = 'policies.notes = { action = "allow" }'
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]\n{allow}')
    server = {
        "name": "notes",
        "command": sys.executable,
        "args": [SERVER],
        "env": [{"name": "NOTES_PID_FILE", "value": str(pid_file)}],
    }
    broken = {"name": "broken", "command": str(tmp_path / "no-such-server"), "args": []}
    acp = await raw_acp(d)

    async def session(id: int, servers: list[dict[str, Any]]) -> str:  # noqa: A002
        new = {"cwd": str(notes), "mcpServers": servers}
        answer = await acp.answer(id, "session/new", new)
        return str(answer["result"]["sessionId"])

    async def prompt(id: int, session: str) -> str:  # noqa: A002
        params = {"sessionId": session, "prompt": [{"type": "text", "text": "notes?"}]}
        return str((await acp.answer(id, "session/prompt", params))["result"]["stopReason"])

    try:
        mine = await session(1, [server])
        assert await prompt(2, mine) == "end_turn"
        other = await session(3, [])
        assert await prompt(4, other) == "end_turn"
        assert await prompt(5, other) == "end_turn"
        pid = int(pid_file.read_text())
        assert (await acp.answer(6, "session/close", {"sessionId": mine}))["result"] == {}
        assert await gone(pid)
        working = await session(7, [{**broken, "env": []}])
        assert await prompt(8, working) == "end_turn"
        web = {"type": "acp", "name": "web", "serverId": "web-1"}
        refused = await acp.answer(9, "session/new", {"cwd": str(notes), "mcpServers": [web]})
    finally:
        await acp.close()
    results = [r for r in records(d, mine) if isinstance(r, ToolResultRecord)]
    assert [r.content for r in results] == ["eggs, milk, bread"]
    given = [r for r in records(d, mine) if isinstance(r, McpServersRecord)]
    assert given == [
        McpServersRecord(
            time=given[0].time,
            servers=(GivenServer(name="notes", command=(sys.executable, SERVER)),),
        )
    ]
    assert str(pid_file) not in (d.home / "sessions" / f"{mine}.jsonl").read_text()
    elsewhere = [r.content for r in records(d, other) if isinstance(r, ToolResultRecord)]
    assert elsewhere[0].startswith("There is no tool named 'notes.list_notes'")
    assert "notes." not in elsewhere[1]
    assert elsewhere[1].startswith("Tools for 'read a note'")
    assert [r.content for r in records(d, working) if isinstance(r, ToolResultRecord)] == []
    assert refused["error"]["code"] == INVALID_PARAMS
    assert (
        "MCP server 'web' is over acp: loopd runs MCP servers over stdio, http and sse"
        in (refused["error"]["message"])
    )


def _rpc(id: int, method: str, params: Any) -> dict[str, Any]:  # noqa: A002
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params}


# -- config options: the mode and thinking -----------------------------------------------------


def current(options: list[Any]) -> dict[str, str]:
    """Each config option's current value, by its id."""
    return {o.id: o.current_value for o in options}


async def set_option(conn: Any, session: str, config_id: str, value: str) -> dict[str, str]:
    answer = await conn.set_config_option(config_id=config_id, session_id=session, value=value)
    return current(answer.config_options)


async def test_read_only_refuses_writes_unasked_and_accept_edits_asks_only_to_run(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    tea = write("today.md", "buy tea\n")
    wipe = tool_call("run_command", {"command": "rm today.md"})
    script = [tea, Reply(content="No."), tea, Reply(content="Done."), wipe, Reply(content="No.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')

    async def turns(conn: Any, editor: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        sid = session.session_id
        offered = session.config_options
        read_only = await set_option(conn, sid, "mode", "read_only")
        await conn.prompt(session_id=sid, prompt=[text_block("tea")])
        refused = ((notes / "today.md").read_text(), len(editor.asked), editor.shown()[1])
        accepting = await set_option(conn, sid, "mode", "accept_edits")
        await conn.prompt(session_id=sid, prompt=[text_block("tea")])
        written = ((notes / "today.md").read_text(), len(editor.asked))
        await conn.prompt(session_id=sid, prompt=[text_block("clean up")])
        return offered, read_only, refused, accepting, written

    editor = Editor("deny")
    offered, read_only, refused, accepting, written = await with_editor(d, turns, editor)
    assert [(o.id, o.category, o.current_value) for o in offered] == [
        ("mode", "mode", "ask"),
        ("thought_level", "thought_level", "on"),
    ]
    assert [v.value for v in offered[0].options] == ["ask", "accept_edits", "read_only"]
    assert [v.value for v in offered[1].options] == ["on", "off"]
    assert read_only == {"mode": "read_only", "thought_level": "on"}
    text, asked, result = refused
    assert (text, asked) == ("buy milk\n", 0)  # untouched, and nobody was asked
    assert result.status == "failed"
    said = f"The call was denied: {read_only_refusal('write_file')}"
    assert said.startswith(result.content[0].content.text)  # its first line, cut
    assert accepting == {"mode": "accept_edits", "thought_level": "on"}
    assert written == ("buy tea\n", 0)
    assert [a.title for a in editor.asked] == ["run_command"]  # still asked, and denied
    assert (notes / "today.md").read_text() == "buy tea\n"


async def test_the_mode_and_thinking_hold_after_closing_and_a_loopd_restart(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    fake = FakeLlama([write("today.md", "buy tea\n"), Reply(content="Cannot.")])
    d = await daemon(fake, tools=f'roots = ["{notes}"]')

    async def first(conn: Any, _: Editor) -> str:
        session = await conn.new_session(cwd=str(notes))
        await set_option(conn, session.session_id, "mode", "read_only")
        await set_option(conn, session.session_id, "thought_level", "off")
        await conn.close_session(session_id=session.session_id)
        return str(session.session_id)

    session = await with_editor(d, first)
    await d.stop()
    await d.start()

    async def again(conn: Any, _: Editor) -> Any:
        resumed = await conn.resume_session(cwd=str(notes), session_id=session)
        await conn.prompt(session_id=session, prompt=[text_block("tea")])
        loaded = await conn.load_session(cwd=str(notes), session_id=session)
        return current(resumed.config_options), current(loaded.config_options)

    editor = Editor()
    resumed, loaded = await with_editor(d, again, editor)
    assert resumed == loaded == {"mode": "read_only", "thought_level": "off"}
    assert editor.asked == []
    assert (notes / "today.md").read_text() == "buy milk\n"
    thinking = [b["chat_template_kwargs"]["enable_thinking"] for b in fake.bodies]
    assert thinking == [False, False]
    modes = [(r.mode, r.thinking) for r in records(d, session) if isinstance(r, ModeRecord)]
    assert modes == [("read_only", None), ("read_only", False)]
    _, shown, _ = await bxctl(d, "log", session)
    assert "(mode set: read_only, thinking off)" in shown


async def test_a_plain_socket_client_cannot_get_past_a_read_only_mode(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """The editor made the session read-only; another client of loopd's socket, in the same
    session, tries to get a write and a command through: approvals sent ahead for the calls,
    fields no message has. Nothing is asked, nothing runs."""
    notes = notes_folder(tmp_path)
    script = [
        write("today.md", "owned\n"),
        tool_call("run_command", {"command": "rm today.md"}, "c2"),
        Reply(content="Tried."),
    ]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')

    async def read_only(conn: Any, _: Editor) -> str:
        session = await conn.new_session(cwd=str(notes))
        await set_option(conn, session.session_id, "mode", "read_only")
        return str(session.session_id)

    session = await with_editor(d, read_only)
    hostile = await d.connect()
    await hostile.send({"type": "hello", "session": session, "mode": "accept_edits"})
    await hostile.until("welcome")
    await hostile.send({"type": "subscribe"})
    send = {"type": "send", "id": "t1", "content": "go", "mode": "accept_edits", "grants": ["*"]}
    await hostile.send(send)
    for number in (1, 2):
        await hostile.send({"type": "approve", "call": number, "decision": "session"})
    lines = await hostile.until("turn_done")
    events = [line["event"]["kind"] for line in lines if line["type"] == "event"]
    assert "approval_needed" not in events
    assert {line["code"] for line in lines if line["type"] == "error"} == {"unknown_call"}
    assert (notes / "today.md").read_text() == "buy milk\n"
    results = [r.content for r in records(d, session) if isinstance(r, ToolResultRecord)]
    assert results == [
        f"The call was denied: {read_only_refusal(tool)}" for tool in ("write_file", "run_command")
    ]


async def test_an_unknown_option_or_value_is_invalid_params_saying_why(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    d = await daemon(FakeLlama([]), tools=f'roots = ["{notes}"]')
    acp = await raw_acp(d)
    try:
        new = await acp.request(1, "session/new", {"cwd": str(notes), "mcpServers": []})
        sid = new["result"]["sessionId"]
        (mode, _) = new["result"]["configOptions"]
        assert (mode["type"], mode["id"], mode["currentValue"]) == ("select", "mode", "ask")
        method = "session/set_config_option"
        asks: list[tuple[dict[str, Any], str]] = [
            ({"configId": "speed", "value": "fast"}, "no config option 'speed'"),
            ({"configId": "mode", "value": "yolo"}, "mode has no value 'yolo'"),
            ({"configId": "thought_level", "value": "high"}, "it is on or off"),
            ({"configId": "mode", "type": "boolean", "value": True}, "value: "),
        ]
        for n, (params, why) in enumerate(asks, start=2):
            answer = await acp.request(n, method, {"sessionId": sid, **params})
            assert answer["error"]["code"] == INVALID_PARAMS
            assert why in answer["error"]["message"]
        answer = await acp.request(
            9, method, {"sessionId": "x", "configId": "mode", "value": "ask"}
        )
        assert answer["error"]["code"] == RESOURCE_NOT_FOUND
        answer = await acp.request(
            10, method, {"sessionId": sid, "configId": "mode", "value": "ask"}
        )
        assert [o["currentValue"] for o in answer["result"]["configOptions"]] == ["ask", "on"]
    finally:
        await acp.close()


def test_bxctl_acp_started_with_stderr_closed_still_answers(tmp_path: Path) -> None:
    """An editor may start the agent with no stderr: what would go there goes nowhere."""
    bxctl = f"{sys.executable} -m bxctl --socket {tmp_path / 'loopd.sock'} acp --no-start"
    initialize = json.dumps(_rpc(1, "initialize", {"protocolVersion": 1})) + "\n"
    done = subprocess.run(
        ["sh", "-c", f"exec {bxctl} 2>&-"],
        input=initialize.encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    (line,) = done.stdout.decode().splitlines()
    assert json.loads(line)["result"]["agentInfo"]["name"] == "loopd"
    assert done.returncode == 0
