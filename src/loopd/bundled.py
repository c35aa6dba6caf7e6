"""The llama-server and model that a checkout's set-up installed (`just setup`, `just chat`):
the set-up names them in `share/loopd/bundled.json` of the Python environment it installs
loopd into, so any loopd of that environment (started by `bxctl chat` or an editor's
`bxctl acp`, or run as `loopd serve`) finds them with no config file and no variables.

The config and the environment still come first (`[server.managed]`, `$LOOPD_LLAMA_SERVER`,
`$LOOPD_MODEL`): the bundled pair is only what a new user gets before naming anything. A file
that is missing, unreadable or names files that are gone counts as no bundled pair, and the
start-up error says what to set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Bundled", "bundled", "bundled_file"]


@dataclass(frozen=True)
class Bundled:
    binary: Path
    model: Path
    temperature: str | None
    """The sampling temperature the bundled model answers best at, the embedded server's
    default unless `$LLAMA_ARG_TEMPERATURE` names another."""


def bundled_file(prefix: str | None = None) -> Path:
    """Where the set-up writes the bundled pair: beside this install of loopd."""
    return Path(prefix or sys.prefix) / "share" / "loopd" / "bundled.json"


def bundled(prefix: str | None = None) -> Bundled | None:
    """The bundled llama-server and model, where the set-up named them and both are there."""
    try:
        named = json.loads(bundled_file(prefix).read_text())
        found = Bundled(
            binary=Path(named["binary"]),
            model=Path(named["model"]),
            temperature=None if named.get("temperature") is None else str(named["temperature"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (found.binary.is_file() and found.model.is_file()):
        return None
    return found
