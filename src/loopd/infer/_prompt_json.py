"""A token-exact prompt as JSON, kept from one request on a slot to the next.

A session's prompt extends its last one token for token, so what was encoded for that one is
reused and only the new pieces are encoded, as the slot's KV cache computes only the new
tokens. Encoding every token id anew costs about 0.15 ms a thousand on two cores, and a long
session's answers hold tens of thousands.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from loopd.canonical import canonical

if TYPE_CHECKING:
    from ._types import PromptPiece

__all__ = ["PromptJson", "one_prompt"]


def one_prompt(pieces: list[PromptPiece]) -> str | list[PromptPiece]:
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


def _text(text: str) -> str:
    return canonical(text).decode()


class PromptJson:
    """Encodes prompts as llama-server reads one (`one_prompt`: adjacent texts joined, a
    prompt of text alone a string), keeping the last one's encoding for the next."""

    def __init__(self) -> None:
        self._pieces: list[PromptPiece] = []
        self._closed = ""
        """The JSON of the joined pieces before `_open`, comma-separated."""
        self._open: str | None = None
        """The last text, which a text that follows it joins."""

    def encode(self, pieces: list[PromptPiece]) -> str:
        """The JSON of `one_prompt(pieces)`, byte for byte as `canonical` writes it."""
        known = len(self._pieces)
        if pieces[:known] != self._pieces:  # not an extension of the last
            known, self._closed, self._open = 0, "", None
        closed, open_text = [self._closed] if self._closed else [], self._open
        for piece in itertools.islice(pieces, known, None):
            if isinstance(piece, str):
                open_text = piece if open_text is None else open_text + piece
                continue
            if open_text is not None:
                closed.append(_text(open_text))
                open_text = None
            closed.append(str(piece))
        self._pieces, self._closed, self._open = list(pieces), ",".join(closed), open_text
        if not self._closed:
            return _text(open_text) if open_text is not None else "[]"
        return (
            f"[{self._closed},{_text(open_text)}]" if open_text is not None else f"[{self._closed}]"
        )
