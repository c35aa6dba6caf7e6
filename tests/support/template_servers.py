"""One llama-server per chat template, shared by every test that reads only what the template
renders, and the format loopd learns from each template, learned once per run.

The every-template tests (`test_grammar_real`'s trigger, `test_rendered_calls_real`,
`test_llama_cases`) ask a server only to render (`/apply-template`, `/props`): nothing they
send changes what it answers next, so one server serves them all. The conftest runs the
tests of one template one after another (`group_by_template`), so a single server is kept at a
time and the next template's stops it.

pytest-trio runs each test in a trio run of its own, and a session's fixture outlives them:
the servers are plain child processes (under the same watchdog as loopd's own, so a test run
killed outright leaves none behind), started in a worker thread and stopped at the session's
end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trio

from loopd.infer import ChatFormat, Client, FormatError
from loopd.server_proc import _WATCHDOG, LaunchSpec, free_port
from loopd.session.baseline import make_baseline
from loopd.turn.exact import ExactHistory

SYSTEM = "Be brief."
"""The system prompt every format here is learned with."""

N_CTX = 1024
"""Tokens of context: these servers render and never generate, so a small cache will do."""

READY_TIMEOUT = 60.0
PORT_ATTEMPTS = 3
STOP_GRACE = 5.0


@dataclass
class _Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class TemplateServers:
    """Servers by template file, `kept` of them running at once (the least recently used is
    stopped first), and learned formats by template and thinking."""

    binary: Path
    model: Path
    folder: Path
    kept: int = 1
    _running: dict[Path, _Server] = field(default_factory=dict)
    _formats: dict[tuple[Path, bool], ChatFormat | FormatError] = field(default_factory=dict)
    started: int = 0

    async def url(self, template: Path) -> str:
        """The URL of a llama-server running `template`, started if none is."""
        server = self._running.pop(template, None)
        if server is None or server.process.poll() is not None:
            while len(self._running) >= self.kept:
                _stop(self._running.pop(next(iter(self._running))).process)
            server = await trio.to_thread.run_sync(self._start, template)
        self._running[template] = server  # the most recently used last
        return server.url

    async def format(self, template: Path, *, thinking: bool) -> ChatFormat:
        """The format loopd learns from `template` (with `SYSTEM`), as `ExactHistory.format`
        gives it: a `FormatError` where the template cannot be made exact."""
        key = (template, thinking)
        if key not in self._formats:
            async with Client(await self.url(template)) as client:
                try:
                    learned: ChatFormat | FormatError = await ExactHistory(client).format(
                        make_baseline(SYSTEM), thinking=thinking
                    )
                except FormatError as e:
                    learned = e
            self._formats[key] = learned
        known = self._formats[key]
        if isinstance(known, FormatError):
            raise FormatError(str(known))
        return known

    def close(self) -> None:
        while self._running:
            _stop(self._running.popitem()[1].process)

    def _start(self, template: Path) -> _Server:
        spec = LaunchSpec(
            binary=self.binary,
            model=self.model,
            n_ctx=N_CTX,
            threads=2,
            chat_template_file=template,
        )
        for _ in range(PORT_ATTEMPTS):  # a port found free can still be taken before the bind
            self.started += 1
            port = free_port(spec.host)
            log_path = self.folder / f"llama-server-{self.started}-{template.stem}.log"
            with log_path.open("wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-c", _WATCHDOG, *spec.command(port)],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            server = _Server(f"http://{spec.host}:{port}", process, log_path)
            if _healthy(server):
                return server
            _stop(process)
            if "bind" not in server.log_tail():
                break
        pytest.fail(f"llama-server did not start:\n{server.log_tail()}", pytrace=False)


def _healthy(server: _Server) -> bool:
    """Whether `/health` says ok before the server exits or the deadline passes."""
    deadline = time.monotonic() + READY_TIMEOUT
    with httpx.Client(timeout=2.0) as http:
        while server.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                if http.get(f"{server.url}/health").status_code == 200:
                    return True
            time.sleep(0.05)
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the watchdog's group, SIGKILL after a grace period."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if process.stdin is not None:
        process.stdin.close()


def template_key(template: object) -> str:
    """A test's `template` parameter as the template's name (with or without `.jinja`, or a
    path)."""
    name = template.name if isinstance(template, Path) else str(template)
    return name.removesuffix(".jinja")
