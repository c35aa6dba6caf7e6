"""A running command's output for the people watching (`ToolRequest.on_output`): decoded
across split UTF-8 sequences, sent in batches at most every `EVERY` seconds, and at most
`LIVE_BYTES` of it per call, so a command that prints without end floods no client. The
model's result is made apart from it, from the whole output."""

from __future__ import annotations

import codecs
from collections.abc import Callable

import trio

__all__ = ["CUT_NOTE", "EVERY", "LIVE_BYTES", "LiveOutput"]

EVERY = 0.2
"""Seconds between two batches at least."""
LIVE_BYTES = 32 * 1024
"""Bytes of a command's output sent live at most; its result keeps more."""
CUT_NOTE = f"\n[loopd: only the first {LIVE_BYTES // 1024} KiB of the output are shown live]\n"


class LiveOutput:
    def __init__(self, send: Callable[[str], None]) -> None:
        self._send = send
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: list[str] = []
        self._room = LIVE_BYTES

    def take(self, chunk: bytes) -> None:
        """Queue what came, as far as the room left allows."""
        if self._room < 0:  # the note is queued: nothing more is sent
            return
        # A sequence split at a chunk's end waits in the decoder for its other bytes.
        self._pending.append(self._decoder.decode(chunk[: self._room]))
        self._room -= len(chunk)
        if self._room < 0:
            self._pending.append(CUT_NOTE)

    def flush(self, *, final: bool = False) -> None:
        """Send what waits; `final`: the output has ended (a sequence left unfinished is
        sent as a replacement character)."""
        if final and self._room >= 0:
            self._pending.append(self._decoder.decode(b"", final=True))
        text = "".join(self._pending)
        self._pending.clear()
        if text:
            self._send(text)

    async def flushing(self) -> None:
        """Send a batch every `EVERY` seconds, until cancelled."""
        while True:
            await trio.sleep(EVERY)
            self.flush()
