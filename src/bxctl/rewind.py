"""`/rewind` as the live chat and the editor (`bxctl acp`) both take it: its words and the
turns to pick from."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from bxctl.exits import turn_number
from loopd.wire.proto import ClientMessage, DaemonMessage, History, HistoryRequest

__all__ = ["HELP", "USAGE", "Ask", "parse", "said"]

USAGE = "/rewind, /rewind N or /rewind N files (1 is the first turn)"
HELP = (
    "/rewind N goes on from the end of turn N; /rewind N files also puts back the files the "
    "later turns changed"
)

Ask = Callable[[ClientMessage], Awaitable[DaemonMessage]]
"""Send a request to loopd in the session and return its answer (or error)."""


def parse(words: list[str]) -> tuple[int, bool] | None:
    """The turn `/rewind N [files]` goes back to and whether it puts files back; None for
    words it does not take (none at all, too, which asks for the turns)."""
    if not 1 <= len(words) <= 2 or words[1:] not in ([], ["files"]):
        return None
    at = turn_number(words[0])
    return None if at is None else (at, len(words) == 2)


async def said(ask: Ask) -> list[str]:
    """What the person said in the session, turn by turn, read a page of history at a time."""
    messages: list[str] = []
    start = 0
    while True:
        page = await ask(HistoryRequest(start=start))
        if not isinstance(page, History) or not page.records:
            return messages
        messages += [r["content"] for r in page.records if r.get("kind") == "user"]
        start += len(page.records)
