"""The session store: one append-only JSONL log per session, and nothing said is ever lost.

Each append is one `write` of one line, then `fsync`, in a worker thread that a cancelled
caller waits for, so a record is either whole on disk or not there at all. (A turn's question
is written at once, so that a killed loopd leaves it in the log, and fsynced by `sync` while
its request goes; nothing of the answer is passed on before.) A crash in the middle of a
write leaves a torn last line: opening cuts it off and says so; every record before it is
kept. Anything else that does not parse is an error naming the file and line, never skipped:
a listing names such a log apart, with why (`Listing.unreadable`). One process writes a
session at a time (an exclusive `flock` on the log).

    StoreError
     ├── SessionLocked      another process has the session open for writing
     ├── UnknownSession     no log with that id
     └── CorruptLog         a line that is not a record, or a log that is not a session
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import trio
from pydantic import TypeAdapter, ValidationError

from loopd import __version__
from loopd.session.fold import SessionState
from loopd.session.records import (
    FORMAT,
    RECORD,
    Baseline,
    Instructions,
    Mode,
    Record,
    SessionHeader,
    UsageRecord,
    UserRecord,
    dump,
    now,
    stricter,
)
from loopd.session.trail import PromptTrail

__all__ = [
    "CorruptLog",
    "Fork",
    "Listing",
    "ParentCall",
    "Session",
    "SessionInfo",
    "SessionLocked",
    "Store",
    "StoreError",
    "UnknownSession",
    "Unreadable",
    "WriteFault",
    "fault_of",
    "new_session_id",
    "parse_log",
]

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
# Counted in a log's raw bytes to list sessions without parsing them: inside a string value
# the quotes would be escaped, so this occurs only as a record's own kind.
_USER_KIND = b'"kind":"user"'
_TURN_END_KIND = b'"kind":"turn_end"'
_LOG: TypeAdapter[list[Record]] = TypeAdapter(list[Record])
TITLE_LENGTH = 80
"""The longest title a listing gives a session (`SessionInfo.title`)."""
READ_SLICE = 1000
"""Lines validated at a time where a log is read for trio (`Store.open`, `Store.load`): each
slice is a hop of its own to a worker thread. Validation holds the GIL, so a log validated in
one call stopped trio's thread for the whole of it (1.7 s for 100,000 records, every session's
stream with it); a slice takes about 3 ms on two cores, and trio runs between slices."""


class StoreError(Exception):
    """A session log could not be created, opened or written."""


class SessionLocked(StoreError):
    """Another process has this session open for writing."""


class UnknownSession(StoreError):
    """There is no session with this id in the store."""


class CorruptLog(StoreError):
    """A log holds something that is not a record where a record must be."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


WriteFault = Literal["disk_full", "read_only", "io_error", "other"]
"""Why a log could not be written, as clients are told (`session_failed`)."""

_FAULTS: dict[int, tuple[WriteFault, str]] = {
    errno.ENOSPC: ("disk_full", "the disk is full"),
    errno.EDQUOT: ("disk_full", "the disk quota is used up"),
    errno.EROFS: ("read_only", "the session's log folder is read-only"),
    errno.EACCES: ("read_only", "loopd may no longer write the session's log"),
    errno.EPERM: ("read_only", "loopd may no longer write the session's log"),
    errno.EIO: ("io_error", "an I/O error on the session's log"),
}


def fault_of(error: StoreError) -> tuple[WriteFault, str]:
    """What a failed write means, from the system's error under it, and a message that
    says it first and the details after."""
    cause = error.__cause__
    code = cause.errno if isinstance(cause, OSError) else None
    fault, what = _FAULTS.get(code or 0, ("other", "the session's log could not be written"))
    return fault, f"{what}: {error}"


class _Millis:
    """The last millisecond an id was made in: two sessions made in one millisecond still sort
    in the order they were made (the second's moves on by one)."""

    last = 0

    @classmethod
    def after_last(cls, t: datetime) -> datetime:
        ms = max(int(t.timestamp() * 1000), cls.last + 1)
        cls.last = ms
        return datetime.fromtimestamp(ms // 1000, UTC).replace(microsecond=ms % 1000 * 1000)


def new_session_id(at: datetime | None = None) -> str:
    """Ids sort by creation time: `20261130T120102345Z-9f2c1a` (UTC, milliseconds)."""
    t = at.astimezone(UTC) if at else _Millis.after_last(now())
    return f"{t:%Y%m%dT%H%M%S}{t.microsecond // 1000:03d}Z-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class SessionInfo:
    id: str
    created: datetime
    turns: int
    last_activity: datetime
    path: Path
    continues: str | None = None
    """The session this one continues, if any."""
    parent: str | None = None
    """The session that delegated to this one, for a sub-agent."""
    open_turn: bool = False
    """Its last turn has not ended: it runs now, or loopd stopped in it without closing it."""
    cwd: str | None = None
    """The one folder its file tools work in (its header's); None: all of `[tools] roots`."""
    title: str | None = None
    """Its first user message's first line, cut to `TITLE_LENGTH` characters; None before
    the first."""
    forked_from: str | None = None
    """The session it is a fork of, if any (its header's)."""
    at: int | None = None
    """For a fork: the turn of `forked_from` whose end it starts from."""


@dataclass(frozen=True)
class Unreadable:
    """A log in the store that does not read as a session, and why: listed apart."""

    id: str
    path: Path
    reason: str
    """Where and what, in a line: `line 1: not a record: Invalid JSON: ...`."""


@dataclass(frozen=True)
class Listing:
    sessions: list[SessionInfo]
    """Every session that reads, oldest first."""
    unreadable: list[Unreadable]
    """The logs that do not: a person should hear which, and why."""


@dataclass(frozen=True)
class Fork:
    """What a fork starts from: session `session`'s `records` up to the end of its turn `at`."""

    session: str
    at: int
    records: Sequence[Record]


@dataclass(frozen=True)
class ParentCall:
    """The `delegate` call that starts a sub-agent's session."""

    session: str
    call: int
    call_id: str


class Session:
    """An open session log. Only one process at a time holds one; close it when done."""

    def __init__(
        self,
        path: Path,
        fd: int,
        header: SessionHeader,
        records: list[Record],
        follows: Session | None = None,
    ) -> None:
        self.path = path
        self.header = header
        self._fd: int | None = fd
        self._records = records
        self._size = os.fstat(fd).st_size
        """Where the log's durable records end."""
        self._unsynced: list[bytes] = []
        """Lines of records `add`ed, not yet durable: in the file after `_size`, or, where a
        write failed, nowhere yet (`_end == _size`)."""
        self._end = self._size
        self._write_lock = trio.Lock()
        self._thread = trio.CapacityLimiter(1)
        """The session's appends run in a thread of their own, never on trio's shared ones: a
        tool's work or a command's wait there never delays a record."""
        self._state = SessionState(header, records)
        self._given = 0
        """The last call number `next_call` gave out."""
        self._follows = follows
        """A running sub-agent's: the session that delegated to it, whose mode holds for it
        too while it runs (`mode`)."""

    @property
    def state(self) -> SessionState:
        """What its records make of it, kept as they are added (read it; only the session
        applies records to it)."""
        return self._state

    @property
    def trail(self) -> PromptTrail:
        """The token-exact prompt up to the last answer, kept as records are added."""
        return self._state.trail

    @property
    def follows(self) -> Session | None:
        """A running sub-agent's: the session that delegated to it (`Store.create`)."""
        return self._follows

    @property
    def model(self) -> str | None:
        """The `[models.NAME]` its turns run on, as its log says; None: the default."""
        return self._state.model

    @property
    def mode(self) -> Mode:
        """What its tools may do without asking: its last `mode` record's, else its header's;
        for a running sub-agent, the stricter of that and its parent's."""
        if self._follows is not None:
            return stricter(self._state.mode, self._follows.mode)
        return self._state.mode

    @property
    def own_mode(self) -> Mode:
        """Its mode as its log says, whoever it follows."""
        return self._state.mode

    @property
    def thinking(self) -> bool | None:
        """Whether its turns think; None: `[loop] thinking`."""
        return self._state.thinking

    @property
    def id(self) -> str:
        return self.header.id

    @property
    def cwd(self) -> Path | None:
        """The one folder its file tools work in; None: all of `[tools] roots`."""
        return Path(self.header.cwd) if self.header.cwd else None

    @property
    def baseline(self) -> Baseline:
        return self.header.baseline

    @property
    def records(self) -> Sequence[Record]:
        """Every record after the header, in order."""
        return self._records

    @property
    def turns(self) -> int:
        return self._state.turns

    @property
    def granted(self) -> frozenset[str]:
        """Tools a person approved for the rest of the session (or of the one it continues)."""
        return frozenset(self._state.granted)

    def next_call(self) -> int:
        """A number for the next tool call, unique across the session."""
        self._given = max(self._given, self._state.last_call) + 1
        return self._given

    def last_usage(self) -> UsageRecord | None:
        """The last request's, on the model the session runs on now: what a slot of that
        model holds of it (none, right after a change of model)."""
        return self._state.last_usage

    async def append(self, record: Record) -> None:
        """Write one record and fsync it; when this returns, the record is on disk (and every
        record `add`ed before it)."""
        line = self._line(record)
        async with self._write_lock:
            await self._write(line)
            self._keep(record)

    async def add(self, record: Record) -> None:
        """Write `record` without waiting for the disk, made durable by the next `sync` or
        `append`: a turn's question, in the log if loopd is killed (the kernel holds it), on
        the disk while its request goes. (After an append under way, so that the log and
        `records` keep one order.)"""
        line = self._line(record)
        if self._write_lock.locked():
            async with self._write_lock:
                self._add(line, record)
        else:  # nothing is being written: at once, without a scheduling round
            self._add(line, record)

    def _add(self, line: bytes, record: Record) -> None:
        # Here, not in the session's thread: a question's line goes into the page cache in
        # microseconds (the longest line a client may send, a few milliseconds), where the
        # hop to the thread and back cost half a millisecond before every request.
        self._write_now(line, durable=False)
        self._keep(record)
        self._unsynced.append(line)

    async def sync(self) -> None:
        """Every record added is on disk; at once where there is none."""
        if self._unsynced:
            async with self._write_lock:
                if self._unsynced:  # else an append under way made them durable
                    await self._write(b"")

    async def _write(self, line: bytes) -> None:
        """`line` written and fsynced with all before it, in the session's own thread. Not
        abandoned on cancel: a cancelled caller waits for the write to finish, so the log and
        `records` never disagree."""
        durably = partial(self._write_now, durable=True)
        await trio.to_thread.run_sync(durably, line, limiter=self._thread)
        self._unsynced = []

    def _line(self, record: Record) -> bytes:
        if isinstance(record, SessionHeader):
            raise StoreError("a session has one header, written when it is created")
        return dump(record)

    def _keep(self, record: Record) -> None:
        self._records.append(record)
        self._state.apply(record)

    def _write_now(self, line: bytes, *, durable: bool) -> None:
        """`line` at the log's end, behind what was added where a failed write cut it off."""
        if self._fd is None:
            raise StoreError(f"{self.path}: the session is closed")
        lines = (b"".join(self._unsynced) if self._end == self._size else b"") + line
        try:
            written = os.write(self._fd, lines)
            while written < len(lines):  # a regular file takes it whole, but be sure
                written += os.write(self._fd, lines[written:])
            if durable:
                os.fsync(self._fd)
        except OSError as e:
            # Never leave half a line behind a later record, nor a line a failed fsync may
            # have lost: cut back to the last durable one; what was added is written again.
            os.ftruncate(self._fd, self._size)
            self._end = self._size
            raise StoreError(f"{self.path}: cannot append a record: {e}") from e
        self._end += len(lines)
        if durable:
            self._size = self._end

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock too
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Store:
    """A directory of session logs, `<id>.jsonl` each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._held: tuple[int, int] | None = None
        """The device and inode of the `.lock` this process holds, while it holds it."""

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Be the one process that writes this store, for the block (a lock on `.lock`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock(fd, self.directory)
            info = os.fstat(fd)
            self._held = (info.st_dev, info.st_ino)
            yield
        finally:
            self._held = None
            os.close(fd)

    def gone(self) -> str | None:
        """Why the store held by `hold` can no longer be used, if it cannot: its folder was
        removed or replaced. Logs still open would be written to files nobody can find, and
        new ones where no lock keeps a second loopd out."""
        if self._held is None:
            return None
        try:
            info = (self.directory / ".lock").stat()
        except (FileNotFoundError, NotADirectoryError):
            return f"its store folder {self.directory} was removed"
        if (info.st_dev, info.st_ino) != self._held:
            return f"its store folder {self.directory} was replaced"
        return None

    def path_of(self, session_id: str) -> Path:
        if not session_id or "/" in session_id or session_id.startswith("."):
            raise UnknownSession(f"{session_id!r} is not a session id")
        return self.directory / f"{session_id}{SUFFIX}"

    async def create(  # noqa: PLR0913 - what a header says of a new session
        self,
        baseline: Baseline,
        continues: str | None = None,
        grants: frozenset[str] = frozenset(),
        parent: ParentCall | None = None,
        cwd: Path | None = None,
        *,
        instructions: Instructions | None = None,
        mode: Mode = "ask",
        thinking: bool | None = None,
        fork: Fork | None = None,
        follows: Session | None = None,
    ) -> Session:
        """A new session; `continues`: the session it goes on from (named in its header), with
        the tools approved for the rest of that session (`grants`); `parent`: for a
        sub-agent, the call that starts it; `cwd`: the one folder its file tools work in;
        `instructions`: the `AGENTS.md` files `baseline`'s system prompt carries; `mode` and
        `thinking`: what it starts with (those of the session it continues or of its parent);
        `fork`: the session and turn it is a fork of, with the history it starts with;
        `follows`: for a sub-agent while it runs, its parent's open session, whose mode holds
        for it too (`Session.mode`)."""
        return await trio.to_thread.run_sync(
            partial(
                self._create,
                instructions=instructions,
                mode=mode,
                thinking=thinking,
                fork=fork,
                follows=follows,
            ),
            baseline,
            continues,
            grants,
            parent,
            cwd,
        )

    async def open(self, session_id: str) -> Session:
        """Take session `session_id` for writing (its lock) and read it, off trio's thread and
        in slices (`READ_SLICE`): every other session goes on while a long log opens."""
        path = self.path_of(session_id)
        fd, data = await trio.to_thread.run_sync(self._take, path, session_id)
        try:
            header, records, torn = await _parse_in_slices(path, data, session_id)
            return await trio.to_thread.run_sync(_opened, path, fd, header, records, torn)
        except BaseException:
            os.close(fd)
            raise

    async def load(self, session_id: str) -> tuple[SessionHeader, list[Record], int]:
        """`read`, off trio's thread and in slices (`READ_SLICE`), as `open` reads."""
        path = self.path_of(session_id)
        data = await trio.to_thread.run_sync(self._bytes, path, session_id)
        return await _parse_in_slices(path, data, session_id)

    async def header(self, session_id: str) -> SessionHeader:
        """The header of session `session_id` alone, read in a worker thread."""
        path = self.path_of(session_id)
        return await trio.to_thread.run_sync(_read_header, path, session_id)

    async def sessions(self) -> list[SessionInfo]:
        """Every session, oldest first (those whose log does not read left out)."""
        return (await self.listing()).sessions

    def sessions_now(self) -> list[SessionInfo]:
        """`sessions`, read in this thread: for a command-line tool with no event loop."""
        return self._listing().sessions

    async def listing(self) -> Listing:
        """Every session, oldest first, and the logs that do not read, each with why."""
        return await trio.to_thread.run_sync(self._listing)

    def listing_now(self) -> Listing:
        """`listing`, read in this thread."""
        return self._listing()

    async def discard_if_empty(self, session_id: str) -> bool:
        """Remove session `session_id` if it holds nothing: its log is its header alone, it is
        a session of its own (no fork, no continuation, no sub-agent's) and no other session
        names it (as the one it continues, forks or works for). True if it was removed,
        durably (its folder fsynced). A log with any record, one that does not read, or one
        another process holds is never removed."""
        return await trio.to_thread.run_sync(self._discard_if_empty, session_id)

    def read(self, session_id: str) -> tuple[SessionHeader, list[Record], int]:
        """Read a log without taking it: for looking, while a daemon may be writing it. Gives
        the header, the records and the length of a torn last line (left as it is)."""
        path = self.path_of(session_id)
        return parse_log(path, self._bytes(path, session_id), session_id)

    def _bytes(self, path: Path, session_id: str) -> bytes:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise UnknownSession(f"no session {session_id} in {self.directory}") from None

    def latest(self) -> str | None:
        """The newest session that is not a sub-agent's, read in this thread: for a
        command-line tool with no event loop (the daemon awaits `find_latest`)."""
        for session_id in reversed(self._ids()):
            try:
                with self.path_of(session_id).open("rb") as f:
                    header = RECORD.validate_json(f.readline())
            except (OSError, ValidationError):
                continue
            if isinstance(header, SessionHeader) and header.parent is None:
                return session_id
        return None

    async def find_latest(self) -> str | None:
        """`latest`, read in a worker thread: one line of each log, newest first."""
        return await trio.to_thread.run_sync(self.latest)

    def _ids(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(
            p.name.removesuffix(SUFFIX)
            for p in self.directory.iterdir()
            if p.name.endswith(SUFFIX) and not p.name.startswith(".")
        )

    def _create(  # noqa: PLR0913 - as `create`
        self,
        baseline: Baseline,
        continues: str | None,
        grants: frozenset[str],
        parent: ParentCall | None,
        cwd: Path | None,
        *,
        instructions: Instructions | None = None,
        mode: Mode = "ask",
        thinking: bool | None = None,
        fork: Fork | None = None,
        follows: Session | None = None,
    ) -> Session:
        created = _Millis.after_last(now())  # ids sort in the order sessions are made
        header = SessionHeader(
            id=new_session_id(created),
            created=created,
            baseline=baseline,
            loopd_version=__version__,
            time=created,
            continues=continues,
            grants=tuple(sorted(grants)),
            parent=parent.session if parent else None,
            call=parent.call if parent else None,
            call_id=parent.call_id if parent else None,
            cwd=str(cwd) if cwd else None,
            instructions=instructions,
            mode=mode,
            thinking=thinking,
            forked_from=fork.session if fork else None,
            at=fork.at if fork else None,
        )
        records = list(fork.records) if fork else []
        path = self.path_of(header.id)
        staging = self.directory / f".{header.id}{SUFFIX}.partial"
        # Written and locked under a hidden name, then renamed: a log is never seen without
        # its header, and nobody can take it between the rename and our lock.
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(
                staging, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
        except OSError as e:
            raise StoreError(f"{self.directory}: cannot create a session: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            data = dump(header) + b"".join(dump(r) for r in records)
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
            staging.rename(path)
            _fsync_directory(self.directory)
        except BaseException as e:
            os.close(fd)
            staging.unlink(missing_ok=True)
            if isinstance(e, OSError):  # a full disk, a read-only folder: said as the store's
                raise StoreError(f"{self.directory}: cannot create a session: {e}") from e
            raise
        return Session(path, fd, header, records, follows)

    def _take(self, path: Path, session_id: str) -> tuple[int, bytes]:
        """The log of `session_id` opened for writing and locked, and what it holds."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UnknownSession(f"no session {session_id} in {self.directory}") from None
        try:
            _lock(fd, path)
            return fd, os.pread(fd, os.fstat(fd).st_size, 0)
        except BaseException:
            os.close(fd)
            raise

    def _discard_if_empty(self, session_id: str) -> bool:
        path = self.path_of(session_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            _lock(fd, path)  # held to the unlink: no process takes it meanwhile
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            header, records, torn = parse_log(path, data, session_id)
            own = not (header.continues or header.parent or header.forked_from)
            if records or torn or not own or self._named(session_id):
                return False
            path.unlink()
            _fsync_directory(self.directory)
        except (SessionLocked, CorruptLog):
            return False
        except OSError as e:
            raise StoreError(f"{path}: cannot remove the empty session: {e}") from e
        finally:
            os.close(fd)
        return True

    def _named(self, session_id: str) -> bool:
        """Whether another session's header names `session_id` (it continues, forks or works
        for it). A log whose header does not read is passed over: it would stop every removal
        for good, and what names a session is made from its records, which an empty one has
        none of (a fork starts at a turn, a compaction from a conversation, a sub-agent in a
        turn), so this only makes sure."""
        for other in self._ids():
            try:
                with self.path_of(other).open("rb") as f:
                    header = RECORD.validate_json(f.readline())
            except (OSError, ValidationError):
                continue
            if isinstance(header, SessionHeader) and session_id in (
                header.continues,
                header.parent,
                header.forked_from,
            ):
                return True
        return False

    def _listing(self) -> Listing:
        infos, unreadable = [], []
        for session_id in self._ids():
            path = self.path_of(session_id)
            try:
                infos.append(_info(session_id, path, path.read_bytes()))
                continue
            except FileNotFoundError:
                continue  # removed since the folder was read: it held nothing
            except CorruptLog as e:
                why = f"line {e.line}: {e.reason}"
            except OSError as e:
                why = e.strerror or str(e)
            unreadable.append(Unreadable(session_id, path, why))
        return Listing(infos, unreadable)


def _info(session_id: str, path: Path, data: bytes) -> SessionInfo:
    """What the list says of a log, read from its header and its last whole line alone (a
    torn last line is cut off when the log opens)."""
    whole = data[: data.rfind(b"\n") + 1]
    if not whole:
        raise CorruptLog(path, 1, "the log is empty: it has no session header")
    first, _, _ = whole.partition(b"\n")
    header = _header(path, _record(path, 1, first), session_id)
    lines = whole.count(b"\n")
    last = whole.rstrip(b"\n").rpartition(b"\n")[2]
    return SessionInfo(
        session_id,
        header.created,
        whole.count(_USER_KIND),
        _record(path, lines, last).time if lines > 1 else header.time,
        path,
        header.continues,
        header.parent,
        whole.rfind(_USER_KIND) > whole.rfind(_TURN_END_KIND),
        header.cwd,
        _title(path, whole),
        header.forked_from,
        header.at,
    )


def _title(path: Path, whole: bytes) -> str | None:
    """The first user message's first line, cut to `TITLE_LENGTH`; read from that line alone."""
    at = whole.find(_USER_KIND)
    if at < 0:
        return None
    start = whole.rfind(b"\n", 0, at) + 1
    line = whole[start : whole.find(b"\n", at)]
    try:
        record = _record(path, whole.count(b"\n", 0, start) + 1, line)
    except CorruptLog:  # opening the log says so; a listing gives it no title
        return None
    if not isinstance(record, UserRecord):
        return None
    first = next((s.strip() for s in record.content.splitlines() if s.strip()), "")
    if len(first) > TITLE_LENGTH:
        first = first[: TITLE_LENGTH - 1].rstrip() + "…"
    return first or None


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SessionLocked(
            f"{path} is open for writing by another process (is another loopd running on "
            "this store?)"
        ) from None


def _opened(
    path: Path, fd: int, header: SessionHeader, records: list[Record], torn: int
) -> Session:
    """The session of a log just read, its torn last line cut off."""
    if torn:
        log.warning(
            "%s: cut off a torn last line of %d bytes (a write was interrupted); "
            "%d whole records kept", path, torn, len(records) + 1,
        )  # fmt: skip
        os.ftruncate(fd, os.fstat(fd).st_size - torn)
        os.fsync(fd)
    return Session(path, fd, header, records)


def _read_header(path: Path, session_id: str) -> SessionHeader:
    try:
        with path.open("rb") as f:
            first = f.readline()
    except FileNotFoundError:
        raise UnknownSession(f"no session {session_id} in {path.parent}") from None
    if not first.endswith(b"\n"):
        raise CorruptLog(path, 1, "the log is empty: it has no session header")
    return _header(path, _record(path, 1, first), session_id)


def parse_log(path: Path, data: bytes, session_id: str) -> tuple[SessionHeader, list[Record], int]:
    """The header, the records, and the length of a torn last line (0: none)."""
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline, as a whole log does
    return (*_log(path, _parse_lines(path, lines), session_id), len(torn))


async def _parse_in_slices(
    path: Path, data: bytes, session_id: str
) -> tuple[SessionHeader, list[Record], int]:
    """`parse_log`, `READ_SLICE` lines per hop to a worker thread, so that trio's thread runs
    between them."""
    records: list[Record] = []
    start = 0
    while start < len(data):
        parsed, end = await trio.to_thread.run_sync(_parse_slice, path, data, start, len(records))
        if end == start:
            break  # what is left has no newline: a torn last line
        records += parsed
        start = end
    header, rest = _log(path, records, session_id)
    return header, rest, len(data) - start


def _parse_slice(path: Path, data: bytes, start: int, before: int) -> tuple[list[Record], int]:
    """The records of the next `READ_SLICE` whole lines of `data` from `start` (`before`
    records precede them), and where the next line starts."""
    lines: list[bytes] = []
    while len(lines) < READ_SLICE and (end := data.find(b"\n", start)) >= 0:
        lines.append(data[start:end])
        start = end + 1
    return _parse_lines(path, lines, first=before + 1) if lines else [], start


def _log(path: Path, records: list[Record], session_id: str) -> tuple[SessionHeader, list[Record]]:
    """The header and the records after it (`records` loses its first), if they make a log
    (`_parse_lines` found no second header)."""
    if not records:
        raise CorruptLog(path, 1, "the log is empty: it has no session header")
    return _header(path, records.pop(0), session_id), records


def _header(path: Path, first: Record, session_id: str) -> SessionHeader:
    """The first record, if it is the header of this session in a format this loopd reads."""
    if not isinstance(first, SessionHeader):
        raise CorruptLog(path, 1, f"the first record is {first.kind!r}, not the session header")
    if first.id != session_id:
        raise CorruptLog(path, 1, f"the header names another session, {first.id}")
    if first.format > FORMAT:
        raise CorruptLog(path, 1, f"log format {first.format} is newer than this loopd "
                                  f"({__version__}) reads ({FORMAT}): upgrade loopd")  # fmt: skip
    return first


def _record(path: Path, number: int, line: bytes) -> Record:
    try:
        return RECORD.validate_json(line)
    except ValidationError as e:
        reason = e.errors()[0]["msg"] if e.errors() else str(e)
        raise CorruptLog(path, number, f"not a record: {reason}") from None


def _parse_lines(path: Path, lines: list[bytes], first: int = 1) -> list[Record]:
    """The records of `lines`, the first of them line `first` of the log; a header is a
    record of line 1 alone."""
    # One validation call for the whole log is much faster than one per line; the count check
    # catches a line that holds two objects. On any failure, line by line finds the culprit.
    try:
        records = _LOG.validate_json(b"[" + b",".join(lines) + b"]")
        if len(records) == len(lines):
            for number, record in enumerate(records, start=first):
                if number > 1 and isinstance(record, SessionHeader):
                    raise CorruptLog(path, number, "a second session header")
            return records
    except ValidationError:
        pass
    for number, line in enumerate(lines, start=first):
        _record(path, number, line)
    raise CorruptLog(path, first, "the log does not parse, though each line does")  # unreachable


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
