"""The socket systemd passes when it starts loopd by socket activation (sd_listen_fds(3)):
`LISTEN_FDS` sockets from fd 3 on, meant for the process whose pid is `LISTEN_PID`.

Variables meant for another process (a `LISTEN_PID` that is not ours, or none) are ignored, as
sd_listen_fds ignores them: loopd binds its own socket. Variables meant for loopd that it cannot
use (a count that is not 1, an fd that is not a listening Unix stream socket on a path) are an
error that says which: a unit that passes them is wrong, and guessing would serve nobody.
Either way the variables are unset, and the fd is not inherited: llama-server, the tools and
the commands they run never see them.

The activated socket is systemd's: loopd keeps the usual privacy of its folder and file, does
not publish or replace anything, and leaves the file in place on exit, so the next connection
starts loopd again.
"""

from __future__ import annotations

import logging
import os
import socket as stdsocket
from pathlib import Path

import trio

from ._socket import UnixSocket, private_directory

__all__ = ["BadActivation", "systemd_socket"]

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3
"""The first fd systemd passes (SD_LISTEN_FDS_START)."""
VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class BadActivation(Exception):
    """systemd passed loopd a socket it cannot listen on; the message says why."""


def systemd_socket() -> UnixSocket | None:
    """The listening socket systemd passed to this process, or None when it passed none."""
    pid, count = (os.environ.get(name) for name in VARIABLES[:2])
    for name in VARIABLES:
        os.environ.pop(name, None)
    if pid != str(os.getpid()) or count in (None, "0"):
        if count is not None:
            log.info("LISTEN_FDS=%s for pid %s, not a socket for loopd: ignored", count, pid)
        return None
    if count != "1":
        raise BadActivation(
            f"systemd passed LISTEN_FDS={count}; loopd listens on one socket "
            "(one ListenStream= in its .socket unit)"
        )
    try:
        sock = stdsocket.socket(fileno=LISTEN_FDS_START)
    except OSError as e:
        raise BadActivation(
            f"systemd's fd {LISTEN_FDS_START} is not a socket ({e.strerror})"
        ) from None
    try:
        return _adopt(sock)
    except BaseException:
        sock.close()
        raise


def _adopt(sock: stdsocket.socket) -> UnixSocket:
    sock.set_inheritable(False)
    listening = sock.getsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_ACCEPTCONN)
    if sock.family != stdsocket.AF_UNIX or sock.type != stdsocket.SOCK_STREAM or not listening:
        raise BadActivation(
            f"systemd's fd {LISTEN_FDS_START} is not a listening Unix stream socket "
            "(ListenStream= a path in loopd's .socket unit)"
        )
    name = sock.getsockname()
    if not isinstance(name, str) or not name or name.startswith("\0"):
        raise BadActivation(
            f"systemd's socket has no path ({name!r}); loopd's clients connect to a path"
        )
    path = Path(name)
    private_directory(path)
    path.chmod(0o600)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    return UnixSocket(path, listener, path.stat().st_ino, owned=False)
