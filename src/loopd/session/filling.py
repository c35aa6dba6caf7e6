"""How a session's context is filled: the tokens its slot holds, by what they are.

Each request's figures (its `usage` record) are the server's own count: the prompt it read
(cached and processed), and what it generated, all but the last token evaluated into the
slot. A request's prompt extends the one before it with what came since (a user message or
tool results, in the template's markers), so the difference of two prompts is what those
cost, and the slot's tokens split into parts with no estimate: the first prompt (the system
prompt, the tool definitions and the first message), the messages and the tool results added
since, the answers and their reasoning. That holds where history is token-exact; where it
goes as messages the template may drop past reasoning, and the parts are only as exact as
that lets them be (`exact` says which).

Pure: a fold over the records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loopd.session.records import (
    AssistantRecord,
    PromptRecord,
    Record,
    ToolResultRecord,
    UsageRecord,
    UserRecord,
)

__all__ = ["Filling", "filling"]


@dataclass(frozen=True)
class Filling:
    """A slot's tokens by part; they add up to `held`."""

    start: int
    """The first prompt: the system prompt, the tool definitions and the first message."""
    messages: int
    """The user's messages since, with the template's markers around each."""
    tool_results: int
    """The tool results since, with their markers."""
    answers: int
    """The model's answers (their text and tool calls), reasoning aside."""
    reasoning: int
    """The reasoning of those answers, kept as generated."""
    exact: bool
    """Every figure is the server's count: history went token-exact, and every request
    reported its figures."""

    @property
    def held(self) -> int:
        return self.start + self.messages + self.tool_results + self.answers + self.reasoning


def filling(records: Iterable[Record]) -> Filling | None:
    """The parts of what the slot holds after the last request of `records`; None before any
    request reported its figures."""
    fold = _Fold()
    for record in records:
        fold.add(record)
    if fold.held is None:
        return None
    return Filling(exact=fold.exact, **fold.parts)


_PARTS = ("start", "messages", "tool_results", "answers", "reasoning")


class _Fold:
    def __init__(self) -> None:
        self.parts = dict.fromkeys(_PARTS, 0)
        self.held: int | None = None
        self.added = "messages"
        """The part that the next request's new prompt tokens are."""
        self.exact = True

    def add(self, record: Record) -> None:
        if isinstance(record, PromptRecord) and record.full:
            self.held = None  # a prompt rendered whole: the slot starts from it anew
            self.parts = dict.fromkeys(_PARTS, 0)
        elif isinstance(record, AssistantRecord) and record.tokens is None:
            self.exact = False  # history as messages: the template decides what stays
        elif isinstance(record, UserRecord):
            self.added = "messages"
        elif isinstance(record, ToolResultRecord):
            self.added = "tool_results"
        elif isinstance(record, UsageRecord):
            self._request(record)

    def _request(self, usage: UsageRecord) -> None:
        if usage.timings is None:  # a stream cut short reports nothing
            self.exact = False
            return
        if usage.timings.cache_n is None:  # a server that does not say what it had cached
            self.exact = False
        prompt, generated = usage.timings.prompt_tokens, usage.timings.predicted_n
        if self.held is None:
            self.parts["start"] += prompt
        elif prompt >= self.held:
            self.parts[self.added] += prompt - self.held
        else:  # less than the slot held: the template dropped some of it
            self.exact = False
            self.parts = dict.fromkeys(_PARTS, 0) | {"start": prompt}
        kept = max(generated - 1, 0)  # the last token generated is never evaluated
        reasoning = min(usage.reasoning_tokens, kept)
        self.parts["reasoning"] += reasoning
        self.parts["answers"] += kept - reasoning
        self.held = prompt + kept
