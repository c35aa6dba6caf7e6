"""An answer caught in a loop: the same short text over and over, the way a small or heavily
quantized model repeats itself until `max_tokens` ("She loves her cat. She loves her cat.").

`Repetition` watches one stream of text (an answer's content, or its reasoning) and says when
its last `cap` characters are one piece of at most `MAX_PERIOD` characters repeated: a loop
that long is never what anyone asked for, while a list or a table that repeats a shape with
other words in it never matches. The check finds the candidate periods with `str.rfind` of the
text's last characters, so it costs a few comparisons of `cap` characters, every
`CHECK_EVERY` characters.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_PERIOD", "Repetition", "period_of"]

MAX_PERIOD = 400
"""The longest piece whose repetition counts as a loop (a paragraph said again and again)."""
PROBE = 16
"""Characters at the end of the text whose earlier occurrences give the candidate periods."""
CHECK_EVERY = 32
"""Characters between two checks."""


def period_of(text: str, span: int, max_period: int = MAX_PERIOD) -> int | None:
    """The shortest period p <= `max_period` such that the last `span` characters of `text`
    repeat with period p (each character equals the one p before it), at least twice over;
    None when there is none."""
    if span <= PROBE or len(text) < span:
        return None
    tail = text[-span:]
    probe = tail[-PROBE:]
    start = len(tail) - PROBE
    limit = len(tail) - 1  # the probe's earlier occurrences, nearest first
    while (at := tail.rfind(probe, 0, limit)) >= 0:
        period = start - at
        if period > max_period or 2 * period > span:
            return None
        if tail[period:] == tail[:-period]:
            return period
        limit = at + PROBE - 1
    return None


@dataclass
class Repetition:
    """Feed it one stream's text as it comes; `period` is set once it loops over `cap`
    characters."""

    cap: int
    period: int | None = None
    _tail: str = ""
    _unchecked: int = 0

    def feed(self, text: str) -> int | None:
        """The loop's period once the stream has repeated itself over `cap` characters."""
        if self.period is not None:
            return self.period
        self._tail = (self._tail + text)[-self.cap :]
        self._unchecked += len(text)
        if self._unchecked >= CHECK_EVERY and len(self._tail) == self.cap:
            self._unchecked = 0
            self.period = period_of(self._tail, self.cap)
        return self.period
