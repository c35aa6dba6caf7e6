"""JSON lines on a byte stream: whole lines out of what arrives in pieces, under a cap.

The one framing of every line protocol here: loopd's socket (both ends) and `bxctl acp`'s
stdin. A line over the cap is reported as soon as it is known to be one, before more of it
is kept; the reader decides what that means (the socket closes the connection, the ACP agent
answers an error and goes on past the line's end). Sans-IO, and free of trio: `bxctl
status` frames its blocking socket's bytes with it too; `loopd.wire.reader` reads a trio
stream through it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lines", "TooLong"]


@dataclass(frozen=True)
class TooLong:
    """A line longer than the cap was skipped (or is being skipped to its end)."""

    cap: int


class Lines:
    """Bytes in, whole non-blank lines out, in order."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._buffer = bytearray()
        self._skipping = False
        """In a line already reported too long: dropped up to its newline."""

    def feed(self, data: bytes | bytearray) -> list[bytes | TooLong]:
        self._buffer += data
        found: list[bytes | TooLong] = []
        while True:
            newline = self._buffer.find(b"\n")
            if self._skipping:
                if newline < 0:
                    self._buffer.clear()
                    return found
                del self._buffer[: newline + 1]
                self._skipping = False
                continue
            if newline < 0:
                if len(self._buffer) > self.cap:
                    found.append(TooLong(self.cap))
                    self._buffer.clear()
                    self._skipping = True
                return found
            line = bytes(self._buffer[:newline])
            del self._buffer[: newline + 1]
            if len(line) > self.cap:
                found.append(TooLong(self.cap))
            elif line.strip():
                found.append(line)
