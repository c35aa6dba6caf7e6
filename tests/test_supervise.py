"""The restart bound on its own: failures are counted within a window of time, and only one
more than the bound gives up."""

from __future__ import annotations

import pytest
import trio

from loopd.supervise import GaveUp, Restarts, supervised


class Failing:
    """A life that fails `times` times, `apart` seconds apart, then returns."""

    def __init__(self, times: int, apart: float) -> None:
        self.times, self.apart, self.lives = times, apart, 0

    async def __call__(self) -> None:
        self.lives += 1
        if self.lives <= self.times:
            await trio.sleep(self.apart)
            raise KeyError(f"bug {self.lives}")


async def test_failures_within_the_bound_are_restarted_until_the_life_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    life = Failing(times=2, apart=0)
    await supervised("the actor", life, Restarts(most=2, within=60))
    assert life.lives == 3


async def test_failures_further_apart_than_the_window_never_give_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    life = Failing(times=10, apart=61)
    await supervised("the actor", life, Restarts(most=1, within=60))
    assert life.lives == 11


async def test_one_failure_more_than_the_bound_gives_up_naming_the_actor_and_the_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    life = Failing(times=10, apart=1)
    with pytest.raises(GaveUp, match=r"^the actor failed 3 times within 60 s, .* 'bug 3'$"):
        await supervised("the actor", life, Restarts(most=2, within=60))
    assert life.lives == 3


async def test_past_the_bound_gave_up_is_told_why_and_the_actor_waits_for_the_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    told: list[str] = []

    async def gave_up(why: str) -> None:
        told.append(why)

    with trio.move_on_after(3600) as waited:
        await supervised("the actor", Failing(10, 0), Restarts(most=1, gave_up=gave_up))
    assert waited.cancelled_caught
    assert told == ["the actor failed 2 times within 60 s, the last time with KeyError: 'bug 2'"]
