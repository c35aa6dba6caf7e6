"""The channel's socket: made 0600 in a 0700 directory of the user's own, bound under a
temporary name and renamed into place; a stale socket of a dead daemon is replaced, a live one
is left alone."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket as stdsocket
import stat
from dataclasses import dataclass
from pathlib import Path

import trio

__all__ = ["DaemonRunning", "UnixSocket", "UnsafeSocket", "open_socket", "private_directory"]

log = logging.getLogger(__name__)


class UnsafeSocket(Exception):
    """The socket's folder could let another user in; loopd will not listen there."""


class DaemonRunning(Exception):
    """A live daemon already listens on the socket."""


def private_directory(path: Path) -> bool:
    """Make the socket's directory 0700; whether a socket is already there. A directory that
    is a link or another user's is refused: whoever owns it could put their own socket there
    and read what clients send (a shared /tmp lets anyone create the folder first)."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeSocket(f"{directory} is a symbolic link; loopd's socket needs a real folder")
    if info.st_uid != os.getuid():
        raise UnsafeSocket(
            f"{directory} belongs to another user (uid {info.st_uid}); set [channel] socket to "
            "a path in a folder of your own"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        directory.chmod(0o700)
    return path.exists() or path.is_symlink()


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


@dataclass
class UnixSocket:
    path: Path
    listener: trio.SocketListener
    inode: int
    """The socket file's inode when bound: it is unlinked on close only if it is still ours."""
    owned: bool = True
    """loopd bound and published it (False: systemd did, and the file stays when loopd stops)."""

    def gone(self) -> str | None:
        """Why clients can no longer reach loopd here, if they cannot: the socket file was
        removed or another took its place. (A new loopd could not start either: this one
        holds the store.)"""
        try:
            inode = self.path.stat().st_ino
        except (FileNotFoundError, NotADirectoryError):
            return f"its socket {self.path} was removed"
        return None if inode == self.inode else f"its socket {self.path} was replaced"

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            if self.owned and self.path.stat().st_ino == self.inode:
                self.path.unlink()
        await self.listener.aclose()


async def open_socket(path: Path) -> UnixSocket:
    """Listen on `path`: 0600, in a 0700 directory, replacing only a stale socket."""
    if private_directory(path):
        probe = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        try:
            await probe.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            log.info("replacing the stale socket %s", path)
            _unlink(path)
        else:
            raise DaemonRunning(f"a loopd daemon already runs at {path}")
        finally:
            probe.close()
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    _unlink(staging)
    sock = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    await sock.bind(str(staging))
    try:
        inode = _publish(staging, path)
    except BaseException:
        sock.close()
        raise
    sock.listen(64)
    return UnixSocket(path, trio.SocketListener(sock), inode)


def _publish(staging: Path, path: Path) -> int:
    """Put the bound socket in place, never over another: a second name, which fails when a
    daemon that started at the same moment got there first (a rename would replace its
    socket, and the loser's exit would then remove the winner's)."""
    staging.chmod(0o600)
    inode = staging.stat().st_ino
    try:
        os.link(staging, path)
    except FileExistsError:
        _unlink(staging)
        raise DaemonRunning(f"a loopd daemon already runs at {path}") from None
    except OSError:  # a file system without hard links: as before, a rename
        staging.rename(path)
    else:
        _unlink(staging)
    return inode
