"""Turning `/completion`'s stream into the same events and completion as the chat endpoint's,
without any I/O: the raw text goes through the format's parser (`parser_for`), the token ids are
kept exactly.

Each chunk names the tokens generated so far (`tokens_predicted`) and carries the id of the
newest. llama-server sends no chunk for a token that ends in the middle of a UTF-8 character,
so when the count jumps, the chunk's text stands in for the tokens it did not name: the next
request tokenizes that text again. Where the tokenizer splits the character otherwise than the
model did, the rest of the answer is recomputed, recorded as a loss (docs/cache.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import Field, TypeAdapter

from ._assemble import Assembler, Loose, PromptProgress, read_chunk
from ._format import ChatFormat
from ._messages import MessageParser
from ._parse import OutputParser, Piece
from ._schema import ArgumentTypes
from ._types import ChatEvent, Completion, Progress, PromptPiece, Timings, Unread

__all__ = ["RawAssembler", "RawChunk", "parser_for"]

log = logging.getLogger(__name__)


def parser_for(
    fmt: ChatFormat, types: ArgumentTypes | None = None, *, tokens: bool = True
) -> OutputParser | MessageParser:
    """The parser of a format: its messages (harmony's, muse-glimmer's), or the learned
    delimiters; `tokens`: each piece it is fed is the text of whole tokens, as llama-server
    streams them (False for text cut anywhere)."""
    return MessageParser(fmt, types) if fmt.messages else OutputParser(fmt, types, tokens=tokens)


class RawChunk(Loose):
    """A piece of a raw answer as llama-server's `/completion` streams it; other engines'
    streams are read into the same (`_engines`)."""

    content: str = ""
    tokens: list[int] = Field(default_factory=list)
    stop: bool = False
    stop_type: str | None = None
    tokens_predicted: int = 0
    timings: Timings | None = None
    prompt_progress: PromptProgress | None = None
    error: object | None = None


_CHUNK = TypeAdapter(RawChunk)


@dataclass
class RawAssembler:
    parser: OutputParser | MessageParser
    inner: Assembler
    tokens: list[PromptPiece] = field(default_factory=list)
    _held: str = ""
    """The newest token's text when it is a delimiter (a special token whose text the server
    sends), parsed once the next chunk shows it did not end the message. Other text goes on
    at once: holding every token back would add a token's time to the first one."""
    _markers: frozenset[str] = frozenset()
    _counted: int = 0
    """Tokens generated so far, as the server counts them."""
    _calls: int = 0
    _ended: bool = False
    unread: Unread | None = None
    """Where the parser failed on this answer: from there on, the text is content as written."""

    def __post_init__(self) -> None:
        self._markers = frozenset(self.parser.fmt.markers())

    def prime(self, prefill: str) -> list[ChatEvent]:
        """The answer's start that the prompt itself wrote (a prefill)."""
        return self._relay(self._parse(prefill)) if prefill else []

    def feed(self, data: str) -> list[ChatEvent]:
        """One `data:` payload of llama-server's `/completion` stream."""
        return self.take(read_chunk(_CHUNK, data))

    def take(self, chunk: RawChunk) -> list[ChatEvent]:
        """One chunk, read by whichever engine's stream it came from."""
        events: list[ChatEvent] = []
        if (p := chunk.prompt_progress) is not None:
            events.append(Progress(total=p.total, cache=p.cache, processed=p.processed))
            return events
        if chunk.stop:
            return events + self._stop(chunk)
        new = chunk.tokens_predicted - self._counted
        if new <= 0:
            return events
        if new > len(chunk.tokens):
            self.tokens.append(chunk.content)  # ids not sent: the text stands in for them
        else:
            self.tokens += chunk.tokens
        self._counted = chunk.tokens_predicted
        pieces = self._parse(self._held)
        self._held = ""
        if chunk.content in self._markers:
            self._held = chunk.content
        else:
            pieces += self._parse(chunk.content)
        return events + self._relay(pieces)

    def _parse(self, text: str, *, final: bool = False) -> list[Piece]:
        """The parser's pieces of `text` (and its last, when `final`): the one place it runs,
        so that nothing it raises fails the turn. Where it fails, what it held and `text` go on
        as content, as written, and so does the rest of the answer (`unread` says where)."""
        if self.unread is not None:
            return [Piece("content", text)] if text else []
        read = self.parser.pending() + text
        try:
            pieces = self.parser.feed(text)
            return pieces + self.parser.finish() if final else pieces
        except Exception as e:  # whatever the parser raises, the answer goes on
            error = f"{type(e).__name__}: {e}"
            log.warning(
                "could not read the model's answer (%s); %d characters of it passed on as "
                "content, as written",
                error,
                len(read),
                exc_info=True,
            )
            self.unread = Unread(text=read, error=error)
            return [Piece("content", read)] if read else []

    @property
    def done(self) -> bool:
        return self.inner.done

    def _stop(self, chunk: RawChunk) -> list[ChatEvent]:
        self._ended = chunk.stop_type == "eos"
        # The text of an end-of-generation token is not part of the answer.
        held = "" if self._ended else self._held
        events = self._relay(self._parse(held, final=True))
        if self._calls:
            reason = "tool_calls"
        else:
            reason = "stop" if chunk.stop_type in ("eos", "word") else "length"
        return events + self.inner.end(reason, chunk.timings)

    def _relay(self, pieces: list[Piece]) -> list[ChatEvent]:
        events: list[ChatEvent] = []
        for piece in pieces:
            if piece.kind == "reasoning":
                events += self.inner.reasoning(piece.text)
            elif piece.kind == "content":
                events += self.inner.content(piece.text)
            else:
                self._calls += 1
                # Nine characters: the length Mistral's templates insist on.
                call_id = f"call{self._calls:05d}"
                events += self.inner.call(self._calls - 1, call_id, piece.name, piece.text)
        return events

    def past_limit(self) -> list[ChatEvent] | None:
        return self.inner.past_limit()

    def completion(self, *, cut_by_client: bool = False) -> Completion:
        done = self.inner.completion(cut_by_client=cut_by_client)
        update = {"tokens": tuple(self.tokens), "ended": self._ended, "unread": self.unread}
        return done.model_copy(update=update)
