"""How many times trio ran a task: a pass of trio's loop on the way to a first token is what
some tests rule out, counted rather than timed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio


class Steps(trio.abc.Instrument):
    """How many times the task it watches was run."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task, self.count = task, 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += task is self.task


@contextmanager
def counted_steps() -> Iterator[Steps]:
    """The current task's steps while the block runs (not counting the one it is in)."""
    steps = Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)
