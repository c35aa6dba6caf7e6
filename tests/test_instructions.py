"""`AGENTS.md` files in a session's baseline: read once when the session is made, from its folder
up to its root and the user's own, never a hidden one, bounded, and kept as the header says for
the session's whole life (after a restart too), so every request extends the one before it. A
real `loopd serve` on a scripted model that records the prompts it got."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import StartDaemon
from loopd.actors._instructions import InstructionReader
from loopd.session.baseline import make_baseline
from loopd.session.instructions import carried, with_instructions
from loopd.session.records import SessionHeader
from loopd.session.store import Store
from loopd.tools import Roots
from loopd.wire.proto import PROTOCOL
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply, render


def answered(content: str) -> bytes:
    """What the slot holds of an answer, as the next prompt must carry it."""
    return render([Reply(content=content).as_message()])


def header(d: Daemon, session: str) -> SessionHeader:
    return Store(d.home / "sessions").read(session)[0]


async def hello(client: LineClient, session: str, cwd: Path | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "hello", "protocol": PROTOCOL, "session": session}
    if cwd is not None:
        message["cwd"] = str(cwd)
    await client.send(message)
    return (await client.until("welcome"))[-1]


@pytest.fixture
def project(tmp_path: Path) -> dict[str, Path]:
    """A root, a folder in it with a hidden `AGENTS.md`, the session's folder under that, and
    the user's own config folder."""
    root = tmp_path / "root"
    hidden = root / "app"
    work = hidden / "web"
    work.mkdir(parents=True)
    (root / "AGENTS.md").write_text("Rule of the root: answer in English.\n")
    (hidden / "AGENTS.md").write_text("HIDDEN RULE: never seen.\n")
    (work / "AGENTS.md").write_text("Rule of web: use tabs.\n")
    config = tmp_path / "xdg"
    (config / "loopd").mkdir(parents=True)
    (config / "loopd" / "AGENTS.md").write_text("Rule of the user: be brief.\n")
    return {"root": root, "hidden": hidden, "work": work, "config": config}


async def test_agents_md_reach_the_prompt_and_stay_as_the_header_says(
    daemon: StartDaemon, project: dict[str, Path]
) -> None:
    root, work = project["root"], project["work"]
    llama = FakeLlama([Reply(content=f"answer {n}") for n in range(1, 6)])
    tools = f'roots = ["{root}"]\n[tools.run]\ndeny_read = ["{project["hidden"] / "AGENTS.md"}"]'
    env = {**os.environ, "XDG_CONFIG_HOME": str(project["config"])}
    d = await daemon(llama, tools=tools, env=env)
    client = await d.connect()
    welcome = await hello(client, "new", work)
    session = welcome["session"]
    user = str(project["config"] / "loopd" / "AGENTS.md")
    paths = [user, str(root / "AGENTS.md"), str(work / "AGENTS.md")]
    assert welcome["instructions"] == paths
    assert (await client.turn("t1", "hi"))[-1]["type"] == "turn_done"
    assert (await client.turn("t2", "and?"))[-1]["type"] == "turn_done"

    first = llama.prompts[0].decode()
    rules = ["Rule of the user", "Rule of the root", "Rule of web"]
    assert [first.index(r) for r in rules] == sorted(first.index(r) for r in rules)
    for path in paths:
        assert f'<agents-md path=\\"{path}\\">' in first
    assert "HIDDEN RULE" not in first
    # The second request is the first, its answer, then what is new: nothing recomputed.
    assert llama.prompts[1].startswith(llama.prompts[0] + answered("answer 1"))
    recorded = header(d, session).instructions
    assert recorded is not None
    assert [(f.path, f.sha256) for f in recorded.files] == [
        (p, hashlib.sha256(Path(p).read_bytes()).hexdigest())  # noqa: ASYNC240 - a test
        for p in paths
    ]

    # A change to a file, then loopd restarted: the session goes on as its header says.
    (work / "AGENTS.md").write_text("Rule of web, changed: use spaces.\n")
    await client.aclose()
    await d.stop()
    await d.start()
    client = await d.connect()
    assert (await hello(client, session))["instructions"] == paths
    assert (await client.turn("t3", "more"))[-1]["type"] == "turn_done"
    assert llama.prompts[2].startswith(llama.prompts[1] + answered("answer 2"))
    assert "use spaces" not in llama.prompts[2].decode()

    # A new session reads the files as they are now.
    new = await hello(client, "new", work)
    assert (await client.turn("t4", "hi"))[-1]["type"] == "turn_done"
    assert "use spaces" in llama.prompts[3].decode()
    assert "use tabs" not in llama.prompts[3].decode()
    assert header(d, new["session"]).instructions != recorded


def reader(root: Path, limit: int, private: list[Path] | None = None) -> InstructionReader:
    return InstructionReader(
        roots=Roots([root], private or []), user=None, keys=Roots([]), limit=limit
    )


def test_past_the_bound_a_file_is_cut_and_the_prompt_says_where(tmp_path: Path) -> None:
    work = tmp_path / "root" / "work"
    work.mkdir(parents=True)
    (tmp_path / "root" / "AGENTS.md").write_text("far " * 50)
    (work / "AGENTS.md").write_text("é" * 30)  # 60 bytes, nearest: it comes first
    read = reader(tmp_path / "root", 81).read(work)
    far, near = (file for file, _ in read.files)
    assert (near.size, near.kept) == (60, 60)
    assert (far.size, far.kept) == (200, 21)
    baseline, instructions = with_instructions(make_baseline("prompt"), read)
    assert instructions is not None
    assert baseline.system.startswith("prompt\n\n# Instructions from AGENTS.md files")
    assert instructions.text(baseline) == baseline.system[len("prompt\n\n") :]
    assert "far " * 5 + "f\n[cut here: the last 179 of this file's 200 bytes" in baseline.system
    assert "[session] instructions_bytes" in baseline.system
    assert "é" * 30 + "\n</agents-md>" in baseline.system

    # A cut inside a character moves back to its start; a file with no room left is named.
    read = reader(tmp_path / "root", 59).read(work)
    assert [(f.kept, f.size) for f, _ in read.files] == [(1, 200), (58, 60)]
    read = reader(tmp_path / "root", 58).read(work)
    assert [(f.kept, f.size) for f, _ in read.files] == [(0, 200), (58, 60)]
    assert (
        "[left out: all 200 bytes of this file"
        in with_instructions(make_baseline(), read)[0].system
    )


def test_hidden_files_and_links_out_of_the_root_are_never_read(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "keys").mkdir(parents=True)
    outside.mkdir()
    (outside / "AGENTS.md").write_text("outside")
    (root / "keys" / "AGENTS.md").write_text("secret")
    (root / "AGENTS.md").symlink_to(outside / "AGENTS.md")
    read = reader(root, 1000, [root / "keys"]).read(root / "keys")
    assert read.files == ()
    (root / "AGENTS.md").unlink()
    (root / "AGENTS.md").symlink_to(root / "keys" / "AGENTS.md")
    assert reader(root, 1000, [root / "keys"]).read(root).files == ()
    assert reader(root, 0).read(root).files == ()


def test_a_session_that_continues_another_or_a_sub_agent_carries_its_text(
    tmp_path: Path,
) -> None:
    (tmp_path / "AGENTS.md").write_text("keep it short")
    parent, instructions = with_instructions(
        make_baseline("old prompt"), reader(tmp_path, 100).read(tmp_path)
    )
    (tmp_path / "AGENTS.md").write_text("changed")
    child, again = carried(parent, instructions, make_baseline("new prompt"))
    assert again is not None
    assert instructions is not None
    assert again.files == instructions.files
    assert again.text(child) == instructions.text(parent)
    assert child.system == f"new prompt\n\n{instructions.text(parent)}"
    assert carried(parent, None, make_baseline("x")) == (make_baseline("x"), None)


def test_a_header_without_instructions_still_reads() -> None:
    line = (
        '{"kind":"session","time":"2026-01-01T00:00:00Z","id":"20260101T000000000Z-aaaaaa",'
        '"created":"2026-01-01T00:00:00Z","baseline":{"system":"s","tools":[]},'
        '"loopd_version":"0.1","format":5}'
    )
    header = SessionHeader.model_validate_json(line)
    assert header.instructions is None
