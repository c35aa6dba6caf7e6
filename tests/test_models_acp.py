"""Several models (`[models.NAME]`) as the clients see them: an editor's `model` config option,
a change of mode, thinking or model heard by every client of the session, the session's title
told to the editor, a compaction that keeps the model, `status` of the session's own model,
`/model` in `bxctl chat`, and `loopd check-config` reaching each model's servers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import trio
from acp import text_block

from bxctl.jsonrpc import INVALID_PARAMS
from conftest import NO_SLOT_FILES
from loopd.session.compact import INSTRUCTIONS
from loopd.session.records import ModeRecord, SummaryRecord
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer
from test_acp import Editor, current, set_option, with_editor
from test_bxctl import Tmux


async def serving(nursery: trio.Nursery, fake: FakeLlama) -> ReplayServer:
    """A scripted server of one model, answering until the test ends."""
    server = ReplayServer([fake] * 10)
    await nursery.start(server.run)
    return server


def two_models(home: Path, small: str, big: str, *, start: str = "") -> Daemon:
    """loopd's config with models `small` (the default) and `big` at those URLs (scripted
    servers), not started; `start`: more lines of its [session] table."""
    d = Daemon(home, small, session=start, slots=NO_SLOT_FILES)
    d.config.write_text(
        d.config.read_text().replace(f'url = "{small}"\n', "")
        + f'[models.small]\nurl = "{small}"\n[models.big]\nurl = "{big}"\n'
    )
    return d


# -- loopd check-config ----------------------------------------------------------------------


async def check_config(d: Daemon) -> tuple[int, str]:
    done = await trio.run_process(
        [sys.executable, "-m", "loopd", "check-config", "--config", str(d.config)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return done.returncode, done.stdout.decode()


async def test_check_config_reaches_each_models_server_and_lists_them(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small = await serving(nursery, FakeLlama([]))
    big = await serving(nursery, FakeLlama([]))
    status, out = await check_config(two_models(tmp_path, small.url, big.url))
    assert status == 0, out
    said = [line for line in out.splitlines() if line.startswith("# server")]
    found = "llama-server (found), model SmolLM2-135M-Instruct.Q4_1.gguf, a window of 8192 tokens"
    assert said == [
        f"# server {small.url} (model small): {found}",
        f"# server {big.url} (model big): {found}",
    ]


async def test_check_config_fails_naming_a_model_whose_server_or_file_cannot_be_used(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small = await serving(nursery, FakeLlama([]))
    refused = "http://127.0.0.1:9"  # discard: nothing listens
    d = two_models(tmp_path, small.url, refused)
    gone = tmp_path / "gone.gguf"
    d.config.write_text(d.config.read_text() + f'[models.local]\nmodel = "{gone}"\n')
    status, out = await check_config(d)
    assert status == 1
    said = [line for line in out.splitlines() if line.startswith("# server")]
    assert said[0].startswith(f"# server {small.url} (model small): llama-server (found)")
    assert said[1] == (
        f"# server {refused} (model big): cannot be used: cannot connect to the server at "
        f"{refused}: Connection refused"
    )
    cannot = "the embedded llama-server cannot start"
    assert said[2:] == [f"# server (model local): {cannot}: the model {gone} does not exist"]


# -- compaction ------------------------------------------------------------------------------


async def started(d: Daemon) -> LineClient:
    """`d` started, and a client of it in a new session."""
    await d.start()
    client = await d.connect()
    await client.send({"type": "hello", "session": "new"})
    await client.until("welcome")
    return client


async def test_a_compacted_session_goes_on_on_its_model_which_writes_the_summary(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small = FakeLlama([Reply(content="Red.")])
    summary = "We named a colour and a fruit."
    big = FakeLlama([Reply(content="Apple."), Reply(content=summary), Reply(content="Oak.")])
    small_server, big_server = await serving(nursery, small), await serving(nursery, big)
    d = two_models(tmp_path, small_server.url, big_server.url)
    try:
        client = await started(d)
        assert (await client.turn("t1", "Name a colour."))[-1]["type"] == "turn_done"
        await client.send({"type": "set_mode", "model": "big"})
        await client.until("mode")
        assert (await client.turn("t2", "Name a fruit."))[-1]["type"] == "turn_done"
        await client.send({"type": "compact", "id": "c1"})
        lines = await client.until("turn_done")
        (continued,) = [
            line["event"]
            for line in lines
            if line["type"] == "event" and line["event"]["kind"] == "session_continued"
        ]
        assert (await client.turn("t3", "Name a tree."))[-1]["type"] == "turn_done"
        await client.send({"type": "status"})
        status = (await client.until("status"))[-1]
    finally:
        await d.end()
    assert continued["summary"] == summary
    assert len(small.bodies) == 1  # the colour alone
    assert big.bodies[1]["messages"][0]["content"] == INSTRUCTIONS
    assert big.bodies[2]["messages"][-1]["content"] == "Name a tree."
    assert (status["session"], status["session_model"]) == (continued["session"], "big")
    new = Store(d.home / "sessions").read(continued["session"])[1]
    assert [r.model for r in new if isinstance(r, ModeRecord)] == ["big"]
    assert isinstance(new[0], SummaryRecord)


# -- bxctl acp: the model option, changes heard, the title -------------------------------------


async def editors_loopd(
    tmp_path: Path, nursery: trio.Nursery, small: FakeLlama, big: FakeLlama
) -> tuple[Daemon, Path]:
    """A started loopd of models `small` and `big`, and a folder for an editor's sessions."""
    small_url, big_url = (await serving(nursery, small)).url, (await serving(nursery, big)).url
    d = two_models(tmp_path / "loopd", small_url, big_url)
    await d.start()
    notes = tmp_path / "notes"
    notes.mkdir()
    return d, notes


async def test_an_editor_is_offered_the_models_and_its_choice_runs_the_next_turn(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small, big = FakeLlama([]), FakeLlama([Reply(content="Oak.")])
    d, notes = await editors_loopd(tmp_path, nursery, small, big)

    async def choose(conn: Any, _: Editor) -> Any:
        session = await conn.new_session(cwd=str(notes))
        sid = session.session_id
        chosen = await set_option(conn, sid, "model", "big")
        await conn.prompt(session_id=sid, prompt=[text_block("Name a tree.")])
        try:
            await conn.set_config_option(config_id="model", session_id=sid, value="huge")
        except Exception as e:  # noqa: BLE001 - the package's RequestError
            refused = (e.code, f"{e} {e.data}")  # type: ignore[attr-defined]
        return session.config_options, chosen, refused

    try:
        offered, chosen, refused = await with_editor(d, choose)
    finally:
        await d.end()
    model = offered[-1]
    assert (model.id, model.category, model.current_value) == ("model", "model", "small")
    assert [o.value for o in model.options] == ["small", "big"]
    assert chosen == {"mode": "ask", "thought_level": "on", "model": "big"}
    assert (len(small.bodies), len(big.bodies)) == (0, 1)
    assert refused[0] == INVALID_PARAMS
    assert "no model 'huge': loopd serves small, big" in refused[1]


async def test_a_change_by_another_client_reaches_the_editor_as_a_config_option_update(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    d, notes = await editors_loopd(tmp_path, nursery, FakeLlama([]), FakeLlama([]))

    async def changed(conn: Any, editor: Editor) -> Any:
        sid = (await conn.new_session(cwd=str(notes))).session_id
        reader, writer = await asyncio.open_unix_connection(str(d.socket))
        for message in (
            {"type": "hello", "session": sid},
            {"type": "set_mode", "model": "big", "thinking": False},
        ):
            writer.write(json.dumps(message).encode() + b"\n")
        lines = [json.loads(await reader.readline()) for _ in range(2)]
        writer.close()
        while not editor.told("config_option_update"):  # noqa: ASYNC110 - the editor's own
            await asyncio.sleep(0.05)
        return lines

    editor = Editor()
    try:
        lines = await with_editor(d, changed, editor)
    finally:
        await d.end()
    assert [line["type"] for line in lines] == ["welcome", "mode"]  # no mode_changed for it
    (update,) = editor.told("config_option_update")
    assert current(update.config_options) == {
        "mode": "ask",
        "thought_level": "off",
        "model": "big",
    }


async def test_the_editor_is_told_the_sessions_title_once_it_has_one(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small = FakeLlama([Reply(content="Red."), Reply(content="Apple.")])
    d, notes = await editors_loopd(tmp_path, nursery, small, FakeLlama([]))

    async def titled(conn: Any, editor: Editor) -> Any:
        sid = (await conn.new_session(cwd=str(notes))).session_id
        before = list(editor.told("session_info_update"))
        await conn.prompt(session_id=sid, prompt=[text_block("Name a colour.\nAny will do.")])
        await conn.prompt(session_id=sid, prompt=[text_block("Name a fruit.")])
        return before

    editor = Editor()
    try:
        before = await with_editor(d, titled, editor)
    finally:
        await d.end()
    assert before == []
    assert [u.title for u in editor.told("session_info_update")] == ["Name a colour."]


# -- bxctl chat ------------------------------------------------------------------------------


async def test_chat_model_names_sets_and_refuses_and_shows_another_clients_change(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small, big = FakeLlama([]), FakeLlama([])
    d, _ = await editors_loopd(tmp_path, nursery, small, big)
    tmux = Tmux(f"models-{id(d):x}")
    try:
        await tmux.chat(d, tmp_path / "state")
        await tmux.wait_for("/help for help")
        await tmux.keys("/model", "Enter")
        await tmux.wait_for("model: small (of small, big)")
        await tmux.keys("/model huge", "Enter")
        await tmux.wait_for("no model 'huge': loopd serves small, big")
        await tmux.keys("/model big", "Enter")
        await tmux.wait_for("model: big (of small, big)")
        other = await d.connect()
        await other.send({"type": "hello", "session": "latest"})
        await other.until("welcome")
        await other.send({"type": "set_mode", "model": "small"})
        await other.until("mode")
        await tmux.keys("Enter")
        said = "(another client set this session's mode ask, thinking on, model small)"
        await tmux.wait_for(said)
    finally:
        await tmux.close()
        await d.end()


async def test_status_describes_the_server_of_the_sessions_own_model(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    small = await serving(nursery, FakeLlama([]))
    big = await serving(nursery, FakeLlama([]))
    d = two_models(tmp_path, small.url, big.url)
    await d.start()
    try:
        client = await d.connect()
        await client.send({"type": "hello", "session": "new"})
        await client.until("welcome")
        seen = []
        for model in (None, "big"):
            if model is not None:
                await client.send({"type": "set_mode", "model": model})
                await client.until("mode")
            await client.send({"type": "status"})
            status = (await client.until("status"))[-1]
            seen.append((status["session_model"], status["server"], status["context_size"]))
    finally:
        await d.end()
    assert seen == [("small", small.url, 8192), ("big", big.url, 8192)]
