"""What a `bxctl` command's exit status says, and the one reading of a turn's number as a
person writes it: shared by the parser (`bxctl.cli`) and the commands it runs, which import
this and never the parser back."""

from __future__ import annotations

__all__ = [
    "EXIT_APPROVAL",
    "EXIT_FAILED",
    "EXIT_FULL",
    "EXIT_LIMIT",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "FAILURE_EXIT",
    "turn_number",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_LIMIT = 3
EXIT_FULL = 4
EXIT_UNREACHABLE = 5
EXIT_APPROVAL = 6
FAILURE_EXIT = {"turn_limit": EXIT_LIMIT, "session_full": EXIT_FULL}
"""The status of a turn that failed, by the failure's kind (others: `EXIT_FAILED`)."""


def turn_number(word: str) -> int | None:
    """A turn's number as a person writes it (they count from 1); None for anything else."""
    return int(word) if word.isdigit() and int(word) >= 1 else None
