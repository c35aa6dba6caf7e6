"""Skills, in the Agent Skills format: a folder holding `SKILL.md` (its front matter's `name`
and `description`, then the instructions) and any files beside it (references, templates,
scripts). A skill is a tool of the `skills` source, `skills.NAME`: `find_tool` finds it by its
description like any tool, and `call_tool` loads it: its instructions and the list of its
files; called with `file`, one of those files. So skills are never listed in the system prompt
and cost nothing until the model asks for one: the prompt's prefix, and the cache, are the same
whatever skills there are.

Where they are found: `.loopd/skills/*/SKILL.md` in the session's own folder and each folder
above it up to the root of `[tools] roots` that holds it (never above: what the file tools may
not read, loopd does not read for them either; a link out of the root or to a hidden path is
skipped), nearest first; then the user's own, `skills/*/SKILL.md` in loopd's config folder. A
name found nearer wins. A project's skills are read as the file tools read (their results
marked untrusted, as a file of the project is data); the user's are the user's own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import trio

from loopd.config import Policy, ToolsConfig
from loopd.session.markdown import FILE_BYTES, NAME, front_matter, read_head

from ._registry import policy_for
from ._roots import SNIFF_BYTES, Roots
from ._types import ToolEntry, ToolFailure, ToolOutput, ToolRequest

__all__ = ["SKILLS", "Skill", "SkillReader", "Skills"]

log = logging.getLogger(__name__)

SKILLS = "skills"
"""The source of the skills' tools (`skills.NAME`)."""
FOLDER = Path(".loopd") / "skills"
FILES_LISTED = 100
"""Files beside a `SKILL.md` that loading it names at most."""

_SCHEMA = {
    "type": "object",
    "properties": {
        "file": {
            "type": "string",
            "description": "One of the skill's own files to read (as loading the skill lists "
            "them); leave it out to load the skill's instructions",
        }
    },
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    folder: Path
    project: bool
    """From the project's folders (read as the file tools read), not the user's own."""


@dataclass(frozen=True)
class SkillReader:
    roots: Roots
    """`[tools] roots`, hiding what the tools never reach."""
    user: Path
    """The user's own skills' folder (it may not exist)."""
    keys: Roots
    """No roots; hides the user's keys: no skill is read from among them."""

    def find(self, cwd: Path | None) -> list[Skill]:
        """The skills of a session working in `cwd` (None: its roots), nearest first."""
        found: dict[str, Skill] = {}
        for folder in self.roots.up_from(cwd):
            for skill in self._in(folder / FOLDER, project=True):
                found.setdefault(skill.name, skill)
        for skill in self._in(self.user, project=False):
            found.setdefault(skill.name, skill)
        return list(found.values())

    def _in(self, folder: Path, *, project: bool) -> list[Skill]:
        try:
            children = sorted(folder.iterdir())
        except OSError:
            return []
        skills = []
        for child in children:
            text = self.read(child / "SKILL.md", project=project)
            if text is None:
                continue
            fields, _ = front_matter(text)
            name, description = fields.get("name", child.name), fields.get("description", "")
            if not NAME.fullmatch(name) or not description:
                log.warning("%s/SKILL.md names no valid name and description: skipped", child)
                continue
            skills.append(Skill(name, description, child, project))
        return skills

    def read(self, path: Path, *, project: bool) -> str | None:
        """A skill's file as text, read as the file tools read a project's (a user's own: not
        one of the user's keys); None where it is not one to read."""
        try:
            resolved = path.resolve()
            if project:
                inside = any(resolved.is_relative_to(r) for r in self.roots.roots.values())
                if not inside or self.roots.hides(resolved):
                    return None
                with self.roots.open(resolved, str(path)) as f:
                    data = f.read(FILE_BYTES)
            else:
                if self.keys.hides(resolved) or (head := read_head(resolved)) is None:
                    return None
                data = head
        except (OSError, ToolFailure):
            return None
        if b"\0" in data[:SNIFF_BYTES]:
            return None
        return data.decode("utf-8", "replace")


class Skills:
    """The skills of one session: their registry entries, and what runs a call to one."""

    def __init__(self, reader: SkillReader, skills: list[Skill], config: ToolsConfig) -> None:
        self.reader, self.config = reader, config
        self.by_tool = {f"{SKILLS}.{s.name}": s for s in skills}

    def entries(self) -> list[ToolEntry]:
        entries = []
        for tool, skill in self.by_tool.items():
            policy = policy_for(self.config, tool, SKILLS)
            if skill.project:  # the project's files are data, as read_file's results
                policy = Policy.model_validate({**policy.model_dump(), "untrusted": True})
            summary = skill.description.split(". ", 1)[0].rstrip(".") + "."
            entries.append(
                ToolEntry(tool, f"Skill: {summary}", skill.description, _SCHEMA, SKILLS, policy)
            )
        return entries

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        skill = self.by_tool.get(entry.name)
        if skill is None:
            raise ToolFailure(f"{entry.name}: no such skill in this session")
        file = request.arguments.get("file")
        text = await trio.to_thread.run_sync(self._load, skill, file, abandon_on_cancel=True)
        return ToolOutput(text)

    def _load(self, skill: Skill, file: Any) -> str:
        if file is None:
            text = self.reader.read(skill.folder / "SKILL.md", project=skill.project)
            if text is None:
                raise ToolFailure(f"the skill {skill.name}'s SKILL.md can no longer be read")
            _, body = front_matter(text)
            files = _files(skill.folder)
            listed = "\n".join(f"- {f}" for f in files) or "(none)"
            return (
                f"{body.rstrip()}\n\n[Files of the skill {skill.name}, read with file: ...]\n"
                f"{listed}"
            )
        if not isinstance(file, str) or not file:
            raise ToolFailure("file: give one of the skill's files, as loading it lists them")
        parts = PurePosixPath(file).parts
        if PurePosixPath(file).is_absolute() or ".." in parts:
            raise ToolFailure(f"{file}: only the skill's own files can be read")
        target = skill.folder.joinpath(*parts)
        if not target.resolve().is_relative_to(skill.folder.resolve()):
            raise ToolFailure(f"{file}: only the skill's own files can be read")
        text = self.reader.read(target, project=skill.project)
        if text is None:
            raise ToolFailure(f"{file}: not a text file of the skill {skill.name}")
        return text


def _files(folder: Path) -> list[str]:
    """The files beside a `SKILL.md`, as paths relative to its folder (hidden ones left out)."""
    found: list[str] = []
    for directory, dirs, files in os.walk(folder):  # does not follow symlinked folders
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            relative = (Path(directory) / name).relative_to(folder).as_posix()
            if relative != "SKILL.md" and not name.startswith("."):
                found.append(relative)
            if len(found) == FILES_LISTED:
                return [*found, f"[... more than {FILES_LISTED}]"]
    return found
