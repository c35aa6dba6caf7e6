"""Did llama-server reuse the KV cache? The first performance figure of loopd.

After a request the slot holds its whole prompt and the tokens the model generated, less the
last one (sampled, never evaluated). Request n+1 extends request n, so all of that should come
from the cache: `expected = cache_n + prompt_n + predicted_n - 1` of the previous request. A
request that finds fewer has recomputed what the slot held: a template that rendered history
differently, or an answer whose text does not tokenize back to the tokens generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._types import Timings

__all__ = ["CacheOutcome", "Hit", "Loss", "cache_outcome", "slot_tokens"]


@dataclass(frozen=True)
class Hit:
    """The new request found everything the slot held in the cache."""


@dataclass(frozen=True)
class Loss:
    """Fewer tokens came from the cache than the slot held after the previous request."""

    expected: int
    cached: int


CacheOutcome = Hit | Loss


def slot_tokens(t: Timings) -> int:
    """Tokens the slot holds after a request: its prompt and the evaluated generated tokens."""
    return t.cache_n + t.prompt_n + max(t.predicted_n - 1, 0)


def cache_outcome(previous: Timings, new: Timings) -> CacheOutcome:
    expected = slot_tokens(previous)
    if new.cache_n < expected:
        return Loss(expected=expected, cached=new.cache_n)
    return Hit()
