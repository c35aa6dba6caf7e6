"""The one backoff policy for everything loopd tries again: requests to llama-server
(`infer.RetryPolicy`), restarts of the embedded llama-server and of MCP servers, and bxctl's
reconnects. Exponential from `base`, capped at `cap`, and jittered: half the wait fixed, half
random, so many clients never retry in step and no wait is zero."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["RECONNECT", "RESTART", "Backoff"]


@dataclass(frozen=True)
class Backoff:
    base: float
    cap: float

    def delay(self, attempt: int) -> float:
        """Seconds to wait before try `attempt + 1`, after `attempt` (from 1) failed."""
        # The exponent capped too: 2.0 ** 1024 overflows, and a long wait tries that often.
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt - 1, 64))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # noqa: S311 - jitter, not secrets


RESTART = Backoff(base=1.0, cap=60.0)
"""A server (llama-server, an MCP server) that does not start: up to a minute apart."""
RECONNECT = Backoff(base=0.25, cap=5.0)
"""bxctl waiting for loopd to answer again."""
