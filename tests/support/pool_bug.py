"""`loopd serve` with a bug planted in its slot pool, for the supervision tests: taking a
`status`'s question (the slots' views) raises in `_Pool.take`, every time, as a real bug would.

    python pool_bug.py python -m loopd serve ...    (the command after it, without `-m loopd`)
"""

from __future__ import annotations

import runpy
import sys

from loopd.actors._pool import _Message, _Pool, _Views

take = _Pool.take


def broken(pool: _Pool, message: _Message) -> None:
    if isinstance(message, _Views):
        raise KeyError("a bug")
    take(pool, message)


if __name__ == "__main__":
    setattr(_Pool, "take", broken)  # noqa: B010 - planted as a monkeypatch would
    sys.argv = ["loopd", *sys.argv[sys.argv.index("loopd") + 1 :]]
    runpy.run_module("loopd", run_name="__main__", alter_sys=True)
