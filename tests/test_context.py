"""What the model sees, and how full its context is: `context` on the wire, `bxctl context`
and `/context`, against a real `loopd serve`; the parts folded from a log's records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from conftest import StartDaemon
from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply


async def bxctl(d: Daemon, *args: str, cwd: Path) -> tuple[int, str]:
    command = [sys.executable, "-m", "bxctl", "--config", str(d.config), *args]
    with trio.fail_after(60):
        done = await trio.run_process(command, capture_stdout=True, check=False, cwd=cwd)
    return done.returncode, done.stdout.decode()


async def test_context_shows_the_prompt_instructions_tools_and_tokens_by_part(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    here = tmp_path / "project"
    here.mkdir()
    (here / "AGENTS.md").write_text("Answer in French.\n")
    find = Reply(tool_calls=(("c1", "find_tool", '{"query": "read a file"}'),))
    d = await daemon(FakeLlama([find, Reply(content="Voilà.")]), tools=f'roots = ["{here}"]')
    assert (await bxctl(d, "chat", "-m", "read it", cwd=here))[0] == 0
    code, out = await bxctl(d, "context", "--json", cwd=here)
    seen = json.loads(out)
    assert (code, seen["type"]) == (0, "context")
    assert "Answer in French." in seen["system_prompt"]
    assert [f["path"] for f in seen["instructions"]] == [str(here / "AGENTS.md")]
    offered = [t["name"] for t in seen["tools"] if not t["found"]]
    assert offered == ["find_tool", "call_tool"]
    assert {"read_file", "run_command"} <= {t["name"] for t in seen["tools"] if t["found"]}
    parts = seen["parts"]
    assert min(parts["start"], parts["tool_results"], parts["answers"]) > 0
    assert sum(parts.values()) == seen["tokens"]  # the parts add up to what the slot holds
    assert seen["exact"] is False  # history went as messages: the template decides
    code, out = await bxctl(d, "status", cwd=here)
    assert f"context  {seen['tokens']} " in out  # the same count as status's
    code, out = await bxctl(d, "context", cwd=here)
    assert "tools offered to the model: find_tool, call_tool" in out
    assert f"instructions from {here / 'AGENTS.md'}" in out
    assert "tool results" in out
    assert "not exact" in out
