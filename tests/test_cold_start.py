"""The README's script lines as a new user runs them: `.venv/bin/bxctl` straight after the
set-up, in a fresh home with no config, no variables and no loopd running; and every hint bxctl
prints works as printed. Real processes: the venv's bxctl starts the venv's loopd, which starts
the bundled llama-server the set-up named (`loopd.bundled`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from loopd.bundled import bundled

ROOT = Path(__file__).resolve().parent.parent
BXCTL = ROOT / ".venv" / "bin" / "bxctl"
# What a new user's shell has: none of the variables that name a server, model or config.
UNSET = ("LOOPD_LLAMA_SERVER", "LOOPD_MODEL", "LOOPD_CONFIG", "LLAMA_ARG_TEMPERATURE")


@pytest.fixture
def fresh_home() -> Iterator[dict[str, str]]:
    """A new user's environment: a home of its own (short: a socket path has 108 bytes at
    most), no XDG folders, no loopd variables; whatever loopd it started is stopped after."""
    home = Path(tempfile.mkdtemp(prefix="cold-"))
    env = {k: v for k, v in os.environ.items() if k not in UNSET and not k.startswith("XDG_")}
    env["HOME"] = str(home)
    try:
        yield env
    finally:
        pid_file = home / ".local" / "state" / "loopd" / "loopd.pid"
        if pid_file.is_file():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)


async def run(
    command: list[str], env: dict[str, str], stdin: bytes | None = None
) -> tuple[int, str, str]:
    with trio.fail_after(120):
        done = await trio.run_process(
            command,
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=env["HOME"],
            env=env,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.llama
async def test_the_readmes_script_lines_work_from_a_cold_start(
    fresh_home: dict[str, str],
) -> None:
    assert bundled() is not None, "the set-up names the bundled server and model"
    code, out, err = await run([str(BXCTL), "chat", "-m", "hi", "--json"], fresh_home)
    assert code == 0, err
    assert "starting loopd" in err
    last = json.loads(out.splitlines()[-1])
    assert last["type"] == "turn_done"
    code, out, err = await run([str(BXCTL), "chat"], fresh_home, stdin=b"hello\n")
    assert code == 0, err
    assert out.strip()
    code, out, _ = await run([str(BXCTL), "stop"], fresh_home)
    assert (code, out.strip()) == (0, "loopd stopped")


@pytest.mark.llama
async def test_the_hint_of_no_start_starts_loopd_as_printed(fresh_home: dict[str, str]) -> None:
    code, _, err = await run([str(BXCTL), "chat", "--no-start", "-m", "hi"], fresh_home)
    assert code == 5
    (hint,) = re.findall(r"start it with `([^`]+)`", err)
    serving = await trio.lowlevel.open_process(
        shlex.split(hint), cwd=fresh_home["HOME"], env=fresh_home
    )
    try:
        with trio.fail_after(120):
            code, out, err = await run([str(BXCTL), "chat", "--no-start", "-m", "hi"], fresh_home)
            while code == 5 and serving.poll() is None:  # its socket comes once it serves
                await trio.sleep(0.2)
                code, out, err = await run(
                    [str(BXCTL), "chat", "--no-start", "-m", "hi"], fresh_home
                )
        assert code == 0, err
        assert out.strip()
    finally:
        serving.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await serving.wait() == 0
