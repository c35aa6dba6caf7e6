"""What goes over loopd's socket: the messages (`proto`), the events of a turn (`events`) and
the framing of JSON lines under a cap (`lines`, read from a trio stream by `reader`). A client
imports this and `loopd.session`'s records, and nothing of the daemon.

The protocol version is here, apart from the models, for a client that reads the lines as
plain JSON (`bxctl status`)."""

__all__ = ["OLDEST_PROTOCOL", "PROTOCOL"]

PROTOCOL = 3
"""The channel protocol's version (`loopd.wire.proto`'s docstring says how it changes). 3: every
client message may carry a `ref`, which its answers carry back."""
OLDEST_PROTOCOL = 2
"""The oldest version loopd still serves: a version 2 client sends no `ref` and gets none."""
