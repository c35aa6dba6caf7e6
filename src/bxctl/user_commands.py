"""The user's own slash commands: a Markdown file `NAME.md` whose text `/NAME args` sends as the
message, `$ARGUMENTS` replaced by what follows the name (`$1` ... `$9` by its words), as
Claude Code's commands are written. Its front matter may say `description` (shown in `/help`
and an editor's command list) and `argument-hint`.

Where they are found: `.loopd/commands/` of the session's folder and of each folder above it
(nearest first), then `commands/` in loopd's config folder. A name found nearer wins, and
loopd's own commands (`/help`, `/compact`, ...) win over all. They are read anew each time a
list is wanted, so an edited file counts at once. bxctl reads them as the user it runs as:
they are the user's own prompts, sent as if typed (the log keeps the text the model read).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from loopd.session.markdown import NAME, folders_up, front_matter, read_head

__all__ = ["FOLDER", "UserCommand", "expand", "find_commands"]

FOLDER = Path(".loopd") / "commands"


@dataclass(frozen=True)
class UserCommand:
    name: str
    description: str
    hint: str
    """What its arguments are (`argument-hint`), for the list; empty where it says none."""
    text: str
    """The message it sends, its front matter left out."""
    path: Path


def find_commands(
    cwd: Path | None, user: Path, reserved: Collection[str] = ()
) -> dict[str, UserCommand]:
    """The commands of a session working in `cwd` (None: the user's alone), by name, nearest
    first; none named as one of `reserved` (loopd's own)."""
    found: dict[str, UserCommand] = {}
    folders = [folder / FOLDER for folder in folders_up(cwd, None)] if cwd else []
    for folder in [*folders, user]:
        for command in _in(folder):
            if command.name not in reserved:
                found.setdefault(command.name, command)
    return found


def expand(command: UserCommand, arguments: str) -> str:
    """The message `/NAME arguments` sends. A command that names no `$ARGUMENTS` (nor `$1`...)
    gets what was given after its text, so nothing typed is dropped."""
    words = arguments.split()
    text = command.text.replace("$ARGUMENTS", arguments)
    for n in range(9, 0, -1):  # $10 is no placeholder: $1 followed by 0
        text = text.replace(f"${n}", words[n - 1] if n <= len(words) else "")
    placed = "$ARGUMENTS" in command.text or any(f"${n}" in command.text for n in range(1, 10))
    if arguments.strip() and not placed:
        text = f"{text.rstrip()}\n\nARGUMENTS: {arguments.strip()}"
    return text


def _in(folder: Path) -> list[UserCommand]:
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix == ".md")
    except OSError:
        return []
    commands = []
    for path in files:
        if not NAME.fullmatch(path.stem) or (head := read_head(path)) is None:
            continue
        text = head.decode("utf-8", "replace")
        fields, body = front_matter(text)
        description = fields.get("description") or _first_line(body)
        commands.append(
            UserCommand(path.stem, description, fields.get("argument-hint", ""), body, path)
        )
    return commands


def _first_line(body: str) -> str:
    line = next((line.strip() for line in body.splitlines() if line.strip()), "")
    return line.lstrip("# ")[:100]
