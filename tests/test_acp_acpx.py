"""`bxctl acp` driven by acpx, the headless ACP client from npm (not written here), against a
real `loopd serve` on a scripted model: a turn with a write and its permission, a new acpx
process going on with the session (`session/resume`: no history replayed), a cancel, a denial."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import ROOT
from loopd.session.records import UserRecord
from loopd.session.store import Store
from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply
from test_hands import notes_folder, write

StartDaemon = Callable[..., Awaitable[Daemon]]


def acpx_binary() -> Path:
    path = Path(os.environ.get("LOOPD_ACPX") or ROOT / ".cache/acpx/node_modules/.bin/acpx")
    if not path.exists():
        pytest.fail(f"{path} is missing: run `just test` (or set LOOPD_ACPX)", pytrace=False)
    return path


class Acpx:
    """acpx with a home of its own (its sessions live there), in the notes folder, with
    `bxctl acp` as its agent."""

    def __init__(self, d: Daemon, cwd: Path, home: Path) -> None:
        agent = f"{sys.executable} -m bxctl --config {d.config} acp"
        # A queue owner keeps the agent for a second after a prompt: the next acpx starts
        # `bxctl acp` anew, which loads the session.
        self.base = [str(acpx_binary()), "--agent", agent, "--cwd", str(cwd), "--ttl", "1"]
        home.mkdir()
        self.env = {**os.environ, "HOME": str(home)}

    async def run(self, *args: str) -> tuple[int, str]:
        with trio.fail_after(90):
            done = await trio.run_process(
                [*self.base, *args],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=self.env,
            )
        return done.returncode, done.stdout.decode() + done.stderr.decode()

    async def prompt(self, *args: str, status: int = 0) -> list[dict[str, Any]]:
        """A prompt in the session of the folder; the ACP messages acpx saw, both ways."""
        code, out = await self.run("--format", "json", *args)
        assert code == status, out
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


ASIDE = ("available_commands_update", "usage_update")
"""Updates that tell the session's commands and usage, not what happened in it."""


def methods(messages: list[dict[str, Any]]) -> list[str]:
    """The methods called, either way (not the updates `ASIDE`)."""
    return [
        m["method"]
        for m in messages
        if "method" in m and _update(m).get("sessionUpdate") not in ASIDE
    ]


def _update(message: dict[str, Any]) -> dict[str, Any]:
    update = (message.get("params") or {}).get("update")
    return update if isinstance(update, dict) else {}


def stop_reason(messages: list[dict[str, Any]]) -> str:
    return str(
        next(m["result"]["stopReason"] for m in messages if "stopReason" in m.get("result", {}))
    )


async def test_acpx_runs_a_turn_with_a_permission_then_goes_on_in_a_new_process(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    notes = notes_folder(tmp_path)
    script = [write("today.md", "buy tea\n"), Reply(content="Tea it is."), Reply(content="Sure.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    acpx = Acpx(d, notes, tmp_path / "home")
    code, out = await acpx.run("sessions", "new")
    assert code == 0, out
    session = out.split()[0]

    first = await acpx.prompt("--approve-all", "prompt", "tea please")
    assert methods(first) == [
        "initialize",
        "session/resume",  # acpx made the session with one agent process, prompts with another
        "session/prompt",
        "session/update",
        "session/request_permission",
        *["session/update"] * (len(methods(first)) - 5),
    ]
    asked = next(m for m in first if m.get("method") == "session/request_permission")
    (diff,) = asked["params"]["toolCall"]["content"]  # ACP's diff, as acpx got it
    assert diff == {
        "type": "diff",
        "path": str(notes / "today.md"),
        "oldText": "buy milk\n",
        "newText": "buy tea\n",
    }
    assert stop_reason(first) == "end_turn"
    assert (notes / "today.md").read_text() == "buy tea\n"

    await trio.sleep(2)  # the queue owner, and its `bxctl acp`, are gone
    second = await acpx.prompt("--approve-all", "prompt", "and milk?")
    resume = next(m for m in second if m.get("method") == "session/resume")
    assert resume["params"]["sessionId"] == session
    assert "user_message_chunk" not in [_update(m).get("sessionUpdate") for m in second]
    offered = [_update(m) for m in second if _update(m).get("sessionUpdate") in ASIDE]
    assert next(u["sessionUpdate"] for u in offered) == "available_commands_update"
    assert stop_reason(second) == "end_turn"
    records = Store(d.home / "sessions").read(session)[1]
    assert [r.content for r in records if isinstance(r, UserRecord)] == ["tea please", "and milk?"]


async def test_acpx_cancel_ends_the_running_prompt(daemon: StartDaemon, tmp_path: Path) -> None:
    notes = notes_folder(tmp_path)
    fake = FakeLlama([Reply(content="word " * 400, delay=0.05)])  # 20 s of answer
    d = await daemon(fake, tools=f'roots = ["{notes}"]')
    acpx = Acpx(d, notes, tmp_path / "home")
    assert (await acpx.run("sessions", "new"))[0] == 0
    answers: list[list[dict[str, Any]]] = []

    async def prompt() -> None:
        answers.append(await acpx.prompt("prompt", "talk"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prompt)
        with trio.fail_after(60):
            while not fake.prompts:  # noqa: ASYNC110 - the model has not been asked yet
                await trio.sleep(0.1)
        code, out = await acpx.run("cancel")
        assert (code, "cancel requested" in out) == (0, True), out
    assert "session/cancel" in methods(answers[0])
    assert stop_reason(answers[0]) == "cancelled"


async def test_acpx_deny_all_leaves_the_file_alone(daemon: StartDaemon, tmp_path: Path) -> None:
    notes = notes_folder(tmp_path)
    script = [write("today.md", "buy tea\n"), Reply(content="Not done.")]
    d = await daemon(FakeLlama(script), tools=f'roots = ["{notes}"]')
    acpx = Acpx(d, notes, tmp_path / "home")
    # acpx's exit status 5: a permission was denied.
    messages = await acpx.prompt("--deny-all", "exec", "tea please", status=5)
    assert "session/request_permission" in methods(messages)
    assert stop_reason(messages) == "end_turn"
    assert (notes / "today.md").read_text() == "buy milk\n"
