"""A person's standing instructions: the `AGENTS.md` files a session's baseline carries.

When a session is made, loopd reads the `AGENTS.md` of each folder from the session's own
folder (its `cwd`, else the single root of `[tools] roots`) up to the root that holds it, and
the user's own `AGENTS.md` in loopd's config folder, and writes them into the system prompt,
each delimited and named by its path (`block`). The header records each file's path and
SHA-256 and where the block lies in the system prompt (`Instructions`), so a session continued
from a summary and a sub-agent carry the same text (`carried`), whatever the files hold by
then: a change to a file applies to new sessions only, and every request of a session still
extends the one before it.

Pure: reading the files is the actors' (`loopd.actors`), which know what the tools may read.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopd.session.records import Baseline, InstructionFile, Instructions

__all__ = [
    "FILE_NAME",
    "INSTRUCTIONS_HEADING",
    "InstructionFile",
    "Instructions",
    "Read",
    "block",
    "carried",
    "with_instructions",
]

FILE_NAME = "AGENTS.md"

INSTRUCTIONS_HEADING = (
    "# Instructions from AGENTS.md files\n"
    "The person's standing instructions, from the AGENTS.md files below: their own first, "
    "then the project's from its top folder down to the folder this session works in. Follow "
    "them; where two disagree, the later (nearer) one wins."
)


@dataclass(frozen=True)
class Read:
    """Files as read for a new session: each with the text the prompt keeps of it."""

    files: tuple[tuple[InstructionFile, str], ...]
    limit: int
    """`[session] instructions_bytes`, named where a file is cut."""


def _cut_note(file: InstructionFile, limit: int) -> str:
    left = file.size - file.kept
    if file.kept == 0:
        return (
            f"[left out: all {file.size} bytes of this file; the AGENTS.md files may take "
            f"{limit} bytes in all ([session] instructions_bytes)]"
        )
    return (
        f"[cut here: the last {left} of this file's {file.size} bytes are left out; the "
        f"AGENTS.md files may take {limit} bytes in all ([session] instructions_bytes)]"
    )


def block(read: Read) -> str:
    """The text the system prompt carries for these files ("" for none)."""
    if not read.files:
        return ""
    parts = [INSTRUCTIONS_HEADING]
    for file, text in read.files:
        body = text
        if file.kept < file.size:
            note = _cut_note(file, read.limit)
            body = f"{text}\n{note}" if text else note
        parts.append(f'<agents-md path="{file.path}">\n{body.rstrip()}\n</agents-md>')
    return "\n\n".join(parts)


def with_instructions(baseline: Baseline, read: Read) -> tuple[Baseline, Instructions | None]:
    """`baseline` with the block of the files `read` after its system prompt, and what the
    header records of them; `baseline` itself and None when there are none."""
    return _placed(baseline, tuple(file for file, _ in read.files), block(read))


def carried(
    baseline: Baseline, instructions: Instructions | None, into: Baseline
) -> tuple[Baseline, Instructions | None]:
    """`into` with the instructions of a session whose baseline is `baseline`: for a session
    that continues it, or one of its sub-agents. The same text, never read again."""
    if instructions is None:
        return into, None
    return _placed(into, instructions.files, instructions.text(baseline))


def _placed(
    baseline: Baseline, files: tuple[InstructionFile, ...], text: str
) -> tuple[Baseline, Instructions | None]:
    if not text:
        return baseline, None
    start = len(baseline.system) + 2
    system = f"{baseline.system}\n\n{text}"
    instructions = Instructions(files=files, start=start, end=len(system))
    return Baseline(system=system, tools=baseline.tools), instructions
