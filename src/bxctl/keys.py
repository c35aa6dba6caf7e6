"""Single keys from the terminal, read in trio: the terminal in cbreak mode (keys arrive as
typed, without Enter or echo; Ctrl-C still interrupts) only while a key is awaited."""

from __future__ import annotations

import os
import sys
import termios
import tty
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["can_read_keys", "cbreak", "read_key"]


def can_read_keys() -> bool:
    return sys.stdin.isatty()


@contextmanager
def cbreak() -> Iterator[int]:
    """The terminal's descriptor in cbreak mode; its settings restored on the way out."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def read_key(fd: int) -> str:
    """The next key typed (its first byte, lower-cased)."""
    await trio.lowlevel.wait_readable(fd)
    return os.read(fd, 1).decode(errors="replace").lower()
