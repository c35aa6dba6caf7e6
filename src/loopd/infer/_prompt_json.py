"""A token-exact prompt, and its JSON kept from one request on a slot to the next.

A session's prompt extends its last one token for token. `Prompt` holds the history as a
shared list that only grows (the session's `PromptTrail`) and the pieces after it, so building
a request copies nothing of the history; `PromptJson` reuses what it encoded for the slot's
last prompt and encodes only the new pieces, as the slot's KV cache computes only the new
tokens. Copying, comparing and encoding every token id anew cost milliseconds a request once a
session's answers hold tens of thousands.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from loopd.canonical import canonical

__all__ = ["Prompt", "PromptJson", "PromptPiece", "one_prompt"]

PromptPiece = int | str
"""A token id, or text that llama-server tokenizes (special tokens included)."""


class Prompt(Sequence[PromptPiece]):
    """The first `length` pieces of `base`, then `tail`. `base` is only ever appended to, so
    two prompts on the same base share their first pieces without a look at them."""

    __slots__ = ("base", "length", "tail")

    def __init__(
        self, base: list[PromptPiece], length: int, tail: tuple[PromptPiece, ...] = ()
    ) -> None:
        self.base, self.length, self.tail = base, length, tail

    @classmethod
    def of(cls, pieces: Iterable[PromptPiece]) -> Prompt:
        """A prompt of `pieces` alone, on a base of its own."""
        return cls([], 0, tuple(pieces))

    def then(self, *pieces: PromptPiece) -> Prompt:
        """The same prompt, and `pieces` after it."""
        return Prompt(self.base, self.length, (*self.tail, *pieces))

    def with_last(self, piece: PromptPiece) -> Prompt:
        """The same prompt with its last piece `piece` instead."""
        if self.tail:
            return Prompt(self.base, self.length, (*self.tail[:-1], piece))
        return Prompt(self.base, self.length - 1, (piece,))

    def between(self, start: int, stop: int) -> list[PromptPiece]:
        """Pieces `start` to `stop`, copying only those."""
        head = self.base[start : min(stop, self.length)] if start < self.length else []
        return head + list(self.tail[max(start - self.length, 0) : max(stop - self.length, 0)])

    def __len__(self) -> int:
        return self.length + len(self.tail)

    def __iter__(self) -> Iterator[PromptPiece]:
        return itertools.chain(itertools.islice(self.base, self.length), self.tail)

    @overload
    def __getitem__(self, index: int) -> PromptPiece: ...
    @overload
    def __getitem__(self, index: slice) -> list[PromptPiece]: ...
    def __getitem__(self, index: int | slice) -> PromptPiece | list[PromptPiece]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.base[index] if index < self.length else self.tail[index - self.length]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Prompt | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Prompt({list(self)!r})"


def one_prompt(pieces: Iterable[PromptPiece]) -> str | list[PromptPiece]:
    """The pieces as llama-server reads one prompt (`PromptJson` writes the same as JSON): it
    takes a list of strings alone for several prompts, so adjacent strings are joined, and a
    prompt of text only is one string. (Only an answer without any token id leaves two
    strings side by side.)"""
    joined: list[PromptPiece] = []
    for piece in pieces:
        if isinstance(piece, str) and joined and isinstance(joined[-1], str):
            joined[-1] += piece
        else:
            joined.append(piece)
    if len(joined) == 1 and isinstance(joined[0], str):
        return joined[0]
    return joined


class PromptJson:
    """Encodes prompts as llama-server reads one (`one_prompt`: adjacent texts joined, a
    prompt of text alone a string), keeping the last one's encoding for the next."""

    RUNS_KEPT = 64
    """Runs of `_closed` joined into one past this many: one a request, the list stays short."""

    def __init__(self) -> None:
        self._last = Prompt.of(())
        self._closed: list[bytes] = []
        """The JSON of the joined pieces before `_open`, in runs (the next starts with its
        comma), so that what was encoded is not copied again until the body is."""
        self._open: str | None = None
        """The last text, which a text that follows it joins."""

    def encode(self, pieces: Sequence[PromptPiece]) -> bytes:
        """The JSON of `one_prompt(pieces)`, byte for byte as `canonical` writes it."""
        return b"".join(self.parts(pieces))

    def parts(self, pieces: Sequence[PromptPiece]) -> list[bytes]:
        """`encode`'s bytes in parts, to be joined with the rest of a body in one copy."""
        prompt = pieces if isinstance(pieces, Prompt) else Prompt.of(pieces)
        known = self._extends(prompt)
        closed, open_text = (self._closed, self._open) if known else ([], None)
        new: list[bytes] = []
        for piece in prompt.between(known, len(prompt)):
            if isinstance(piece, str):
                open_text = piece if open_text is None else open_text + piece
                continue
            if open_text is not None:
                new.append(canonical(open_text))
                open_text = None
            new.append(b"%d" % piece)
        last = [b",", canonical(open_text)] if open_text is not None else []
        if new:
            closed = [*closed, (b"," if closed else b"") + b",".join(new)]
        if len(closed) > self.RUNS_KEPT:
            closed = [b"".join(closed)]
        # Kept only now: a text that cannot be encoded leaves the last prompt's as it was.
        self._last, self._closed, self._open = prompt, closed, open_text
        if not closed:
            return [canonical(open_text) if open_text is not None else b"[]"]
        return [b"[", *closed, *last, b"]"]

    def _extends(self, prompt: Prompt) -> int:
        """How many of `prompt`'s first pieces are the last prompt's, whole (else 0): on the
        same base, only the last prompt's tail is compared; elsewhere, every piece."""
        last = self._last
        if len(prompt) < len(last):
            return 0
        if prompt.base is last.base and prompt.length >= last.length:
            same = prompt.between(last.length, len(last)) == list(last.tail)
        else:
            same = prompt.between(0, len(last)) == list(last)
        return len(last) if same else 0
