"""Skills (Agent Skills' `SKILL.md` folders): found where a session works and in the user's
config folder, never outside the roots or among hidden paths; a tool each (`skills.NAME`),
found by `find_tool` and loaded by `call_tool` through a real `loopd serve`, with the prompt's
prefix unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from conftest import StartDaemon
from loopd.config import ToolsConfig
from loopd.session.markdown import front_matter
from loopd.session.records import ToolResultRecord
from loopd.session.store import Store
from loopd.tools import Roots, SkillReader, ToolFailure, ToolRequest
from loopd.tools._skills import Skills
from support.fake_llama import FakeLlama, Reply
from test_bxctl import bxctl

PDF = """---
name: pdf-forms
description: Fill in PDF forms. Use when the user asks to complete a PDF form.
---
# Filling PDF forms

Read reference.md for the fields, then fill them in order.
"""


def skill(folder: Path, text: str, **files: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text(text)
    for name, content in files.items():
        (folder / name).write_text(content)
    return folder


def reader(root: Path, user: Path, *hidden: Path) -> SkillReader:
    return SkillReader(roots=Roots([root], list(hidden)), user=user, keys=Roots([], []))


def test_front_matter_reads_the_simple_form_skills_and_commands_use() -> None:
    fields, body = front_matter(
        "---\nname: x\ndescription: >\n  two\n  lines\nhint: 'quoted'\nnot a pair\n---\n\nBody\n"
    )
    assert fields == {"name": "x", "description": "two lines", "hint": "quoted"}
    assert body == "Body\n"
    assert front_matter("no front matter\n") == ({}, "no front matter\n")
    assert front_matter("---\nunclosed: yes\n") == ({}, "---\nunclosed: yes\n")


def test_skills_are_found_nearest_first_then_the_users(tmp_path: Path) -> None:
    root, user = tmp_path / "work", tmp_path / "config" / "skills"
    project = root / "app"
    skill(project / ".loopd" / "skills" / "pdf", PDF)
    skill(root / ".loopd" / "skills" / "pdf2", PDF)  # the same name, farther: loses
    near = "---\nname: deploy\ndescription: Deploy the app.\n---\nnear\n"
    skill(root / ".loopd" / "skills" / "deploy", near)
    skill(user / "deploy", "---\nname: deploy\ndescription: Mine.\n---\nfar\n")
    skill(user / "notes", "---\nname: notes\ndescription: Keep notes.\n---\n")
    skill(user / "broken", "---\nname: bad name!\ndescription: x\n---\n")
    skill(user / "quiet", "---\nname: quiet\n---\nno description\n")
    found = {s.name: s for s in reader(root, user).find(project)}
    assert sorted(found) == ["deploy", "notes", "pdf-forms"]
    assert found["pdf-forms"].folder == project / ".loopd" / "skills" / "pdf"
    assert found["deploy"].project
    assert not found["notes"].project


def test_a_skill_outside_the_roots_or_hidden_is_never_read(tmp_path: Path) -> None:
    root, user = tmp_path / "work", tmp_path / "nobody"
    root.mkdir()
    outside = skill(tmp_path / "elsewhere" / "leak", PDF)
    (root / ".loopd" / "skills").mkdir(parents=True)
    (root / ".loopd" / "skills" / "leak").symlink_to(outside)  # a link out of the root
    keys = skill(root / "keys" / "secret", PDF.replace("pdf-forms", "secret"))
    (root / ".loopd" / "skills" / "secret").symlink_to(keys)  # a link to a hidden path
    assert reader(root, user, root / "keys").find(root) == []
    assert reader(root, user).find(tmp_path / "elsewhere") == []  # not under a root


async def test_loading_a_skill_gives_its_instructions_and_files(tmp_path: Path) -> None:
    root = tmp_path / "work"
    skill(root / ".loopd" / "skills" / "pdf", PDF, **{"reference.md": "Fields: name, date."})
    (tmp_path / "secret.txt").write_text("hunter2")
    (root / ".loopd" / "skills" / "pdf" / "escape.md").symlink_to(tmp_path / "secret.txt")
    read = reader(root, tmp_path / "none")
    skills = Skills(read, read.find(root), ToolsConfig())
    (entry,) = skills.entries()
    assert entry.name == "skills.pdf-forms"
    assert entry.summary == "Skill: Fill in PDF forms."
    assert entry.policy.untrusted  # a project's file is data

    async def load(**arguments: object) -> str:
        request = ToolRequest("s", 1, entry.name, arguments)
        return (await skills.run_tool(entry, request)).text

    loaded = await load()
    assert loaded.startswith("# Filling PDF forms\n")
    assert "name: pdf-forms" not in loaded  # the front matter is not the instructions
    assert "- reference.md" in loaded
    assert await load(file="reference.md") == "Fields: name, date."
    for bad in ("../../secret.txt", "/etc/passwd", "escape.md"):
        with pytest.raises(ToolFailure):
            await load(file=bad)


def find_tool(query: str, call_id: str) -> Reply:
    return Reply(tool_calls=((call_id, "find_tool", json.dumps({"query": query})),))


def call_tool(tool: str, call_id: str, **arguments: object) -> Reply:
    call = json.dumps({"name": tool, "arguments": arguments})
    return Reply(tool_calls=((call_id, "call_tool", call),))


async def test_a_skill_is_found_and_loaded_and_the_prompts_prefix_stays(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    here = tmp_path / "project"
    skill(here / ".loopd" / "skills" / "pdf", PDF, **{"reference.md": "Fields: name, date."})
    fake = FakeLlama(
        [
            find_tool("fill in a pdf form", "c1"),
            call_tool("skills.pdf-forms", "c2"),
            call_tool("skills.pdf-forms", "c3", file="reference.md"),
            Reply(content="Filled."),
        ]
    )
    d = await daemon(fake, tools=f'roots = ["{here}"]')
    code, out, err = await bxctl(d, "chat", "-m", "fill my form", cwd=here)
    assert (code, out) == (0, "Filled.\n"), err
    session = Store(d.home / "sessions").latest()
    assert session is not None
    _, records, _ = Store(d.home / "sessions").read(session)
    found, loaded, read = [r.content for r in records if isinstance(r, ToolResultRecord)]
    assert "skills.pdf-forms" in found
    assert "Read reference.md for the fields" in loaded
    assert "Fields: name, date." in read
    # Never in the system prompt, and each request extends the one before.
    assert "pdf" not in json.dumps(fake.bodies[0]["messages"][0])
    assert all(b.startswith(a) for a, b in zip(fake.prompts, fake.prompts[1:], strict=False))
    assert fake.bodies[0]["tools"] == fake.bodies[-1]["tools"]


async def test_a_session_elsewhere_has_only_the_users_skills(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """A session outside the roots reads no project's skills; the user's are everyone's."""
    here = tmp_path / "project"
    skill(here / ".loopd" / "skills" / "pdf", PDF)
    config_home = tmp_path / "xdg"
    skill(config_home / "loopd" / "skills" / "notes", "---\nname: notes\ndescription: Keep "
          "notes in a notebook.\n---\nWrite them down.\n")  # fmt: skip
    fake = FakeLlama([find_tool("pdf form notes notebook", "c1"), Reply(content="Seen.")])
    d = await daemon(fake, env={**os.environ, "XDG_CONFIG_HOME": str(config_home)})
    with trio.fail_after(60):
        code, _, err = await bxctl(d, "chat", "-m", "what skills?", cwd=here)
    assert code == 0, err
    session = Store(d.home / "sessions").latest()
    assert session is not None
    _, records, _ = Store(d.home / "sessions").read(session)
    (found,) = [r.content for r in records if isinstance(r, ToolResultRecord)]
    assert "skills.notes" in found
    assert "skills.pdf-forms" not in found
