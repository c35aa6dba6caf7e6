"""One line at a time from a trio stream, framed by `loopd.wire.lines`."""

from __future__ import annotations

from collections import deque

import trio

from loopd.wire.lines import Lines, TooLong

__all__ = ["LineReader"]

READ_SIZE = 1 << 16


class LineReader:
    """One line at a time from a stream."""

    def __init__(self, stream: trio.abc.ReceiveStream, cap: int) -> None:
        self.stream = stream
        self._lines = Lines(cap)
        self._ready: deque[bytes | TooLong] = deque()

    async def next(self) -> bytes | TooLong | None:
        """The next line; None when the stream ended (half a line left over is dropped) or
        broke."""
        while not self._ready:
            try:
                data = await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self._ready.extend(self._lines.feed(data))
        return self._ready.popleft()
