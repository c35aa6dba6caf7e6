"""A command's output while it runs (`tool_output` events): in batches, in order, whole
characters, bounded; sandboxed by bubblewrap or not. The model's result is made as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopd.tools import Sandbox
from loopd.tools._live import CUT_NOTE, LIVE_BYTES
from loopd.tools._run import run_command

SLOW = "for i in 1 2 3 4; do echo line $i; sleep 0.4; done"


@pytest.fixture(params=[True, False], ids=["bubblewrap", "unsandboxed"])
def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> Sandbox:
    return Sandbox([tmp_path], enabled=request.param)


async def test_a_slow_commands_lines_come_while_it_runs(sandbox: Sandbox, tmp_path: Path) -> None:
    chunks: list[str] = []
    status, output = await run_command(sandbox, SLOW, tmp_path, 30, chunks.append)
    assert (status, output) == (0, "line 1\nline 2\nline 3\nline 4\n")
    assert len(chunks) >= 3  # the sleeps part them
    assert "".join(chunks) == output


async def test_a_flood_sends_the_cap_and_one_note(sandbox: Sandbox, tmp_path: Path) -> None:
    chunks: list[str] = []
    flood = "head -c 5000000 /dev/zero | tr '\\0' x; echo; echo end"
    status, output = await run_command(sandbox, flood, tmp_path, 30, chunks.append)
    sent = "".join(chunks)
    assert sent == "x" * LIVE_BYTES + CUT_NOTE
    assert status == 0
    assert output.endswith("x\nend\n")  # the result keeps its head and tail as before


async def test_a_character_split_between_writes_arrives_whole(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    chunks: list[str] = []
    split = "printf 'caf\\303'; sleep 0.5; printf '\\251 ok\\n'"
    status, output = await run_command(sandbox, split, tmp_path, 30, chunks.append)
    assert (status, output) == (0, "café ok\n")
    assert "".join(chunks) == "café ok\n"
    assert len(chunks) >= 2  # "caf" came before the sleep


async def test_a_command_cut_at_its_timeout_sends_what_it_printed(tmp_path: Path) -> None:
    chunks: list[str] = []
    status, _ = await run_command(
        Sandbox([tmp_path]), "echo hi; sleep 30", tmp_path, 1, chunks.append
    )
    assert status is None
    assert "".join(chunks) == "hi\n"
