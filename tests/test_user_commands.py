"""The user's and the project's slash commands (`.loopd/commands/NAME.md`): found nearest first,
loopd's own names kept, `$ARGUMENTS` filled; sent as the message through `bxctl chat` (in tmux)
and `bxctl acp` (an editor, which is offered them), to a real `loopd serve`."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from acp import text_block

from bxctl.user_commands import expand, find_commands
from conftest import StartDaemon
from support.fake_llama import FakeLlama, Reply
from test_acp import Editor, with_editor
from test_bxctl import Tmux

REVIEW = "---\ndescription: Review a file\nargument-hint: FILE\n---\nReview $ARGUMENTS for bugs.\n"


def command(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    path.write_text(text)
    return path


def last_user_message(fake: FakeLlama) -> str:
    content: str = [m for m in fake.bodies[-1]["messages"] if m["role"] == "user"][-1]["content"]
    return content


def test_commands_are_found_nearest_first_then_the_users(tmp_path: Path) -> None:
    project, user = tmp_path / "repo" / "app", tmp_path / "config" / "commands"
    command(project / ".loopd" / "commands", "review", REVIEW)
    command(tmp_path / "repo" / ".loopd" / "commands", "review", "farther: loses\n")
    command(tmp_path / "repo" / ".loopd" / "commands", "ship", "Ship it.\n")
    command(user, "ship", "mine: loses to the project's\n")
    command(user, "standup", "# Standup\nWhat did I do yesterday?\n")
    command(user, "status", "loopd's own name: not offered\n")
    command(user, "bad name", "not a name\n")
    (user / "notes.txt").write_text("not Markdown\n")
    found = find_commands(project, user, reserved={"status"})
    assert sorted(found) == ["review", "ship", "standup"]
    assert (found["review"].description, found["review"].hint) == ("Review a file", "FILE")
    assert found["ship"].text == "Ship it.\n"
    assert found["standup"].description == "Standup"  # no front matter: its first line
    assert sorted(find_commands(None, user)) == ["ship", "standup", "status"]


def test_arguments_fill_the_placeholders_or_follow_the_text(tmp_path: Path) -> None:
    found = find_commands(None, tmp_path)
    assert found == {}
    review = command(tmp_path, "review", REVIEW)
    command(tmp_path, "pair", "Compare $1 with $2.\n")
    command(tmp_path, "plain", "Say hello.\n")
    found = find_commands(None, tmp_path)
    assert found["review"].path == review
    assert expand(found["review"], "src/app.py") == "Review src/app.py for bugs.\n"
    assert expand(found["pair"], "a.py b.py") == "Compare a.py with b.py.\n"
    assert expand(found["pair"], "a.py") == "Compare a.py with .\n"
    assert expand(found["plain"], "") == "Say hello.\n"
    assert expand(found["plain"], "in French") == "Say hello.\n\nARGUMENTS: in French"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_a_project_command_in_the_chat_sends_its_text(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    here = tmp_path / "project"
    command(here / ".loopd" / "commands", "review", REVIEW)
    fake = FakeLlama([Reply(content="Looks fine.")])
    d = await daemon(fake, tools=f'roots = ["{here}"]')
    tmux = Tmux(f"commands-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", cwd=here, columns=120)
    try:
        await tmux.wait_for("/help for help")
        await tmux.keys("/help", "Enter")
        await tmux.wait_for("/review FILE   Review a file")
        await tmux.keys("/review notes.md", "Enter")
        await tmux.wait_for("Looks fine.")
        assert "review.md)" in await tmux.screen()  # where the text came from
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    assert last_user_message(fake) == "Review notes.md for bugs.\n"


async def test_an_editor_is_offered_the_users_command_and_runs_it(
    daemon: StartDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "project"
    command(here / ".loopd" / "commands", "review", REVIEW)
    home = tmp_path / "home"
    command(home / ".config" / "loopd" / "commands", "standup", "What did I do yesterday?\n")
    # `bxctl acp`, started below, gets an editor's trimmed environment: HOME, not XDG_*.
    monkeypatch.setenv("HOME", str(home))
    fake = FakeLlama([Reply(content="Reviewed."), Reply(content="You shipped.")])
    d = await daemon(fake, tools=f'roots = ["{here}"]')

    async def run(conn: Any, editor: Editor) -> None:
        session = await conn.new_session(cwd=str(here))
        while not editor.told("available_commands_update"):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        for prompt in ("/review app.py", "/standup"):
            await conn.prompt(session_id=session.session_id, prompt=[text_block(prompt)])

    editor = Editor()
    await with_editor(d, run, editor)
    (offered,) = editor.told("available_commands_update")
    names = [c.name for c in offered.available_commands]
    assert names == ["compact", "undo", "rewind", "status", "review", "standup"]
    review = offered.available_commands[4]
    assert review.description == "Review a file"
    assert review.input.root.hint == "FILE"
    said = [[m for m in b["messages"] if m["role"] == "user"][-1]["content"] for b in fake.bodies]
    assert said == ["Review app.py for bugs.\n", "What did I do yesterday?\n"]
