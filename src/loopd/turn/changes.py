"""Files the model changed, kept so a person can put them back.

Before a file is changed, its content and the new one are kept by their SHA-256 in loopd's
state folder (`Blobs`), and the session log gets a `file_change` record (path, hash before,
hash after) ahead of the change itself: if loopd stops in the middle, the log says what was
meant, and the file's hash says whether it happened. A change a person approved is made only
on the file they were shown: one changed while the approval waited is left as it is.

`undo` puts back what a turn's calls changed (by default the last turn that changed files and
was not undone), newest change first, when each file still holds what those calls wrote;
otherwise it refuses, naming the file that changed since, and touches nothing. An undo is
itself a record (`undo`), and a call is undone once. `undo_after` puts back, the same way,
what every turn after one changed: a rewind to that turn's end with its files.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

from loopd.session.records import FileChangeRecord, Record, UndoRecord, UserRecord
from loopd.session.store import Session
from loopd.tools import (
    Asking,
    Roots,
    ToolFailure,
    ToolOutput,
    commit,
    digest,
    folder_of,
    plan,
    replace_in,
    write_atomically,
)

__all__ = ["Blobs", "Hands", "NothingToUndo", "UndoRefused", "undo", "undo_after"]

WRITE_THREADS = 4
"""Writes and undos at once (each a thread while it reads, copies and fsyncs)."""


class Blobs:
    """Content-addressed copies of files: `<sha256>` in one folder."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def put(self, data: bytes) -> str:
        key = digest(data)
        path = self.directory / key
        if not path.exists():
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomically(path, data, 0o600)
        return key

    def get(self, key: str) -> bytes:
        return (self.directory / key).read_bytes()


class Hands:
    """The turn's side of `write_file` and `edit_file`: each change planned, both contents
    kept, the change recorded, then made."""

    def __init__(self, roots: Roots, blobs: Blobs) -> None:
        self.roots, self.blobs = roots, blobs
        self.threads = trio.CapacityLimiter(WRITE_THREADS)
        """File I/O's own threads: a slow disk under the roots never holds up the store's
        appends, nor they it."""
        self._writing = trio.CapacityLimiter(WRITE_THREADS)
        """The shielded part's own: plans abandoned on a hung disk keep their threads, and a
        change already recorded must never wait behind them, where no cancel reaches."""

    async def write(  # noqa: PLR0913, PLR0917 - one call's whole context, as the port runs it
        self,
        session: Session,
        call: int,
        call_id: str,
        tool: str,
        arguments: dict[str, Any],
        approved: Asking | None = None,
    ) -> ToolOutput:
        """Plan the change and make it; `approved`: the approval the call waited for, whose
        preview the plan must match."""
        roots = self.roots.within(session.cwd)
        planned = await trio.to_thread.run_sync(
            plan, roots, tool, arguments, abandon_on_cancel=True, limiter=self.threads
        )
        if approved is not None and approved.basis is None:
            raise ToolFailure(
                f"{planned.shown}: the approval showed that this call would fail, and it would "
                "not now: what it would write was never shown, so nothing was written. Make "
                "the call again."
            )
        if approved is not None and approved.basis != planned.basis:
            raise ToolFailure(
                f"{planned.shown} changed while the approval waited, so what was approved is not "
                "what would be written; nothing was written. Read it again and plan the change "
                "anew."
            )
        if planned.old == planned.new:
            return ToolOutput(planned.summary())
        # Not cut short by a cancel: the log and the file agree, the record first.
        with trio.CancelScope(shield=True):
            before = None
            if planned.old is not None:
                before = await trio.to_thread.run_sync(
                    self.blobs.put, planned.old, limiter=self._writing
                )
            after = await trio.to_thread.run_sync(
                self.blobs.put, planned.new, limiter=self._writing
            )
            await session.append(
                FileChangeRecord(
                    call=call,
                    tool_call_id=call_id,
                    path=str(planned.path),
                    before=before,
                    after=after,
                )
            )
            await trio.to_thread.run_sync(commit, planned, limiter=self._writing)
        return ToolOutput(planned.summary(), change=planned.change())


class UndoRefused(Exception):
    """A file no longer holds what the calls to undo wrote: nothing was put back."""


class NothingToUndo(UndoRefused):
    pass


def _changes(records: Sequence[Record]) -> list[tuple[int, FileChangeRecord]]:
    """The file changes not undone yet, with the turn each belongs to."""
    undone = {c for r in records if isinstance(r, UndoRecord) for c in r.calls}
    turn, found = 0, []
    for record in records:
        if isinstance(record, UserRecord):
            turn += 1
        elif isinstance(record, FileChangeRecord) and record.call not in undone:
            found.append((turn, record))
    return found


def _chosen(records: Sequence[Record], call: int | None) -> list[FileChangeRecord]:
    changes = _changes(records)
    if call is not None:
        chosen = [c for _, c in changes if c.call == call]
        if not chosen:
            raise NothingToUndo(f"call {call} changed no file, or was undone already")
        return chosen
    if not changes:
        raise NothingToUndo("no turn of this session changed a file that is not undone")
    last = changes[-1][0]
    return [c for turn, c in changes if turn == last]


def _plan(changes: list[FileChangeRecord]) -> dict[str, tuple[str | None, str]]:
    """Per file: the content to put back (its hash, None: remove it) and the hash it must
    hold now."""
    plan: dict[str, tuple[str | None, str]] = {}
    for change in changes:  # oldest first: the first `before` and the last `after` count
        before = plan[change.path][0] if change.path in plan else change.before
        plan[change.path] = (before, change.after)
    return plan


def _put_back(hands: Hands, plan: dict[str, tuple[str | None, str]]) -> None:
    for path, (_, after) in plan.items():
        with _folder(hands.roots, path) as folder:
            now = _content(folder, path)
        if now is None:
            raise UndoRefused(f"{path} was removed since; nothing was put back")
        if digest(now) != after:
            raise UndoRefused(
                f"{path} changed since the call wrote it; nothing was put back (undo the later "
                "changes first, or put it back by hand)"
            )
    for path, (before, _) in plan.items():
        name = Path(path).name
        with _folder(hands.roots, path) as folder:
            try:
                if before is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=folder)
                else:
                    mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode & 0o7777
                    replace_in(folder, name, hands.blobs.get(before), mode)
            except OSError as e:
                raise UndoRefused(f"{path} could not be put back: {e.strerror}") from None


@contextlib.contextmanager
def _folder(roots: Roots, path: str) -> Iterator[int]:
    """The folder of `path`, reached from its root without following a link (as writes are:
    `tools.folder_of`)."""
    root = next((r for r in roots.roots.values() if Path(path).is_relative_to(r)), None)
    if root is None:
        raise UndoRefused(f"{path} is no longer under [tools] roots; nothing was put back")
    try:
        with folder_of(root, Path(path), path) as folder:
            yield folder
    except ToolFailure as e:
        raise UndoRefused(str(e)) from None


def _content(folder: int, path: str) -> bytes | None:
    """The file's bytes (None: it is gone); refused when something else stands there now."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not hang
    try:
        fd = os.open(Path(path).name, flags, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link where the file was
        raise UndoRefused(f"{path} cannot be read ({e.strerror}); nothing was put back") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UndoRefused(f"{path} is no longer a regular file; nothing was put back")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


async def undo(session: Session, hands: Hands, call: int | None = None) -> UndoRecord:
    """Put back what call `call` (None: the last turn that changed files) changed; the record
    written. Raises `UndoRefused` (or `NothingToUndo`) and changes nothing otherwise."""
    return await _undo(session, hands, _chosen(session.records, call))


async def undo_after(session: Session, hands: Hands, turn: int) -> UndoRecord | None:
    """Put back what the turns after turn `turn` changed (and was not undone yet), as each file
    was at that turn's end; the record written, None when they changed no file. Raises
    `UndoRefused` and changes nothing otherwise."""
    changes = [c for at, c in _changes(session.records) if at > turn]
    return await _undo(session, hands, changes) if changes else None


async def _undo(session: Session, hands: Hands, changes: list[FileChangeRecord]) -> UndoRecord:
    plan = _plan(changes)
    await trio.to_thread.run_sync(_put_back, hands, plan, limiter=hands.threads)
    record = UndoRecord(calls=tuple(sorted({c.call for c in changes})), paths=tuple(sorted(plan)))
    await session.append(record)
    return record
