"""A real vLLM (the CPU build) serving the bundled model, for the tests and the benches.

`just test` and `just bench` name its Python and model folder in $LOOPD_VLLM_PYTHON and
$LOOPD_VLLM_MODEL (`scripts/assets.py vllm-python-path`, `vllm-model-path`). `start_vllm` runs
one OpenAI-compatible server in a session of its own, waits for `/health` within a deadline
and yields it; on the way out the whole process group is killed (vLLM is three processes: the
API server, its engine core and the CPU worker, about 3.8 GB) and waited for. Its log is a
file, named when it starts and quoted when it fails. A watchdog in the group kills the group
when the process that started it is gone, so a test run killed outright leaves no vLLM behind.

The fixture `vllm_server` (session scope, registered in tests/conftest.py) starts one for the
whole run; a test that needs other options (a chat template, more flags) calls `start_vllm`,
with `EAGER` as every test's vLLM has it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

SERVED_NAME = "SmolLM2-135M-Instruct"
"""The model's name in the server's answers (`--served-model-name`): the folder's path else."""

BLOCK_SIZE = 32
"""Tokens a KV-cache block holds: the CPU backend's attention takes multiples of 32 only, and
prefix caching reuses whole blocks (a prompt's cached tokens are a multiple of this)."""

FLAGS = (
    "--max-model-len", "4096",
    "--enable-prefix-caching",
    # usage.prompt_tokens_details.cached_tokens in every answer.
    "--enable-prompt-tokens-details",
    "--block-size", str(BLOCK_SIZE),
)  # fmt: skip
"""The options every vLLM here starts with, before a caller's own."""

ENV = {
    # GiB of KV cache (the CPU backend's default is 4).
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Nothing from outside: the model is a local folder; no usage report is sent.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""Its environment, over the caller's (a caller's own `env` wins)."""

READY_TIMEOUT = 420.0
"""Seconds until `/health` answers 200: about two minutes on two cores, more on a busy
machine."""

STOP_GRACE = 15.0
"""Seconds the group has after SIGTERM before SIGKILL."""

PORT_ATTEMPTS = 3

# Runs the server as its child; when the pipe from the process that started it closes (that
# process is gone, killed or not), it ends the whole group, itself included.
_WATCHDOG = """
import os, signal, subprocess, sys, threading, time
child = subprocess.Popen(sys.argv[1:])
for number in (signal.SIGTERM, signal.SIGINT):
    signal.signal(number, lambda n, _: child.send_signal(n))
def orphaned():
    while os.read(0, 4096):
        pass
    child.terminate()
    time.sleep(float(os.environ.get("LOOPD_VLLM_GRACE", "15")))
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=orphaned, daemon=True).start()
sys.exit(child.wait())
"""


class VllmStartError(RuntimeError):
    """vLLM exited or did not answer `/health` in time; the message quotes its log."""


@dataclass(frozen=True)
class RunningVllm:
    url: str
    """`http://127.0.0.1:PORT`, without a trailing slash (the OpenAI routes are under /v1)."""
    port: int
    model: str
    """The served model name, for the `model` field of a request."""
    log: Path
    process: subprocess.Popen[bytes] | None
    """None for one this run did not start (`LOOPD_VLLM_URL`)."""

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _asset(variable: str, relative: str, *, folder: bool = False) -> Path:
    path = Path(os.environ.get(variable) or ROOT / relative)
    if not (path.is_dir() if folder else path.is_file()):
        raise VllmStartError(
            f"{path} is missing: run `just test` (it installs vLLM with "
            f"`python scripts/assets.py ensure-vllm`), or set {variable}"
        )
    return path


def vllm_python() -> Path:
    """The Python of the venv vLLM is installed in."""
    return _asset("LOOPD_VLLM_PYTHON", ".cache/vllm/venv/bin/python")


def vllm_model() -> Path:
    """The bundled model as a Hugging Face folder (safetensors, tokenizer, chat template)."""
    return _asset("LOOPD_VLLM_MODEL", ".cache/vllm/SmolLM2-135M-Instruct", folder=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def command(
    port: int,
    *,
    chat_template: Path | None = None,
    extra_args: Sequence[str] = (),
    served_name: str = SERVED_NAME,
) -> list[str]:
    """The server's command line (the `vllm` console script does not start under vllm-cpu)."""
    args = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vllm_model()),
        "--served-model-name", served_name,
        *FLAGS,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if chat_template is not None:
        args += ["--chat-template", str(chat_template)]
    return [*args, *extra_args]


def _launch(args: list[str], log: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, *args],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **ENV, "LOOPD_VLLM_GRACE": str(STOP_GRACE), **(env or {})},
        )


def _wait_healthy(server: RunningVllm, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline:
            if server.process is not None and server.process.poll() is not None:
                raise VllmStartError(
                    f"vLLM exited with status {server.process.returncode}; its log, "
                    f"{server.log}, ends:\n{server.log_tail()}"
                )
            try:
                if http.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
    raise VllmStartError(
        f"vLLM did not answer /health within {timeout:.0f} s; its log, {server.log}, "
        f"ends:\n{server.log_tail()}"
    )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, SIGKILL to what is left after STOP_GRACE; returns when no
    process of the group is left (the worker outlives the API server otherwise)."""
    pgid = process.pid  # a session's leader: its pid is the group's id
    with suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    while _group_alive(pgid) and time.monotonic() < deadline:
        process.poll()  # reaps the watchdog, whose zombie would keep the group alive
        time.sleep(0.1)
    with suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    process.wait()
    if process.stdin is not None:
        process.stdin.close()
    deadline = time.monotonic() + STOP_GRACE
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)  # orphans killed by SIGKILL, until init has reaped them


@contextmanager
def start_vllm(
    log_dir: Path,
    *,
    chat_template: Path | None = None,
    extra_args: Sequence[str] = (),
    served_name: str = SERVED_NAME,
    env: dict[str, str] | None = None,
    ready_timeout: float = READY_TIMEOUT,
    port: int | None = None,
) -> Iterator[RunningVllm]:
    """Start vLLM on a free port of 127.0.0.1 and yield it once `/health` answers; its log is
    `log_dir/vllm-N.log`. `extra_args` come after the usual FLAGS (a later flag wins); `port`:
    that one (a server started again where the last one was), else a free one."""
    log_dir.mkdir(parents=True, exist_ok=True)
    number = len(list(log_dir.glob("vllm-*.log"))) + 1
    log = log_dir / f"vllm-{number}.log"
    fixed, attempts = port, 1 if port is not None else PORT_ATTEMPTS
    for attempt in range(1, attempts + 1):
        port = fixed or _free_port()
        args = command(
            port, chat_template=chat_template, extra_args=extra_args, served_name=served_name
        )
        print(f"vllm: starting on port {port}, log {log}", file=sys.stderr)
        process = _launch(args, log, env)
        server = RunningVllm(f"http://127.0.0.1:{port}", port, served_name, log, process)
        try:
            _wait_healthy(server, ready_timeout)
        except VllmStartError:
            stop(process)
            if attempt == attempts or "address already in use" not in server.log_tail():
                raise
            continue
        except BaseException:
            stop(process)
            raise
        break
    try:
        yield server
    finally:
        stop(process)


CHAT_TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
"""A tool-call parser for the chat endpoint, which refuses tools without one; loopd's
token-exact requests never use it."""

EAGER = ("--enforce-eager",)
"""What every vLLM of the tests adds to the FLAGS: no torch.compile. The CPU build (0.32) cannot
load the model it compiled back from its cache ("'function' object has no attribute
'finalize_loading'"), so each start compiled it again: about 60 of a start's 90 s on two idle
cores, minutes on busy ones. The tests look at tokens and cache figures, which compiling does
not change; the benches time vLLM with the FLAGS alone."""


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVllm]:
    """One vLLM for the whole run (the FLAGS, the model's own chat template, a tool-call
    parser for its chat endpoint: `CHAT_TOOLS`, and `EAGER`), started by the
    first test that asks for it and stopped at the end of the run; or the one already running
    at `$LOOPD_VLLM_URL` (started with the same FLAGS), to try a test again without waiting."""
    if url := os.environ.get("LOOPD_VLLM_URL"):  # one already running, with FLAGS
        port = int(url.rsplit(":", 1)[1])
        yield RunningVllm(url, port, SERVED_NAME, Path(os.devnull), None)
        return
    failure = None
    try:
        with start_vllm(
            tmp_path_factory.mktemp("vllm"), extra_args=(*CHAT_TOOLS, *EAGER)
        ) as server:
            yield server
    except VllmStartError as error:
        failure = str(error)
    if failure is not None:  # outside the handler: the message alone, no chained traceback
        pytest.fail(failure, pytrace=False)
