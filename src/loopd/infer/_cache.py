"""Did llama-server reuse the KV cache? The first performance figure of loopd.

After a request the slot holds its whole prompt and the tokens the model generated, less the
last one (sampled, never evaluated). Request n+1 extends request n, so all of that should come
from the cache: `expected = cache_n + prompt_n + predicted_n - 1` of the previous request. A
request that finds fewer has recomputed what the slot held: a template that rendered history
differently, or an answer whose text does not tokenize back to the tokens generated.

vLLM keeps its cache in blocks (`--block-size`) and reuses whole blocks only: there the limit
is the blocks the previous request filled (`cache_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._types import Timings

__all__ = [
    "CacheOutcome",
    "Hit",
    "Loss",
    "Unreported",
    "cache_limit",
    "cache_outcome",
    "slot_tokens",
]


@dataclass(frozen=True)
class Hit:
    """The new request found everything the slot held in the cache."""


@dataclass(frozen=True)
class Unreported:
    """The server does not say what came from its cache: no figure is made up."""


@dataclass(frozen=True)
class Loss:
    """Fewer tokens came from the cache than the slot held after the previous request."""

    expected: int
    cached: int


CacheOutcome = Hit | Loss | Unreported


def slot_tokens(t: Timings) -> int:
    """Tokens the slot holds after a request: its prompt and the evaluated generated tokens."""
    return (t.cache_n or 0) + t.prompt_n + max(t.predicted_n - 1, 0)


def cache_limit(previous: Timings, new: Timings) -> int:
    """The most the new request can find in the cache: what the previous one left there. On
    an engine that caches whole blocks (`new.block`, vLLM), only the blocks it filled, and
    never the new prompt's last token (it is always computed, to sample the next one)."""
    held = slot_tokens(previous)
    if new.block is None:
        return held
    prompt = (new.cache_n or 0) + new.prompt_n
    return min(held, prompt - 1) // new.block * new.block


def cache_outcome(previous: Timings, new: Timings) -> CacheOutcome:
    if new.cache_n is None:
        return Unreported()
    expected = cache_limit(previous, new)
    if new.cache_n < expected:
        return Loss(expected=expected, cached=new.cache_n)
    return Hit()
