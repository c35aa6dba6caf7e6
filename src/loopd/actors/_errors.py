"""What the sessions answer when they cannot do what a client asked: one tree, each error one
meaning, so a caller catches `SessionError` and tells the kinds apart by type. Nothing was done
when one is raised. The store's and the tools' own errors are translated here, at the edge of
the actors, and go no further.

`SessionFailed` is not one of them: it is how a session actor ends when its log cannot be
written, caught by the registry that supervises it (that session closes, no other).
"""

from __future__ import annotations

from dataclasses import dataclass

from loopd.session.store import StoreError, fault_of
from loopd.wire.proto import SessionFault

__all__ = [
    "Busy",
    "CannotFork",
    "CannotUndo",
    "DuplicateTurn",
    "FolderNotAllowed",
    "NoSuchSession",
    "SessionError",
    "SessionFailed",
    "SessionUnavailable",
    "TooManySessions",
    "UnknownModel",
]


class SessionError(Exception):
    """A client's request the sessions could not do; the message says why."""


class Busy(SessionError):
    """Too many messages wait already; or an undo while a turn runs."""


class DuplicateTurn(SessionError):
    """A turn by that id runs or waits already."""


class TooManySessions(SessionError):
    """As many sessions as `[session] max_live` are served already."""


class NoSuchSession(SessionError):
    """The store has no session by that id."""


class SessionUnavailable(SessionError):
    """The session's log cannot be used: another process holds it, it does not read, or it
    could not be written."""


class FolderNotAllowed(SessionError):
    """A new session's own folder is not one the file tools may work in."""


class CannotUndo(SessionError):
    """Nothing to undo, or a file changed since the calls wrote it: nothing was put back."""


class UnknownModel(SessionError):
    """A model loopd does not serve was asked for: the session's stays as it was."""


class CannotFork(SessionError):
    """The session cannot be forked there: no such turn, a turn still running there, or a
    sub-agent's session. Nothing was written."""


@dataclass(eq=False)
class SessionFailed(Exception):
    """A session actor stopped because its log could not be written (or, `error`, a bug in
    it); what happened, as its clients are told (`session_failed`)."""

    session: str
    fault: SessionFault
    message: str
    """What happened, first in words (`the disk is full: ...`), then the system's error."""

    @classmethod
    def of(cls, session: str, error: StoreError) -> SessionFailed:
        fault, message = fault_of(error)
        return cls(session, fault, message)

    def __str__(self) -> str:
        return f"session {self.session} failed: {self.message}"
