"""The actors of a running loopd (`open_core` wires them: `loopd.actors._core`).

    tool port     owns tool calls in flight and pending approvals; supervises MCP servers
    slot pool     owns the server's slots; lends one to a session for a turn
    sessions      a session actor per live conversation: its log, its turns, their events;
                  the registry opens and stops them, each with the MCP servers its client
                  gave it; a turn's `delegate` calls run sub-agents in the calls' tasks

Each actor has one inbox: a memory channel of typed messages, with a reply channel where an
answer is needed, reached through its handle. This face only names what the modules hold.
"""

from ._agents import AGENTS, Agents
from ._core import Core, open_core, slot_files
from ._errors import (
    Busy,
    CannotFork,
    CannotUndo,
    DuplicateTurn,
    FolderNotAllowed,
    NoSuchSession,
    SessionError,
    SessionFailed,
    SessionUnavailable,
    TooManySessions,
    UnknownModel,
)
from ._models import Models
from ._pool import SAVE_AT_STOP, Lease, PoolHandle, SlotView, pool_actor
from ._registry import SessionRegistry
from ._session import SessionActor, SessionHooks
from ._session_inbox import (
    HistoryPage,
    ModeChanged,
    Published,
    SessionHandle,
    SessionStatus,
    Subscription,
    SubscriptionItem,
    TurnDone,
    TurnFailed,
)
from ._slots import SlotFiles

__all__ = [
    "AGENTS",
    "SAVE_AT_STOP",
    "Agents",
    "Busy",
    "CannotFork",
    "CannotUndo",
    "Core",
    "DuplicateTurn",
    "FolderNotAllowed",
    "HistoryPage",
    "Lease",
    "ModeChanged",
    "Models",
    "NoSuchSession",
    "PoolHandle",
    "Published",
    "SessionActor",
    "SessionError",
    "SessionFailed",
    "SessionHandle",
    "SessionHooks",
    "SessionRegistry",
    "SessionStatus",
    "SessionUnavailable",
    "SlotFiles",
    "SlotView",
    "Subscription",
    "SubscriptionItem",
    "TooManySessions",
    "TurnDone",
    "TurnFailed",
    "UnknownModel",
    "open_core",
    "pool_actor",
    "slot_files",
]
