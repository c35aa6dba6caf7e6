"""What the keeper of a server knows of it that its client cannot see."""

__all__ = ["ServerHealth"]


class ServerHealth:
    """Whether a server loopd runs itself is away, and why: its keeper (loopd's watcher of the
    llama-server it started) writes it, the server's `Client` reads it, so that a request that
    cannot connect names the reason (`ConnectError.down`). A server loopd does not run has
    one that never says it is away."""

    def __init__(self) -> None:
        self._down: str | None = None

    @property
    def down(self) -> str | None:
        """Why the server is away (it exited and is being started again); None: not known to
        be."""
        return self._down

    def exited(self, why: str) -> None:
        """The server is gone for `why`, until `up`."""
        self._down = why

    def up(self) -> None:
        """The server is running again."""
        self._down = None
