"""The one backoff policy: exponential, capped, half of each wait fixed and half random."""

from __future__ import annotations

from loopd.backoff import RECONNECT, RESTART, Backoff
from loopd.infer import RetryPolicy


def test_each_wait_is_between_half_and_all_of_its_ceiling_and_the_ceiling_is_capped() -> None:
    policy = Backoff(base=1.0, cap=10.0)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (40, 10.0)]:
        waits = [policy.delay(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 10  # jittered, not one value


def test_requests_restarts_and_reconnects_share_it() -> None:
    assert isinstance(RetryPolicy(), Backoff)
    assert RetryPolicy().delay(10) <= 8.0
    assert RESTART.delay(20) <= 60.0
    assert RECONNECT.delay(20) <= 5.0
