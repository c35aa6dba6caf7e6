"""A real `loopd serve` process for the tests, and a raw line client for its socket."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio


@dataclass
class Daemon:
    """`loopd serve` as a child process, with its own config, store and socket."""

    home: Path
    server_url: str
    channel: str = ""
    """More lines of the [channel] table."""
    history: str = "template"
    """`[session] history`: recordings and scripted servers answer the chat endpoint only."""
    session: str = ""
    """More lines of the [session] table."""
    slots: str = ""
    """Lines of the [slots] table (`save = "never"` for a scripted server, which keeps no
    slot files)."""
    env: dict[str, str] | None = None
    """loopd's environment (None: the test's own)."""
    wrap: tuple[str, ...] = ()
    """A command `serve` runs under, given loopd's own as its last arguments (`unshare ...`)."""
    pass_fds: tuple[int, ...] = ()
    """The test's fds that `serve` (or `wrap`) is given."""
    process: trio.Process | None = None
    log: Path = field(init=False)
    clients: list[LineClient] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.log = self.home / "loopd.log"
        (self.home / "loopd.toml").write_text(
            f'[server]\nurl = "{self.server_url}"\n[server.retry]\nattempts = 2\nbase = 0.05\n'
            f'[store]\ndirectory = "{self.home / "sessions"}"\n'
            f'[session]\nhistory = "{self.history}"\n{self.session}'
            f"[slots]\n{self.slots}\n"
            f'[channel]\nsocket = "{self.socket}"\n{self.channel}'
        )

    @property
    def socket(self) -> Path:
        return self.home / "run" / "loopd.sock"

    @property
    def config(self) -> Path:
        return self.home / "loopd.toml"

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "loopd", *args, "--config", str(self.config)]

    async def start(self, *args: str) -> None:
        with self.log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [*self.wrap, *self.command("serve", *args)],
                stdout=log,
                stderr=log,
                env=self.env,
                pass_fds=self.pass_fds,
            )
        with trio.fail_after(30):
            while not await self._answers():
                if self.process.poll() is not None:
                    raise RuntimeError(f"loopd exited: {self.log.read_text()}")
                await trio.sleep(0.05)

    async def _answers(self) -> bool:
        """A daemon accepts connections on the socket (a stale socket file does not count)."""
        try:
            stream = await trio.open_unix_socket(str(self.socket))
        except OSError:
            return False
        await stream.aclose()
        return True

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        with trio.fail_after(30):
            return await self.process.wait()

    async def connect(self) -> LineClient:
        client = await LineClient.connect(self.socket)
        self.clients.append(client)
        return client

    async def close_clients(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            await self.process.wait()

    async def end(self) -> None:
        """Kill loopd (it says nothing to anyone) and close the test's connections to it."""
        await self.kill()
        await self.close_clients()


ACTIVATE = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); "
    "os.environ.setdefault('LISTEN_PID', str(os.getpid())); os.execv(sys.argv[2], sys.argv[2:])"
)
"""`python -c ACTIVATE FD COMMAND...`: run COMMAND as systemd's socket activation starts a
service: FD as its fd 3, `LISTEN_PID` its own pid unless set."""


def by_systemd(d: Daemon, fd: int, *, count: str = "1", pid: str | None = None) -> None:
    """Have `d` started as systemd starts a socket-activated service: `fd` as its fd 3,
    `LISTEN_FDS=count`, `LISTEN_PID` its own pid (or `pid`)."""
    d.wrap = (sys.executable, "-c", ACTIVATE, str(fd))
    d.pass_fds = (fd,)
    d.env = {**os.environ, "LISTEN_FDS": count} | ({"LISTEN_PID": pid} if pid else {})


def loopds_of(config: Path) -> list[int]:
    """The pids of the live `loopd serve` processes on this config file (a zombie has no
    command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(config).encode() in argv:
            pids.append(int(entry.name))
    return pids


async def stop_started(d: Daemon) -> None:
    """Stop the loopd a `bxctl` started for `d`'s config: the one its pid file names (and any
    other on the config, which a failed test may leave)."""
    pid_file = d.home / "loopd.pid"
    pids = set(loopds_of(d.config))
    if pid_file.exists():
        pids.add(int(pid_file.read_text()))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


async def embedded(home: Path) -> Daemon:
    """A started `loopd serve` with no `[server] url`: it runs the bundled llama-server
    itself, with exact history and short answers."""
    d = Daemon(home, "", history="exact")
    text = d.config.read_text().replace('url = ""\n', "")
    d.config.write_text(text + "[loop]\nmax_tokens = 16\n")
    await d.start()
    return d


class LineClient:
    """A raw client: JSON lines in and out, nothing else."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    @classmethod
    async def connect(cls, path: Path) -> LineClient:
        return cls(await trio.open_unix_socket(str(path)))

    async def send(self, message: dict[str, Any] | str | bytes) -> None:
        if isinstance(message, dict):
            message = json.dumps(message)
        data = message.encode() if isinstance(message, str) else message
        await self.stream.send_all(data if data.endswith(b"\n") else data + b"\n")

    async def receive(self) -> dict[str, Any] | None:
        """The next line, or None when the daemon closed the connection."""
        while b"\n" not in self.buffer:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buffer += data
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        parsed: dict[str, Any] = json.loads(line)
        return parsed

    async def until(self, kind: str, timeout: float = 30) -> list[dict[str, Any]]:
        """Lines up to and including the first of `kind`."""
        got = []
        with trio.fail_after(timeout):
            while (line := await self.receive()) is not None:
                got.append(line)
                if line["type"] == kind:
                    return got
        raise AssertionError(f"closed before a {kind!r} line; got {got}")

    async def turn(self, turn_id: str, content: str, timeout: float = 60) -> list[dict[str, Any]]:
        await self.send({"type": "send", "id": turn_id, "content": content})
        got = []
        with trio.fail_after(timeout):
            while (line := await self.receive()) is not None:
                got.append(line)
                if line["type"] in ("turn_done", "turn_failed") and line["id"] == turn_id:
                    return got
        raise AssertionError(f"closed before the turn ended; got {got}")

    async def aclose(self) -> None:
        await self.stream.aclose()
