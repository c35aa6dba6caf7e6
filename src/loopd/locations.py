"""Where loopd's config file, socket and sessions are, found without validating the config.

`loopd.config` reads the whole file through its models (pydantic); a one-shot client such as
`bxctl status` needs two paths of it, and the models cost more than the rest of its run. The
defaults are defined here, once, for both.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

__all__ = [
    "APP",
    "Places",
    "config_file",
    "config_path",
    "configured",
    "default_socket",
    "default_store",
]

APP = "loopd"


def config_path(explicit: Path | None = None) -> tuple[Path | None, bool]:
    """The file to read, and whether the user named it (then it must exist)."""
    if explicit is not None:
        return explicit, True
    if named := os.environ.get("LOOPD_CONFIG"):
        return Path(named), True
    default = platformdirs.user_config_path(APP) / "config.toml"
    return (default, False) if default.is_file() else (None, False)


def config_file(explicit: Path | None = None) -> Path:
    """The config file in effect: the one `config_path` reads, else the user's own in loopd's
    config folder (`$XDG_CONFIG_HOME/loopd`), where one would be read once written. For a
    hint that names it."""
    path, _ = config_path(explicit)
    return path or platformdirs.user_config_path(APP) / "config.toml"


def default_socket() -> Path:
    """`[channel] socket` when the config names none."""
    # $XDG_RUNTIME_DIR is private to the user; without one, a per-user folder in /tmp that the
    # channel server creates 0700 (platformdirs' own fallback comes with a warning).
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / APP / "loopd.sock"
    return Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}" / "loopd.sock"


def default_store() -> Path:
    """`[store] directory` when the config names none."""
    return platformdirs.user_state_path(APP) / "sessions"


@dataclass(frozen=True)
class Places:
    socket: Path
    """`[channel] socket`."""
    store: Path
    """`[store] directory`."""


def configured(explicit: Path | None = None) -> Places | None:
    """The socket and the store the config names (or the defaults), read as plain TOML; None
    when the file cannot say so plainly (a named file missing, not TOML, a path that is not a
    string): `loopd.config.load_config` then tells what is wrong."""
    path, named = config_path(explicit)
    data: dict[str, Any] = {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8")) if path else {}
    except FileNotFoundError:
        if named:
            return None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    socket = _path(data, "channel", "socket", default_socket)
    store = _path(data, "store", "directory", default_store)
    return None if socket is None or store is None else Places(socket, store)


def _path(data: dict[str, Any], table: str, key: str, default: Callable[[], Path]) -> Path | None:
    """`[table] key` as a path (`default()` when not given); None: not a plain string."""
    section = data.get(table, {})
    if not isinstance(section, dict):
        return None
    value = section.get(key)  # TOML has no null: None is a key not given
    if value is None:
        return default()
    return Path(value) if isinstance(value, str) else None
