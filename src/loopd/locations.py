"""Where loopd's config file and socket are, found without validating the config.

`loopd.config` reads the whole file through its models (pydantic); a one-shot client such as
`bxctl status` needs the socket alone, and the models cost more than the rest of its run. The
defaults are defined here, once, for both.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from pathlib import Path

import platformdirs

__all__ = ["APP", "config_path", "configured_socket", "default_socket"]

APP = "loopd"


def config_path(explicit: Path | None = None) -> tuple[Path | None, bool]:
    """The file to read, and whether the user named it (then it must exist)."""
    if explicit is not None:
        return explicit, True
    if named := os.environ.get("LOOPD_CONFIG"):
        return Path(named), True
    default = platformdirs.user_config_path(APP) / "config.toml"
    return (default, False) if default.is_file() else (None, False)


def default_socket() -> Path:
    """`[channel] socket` when the config names none."""
    # $XDG_RUNTIME_DIR is private to the user; without one, a per-user folder in /tmp that the
    # channel server creates 0700 (platformdirs' own fallback comes with a warning).
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / APP / "loopd.sock"
    return Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}" / "loopd.sock"


def configured_socket(explicit: Path | None = None) -> Path | None:
    """The socket the config names (`[channel] socket`, else the default), read as plain TOML;
    None when the file cannot say so plainly (a named file missing, not TOML, a socket that
    is not a string): `loopd.config.load_config` then tells what is wrong."""
    path, named = config_path(explicit)
    if path is None:
        return default_socket()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None if named else default_socket()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    channel = data.get("channel", {})
    socket = channel.get("socket") if isinstance(channel, dict) else None
    if socket is None and isinstance(channel, dict):
        return default_socket()
    return Path(socket) if isinstance(socket, str) else None
