"""A bug planted in an actor, as a real one would appear: its handler of one kind of message
raises."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["plant_bug"]


def plant_bug(monkeypatch: pytest.MonkeyPatch, actor: type, kind: type, times: float = 1) -> None:
    """`actor.take` raises `KeyError("a bug")` for a message of `kind`, the first `times`
    times; every other message is taken as before."""
    take = actor.take  # type: ignore[attr-defined]
    failed = 0

    def broken(self: object, message: object, *rest: Any) -> None:
        nonlocal failed
        if isinstance(message, kind) and failed < times:
            failed += 1
            raise KeyError("a bug")
        take(self, message, *rest)

    monkeypatch.setattr(actor, "take", broken)
