"""The channel: a Unix socket where clients send user messages and watch turns, in JSON lines.

_socket       the socket file: private, stale ones replaced, live ones left alone
_systemd      the socket systemd passes by socket activation, when it does
_server       accepts clients (up to a cap), says goodbye when loopd stops
_connection   one client: framing, a bounded outbox, the relay of its events
_handlers     one typed handler per client message, each a message to the session actor
"""

from ._handlers import DaemonInfo
from ._server import ChannelServer
from ._socket import DaemonRunning, UnixSocket, UnsafeSocket, open_socket
from ._systemd import BadActivation, systemd_socket

__all__ = [
    "BadActivation",
    "ChannelServer",
    "DaemonInfo",
    "DaemonRunning",
    "UnixSocket",
    "UnsafeSocket",
    "open_socket",
    "systemd_socket",
]
