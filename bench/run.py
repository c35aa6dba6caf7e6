"""`just bench`: measure the figures that matter and write bench/results.md and .json.

Figures are medians over repeated runs, each beside a baseline measured in the same run, so
the ratio means something on a noisy machine. Nothing here is a test: no figure can fail.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

import store

HERE = Path(__file__).resolve().parent
COMMAND = "just bench"


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}"


def main() -> int:
    started = datetime.now(UTC)
    print(f"$ {COMMAND}   ({machine()})", file=sys.stderr)
    figures = {"store": store.run()}
    table = ["| figure | loopd | baseline (same run) | ratio |", "| --- | --- | --- | --- |"]
    table += [f"| {' | '.join(row)} |" for row in store.rows(figures["store"])]
    text = "\n".join(
        [
            "# Benchmark results",
            "",
            f"Measured {started:%Y-%m-%d %H:%M} UTC on {machine()}, by `{COMMAND}`.",
            "",
            *table,
            "",
        ]
    )
    (HERE / "results.md").write_text(text)
    record = {"date": started.isoformat(), "machine": machine(), "command": COMMAND, **figures}
    (HERE / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
