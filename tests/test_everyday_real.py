"""The prefix property over a conversation that uses every tool this series added, on a real
llama-server (SmolLM2-135M, Qwen 2.5's template): `update_plan`, `find_files`, a skill,
`fetch_url` against a local page, with a `post_tool_use` hook adding to each result and a
`user_prompt_submit` hook to each message; the session reopened from its log before each turn.
Every request finds in the cache all the slot held: 0 tokens recomputed, and no cache loss.

SmolLM2 calls no tools on its own: each call is written into the answer's start
(`Runtime.prefill`), only its close left to the model under a grammar, as in
tests/test_exact_real.py.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from conftest import QWEN_TEMPLATE, StartLlama
from loopd.config import FetchConfig, HooksConfig, LoopConfig, ToolsConfig
from loopd.hooks import Hooks
from loopd.infer import CALL_ID, ChatFormat, Client, slot_tokens
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    CacheLossRecord,
    HookRecord,
    PlanRecord,
    Record,
    ToolResultRecord,
    UsageRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.tools import Roots, SkillReader, given_tools, open_tool_port
from loopd.turn import Runtime, TurnLimit, run_turn
from loopd.turn.exact import ExactHistory
from support.prefill import gbnf

pytestmark = pytest.mark.llama

SYSTEM = "You are a helpful assistant. Be brief."
SKILL = (
    "---\nname: shopping\ndescription: Plan a shopping trip from a list.\n---\nGroup by aisle.\n"
)
PAGE = b"<html><body><h1>Prices</h1><p>Milk costs <b>1 euro</b>.</p></body></html>"


def calls(port: int) -> list[tuple[str, dict[str, object]]]:
    """The calls of the first turn, in order: each new tool once."""
    return [
        ("find_tool", {"query": "plan steps"}),
        ("update_plan", {"plan": [{"step": "read the list", "status": "in_progress"}]}),
        ("find_files", {"pattern": "*.md"}),
        ("skills.shopping", {}),
        ("fetch_url", {"url": f"http://127.0.0.1:{port}/prices"}),
    ]


def prefill_of(fmt: ChatFormat, script: list[tuple[str, dict[str, object]]]) -> Callable[
    [list[Record]], tuple[str, str]
]:  # fmt: skip
    """After the n-th result of the first turn, the n-th call written out whole but for its
    close, which the grammar leaves to the model; past the script, the model's own words."""
    call = fmt.tool_call
    assert call is not None
    close = (call.close + call.block_close).replace(CALL_ID, "call00001")

    def prefill(records: list[Record]) -> tuple[str, str]:
        users = sum(isinstance(r, UserRecord) for r in records)
        done = sum(isinstance(r, ToolResultRecord) for r in records)
        if users != 1 or done >= len(script):
            return "", ""
        name, arguments = script[done]
        if name == "find_tool":
            body = json.dumps(arguments)
        else:
            body = json.dumps({"name": name, "arguments": arguments})
            name = "call_tool"
        opening = call.open + name + call.mid + body[:-1]
        return opening.replace(CALL_ID, "call00001"), f"root ::= {gbnf(body[-1] + close)}"

    return prefill


async def serve_page(
    nursery: trio.Nursery,
) -> int:
    """A local web page (the only network here); its port."""

    async def answer(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
        await stream.send_all(head % len(PAGE) + b"Connection: close\r\n\r\n" + PAGE)
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, answer, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


def hook(home: Path, name: str, said: str) -> list[str]:
    script = home / f"{name}.py"
    script.write_text(f"import sys\nsys.stdin.read()\nprint({said!r})\n")
    return [sys.executable, str(script)]


async def test_every_new_tool_keeps_the_whole_cache(
    llama: StartLlama, tmp_path: Path, nursery: trio.Nursery
) -> None:
    server = await llama(n_ctx=8192, template=QWEN_TEMPLATE)
    port = await serve_page(nursery)
    notes = tmp_path / "notes"
    (notes / ".loopd" / "skills" / "shopping").mkdir(parents=True)
    (notes / ".loopd" / "skills" / "shopping" / "SKILL.md").write_text(SKILL)
    (notes / "list.md").write_text("milk\nbread\n")
    tools = ToolsConfig(roots=[notes], fetch=FetchConfig(allow=["127.0.0.1"]))
    hooks = HooksConfig.model_validate(
        {
            "post_tool_use": [{"command": hook(tmp_path, "post", "(checked by a hook)")}],
            "user_prompt_submit": [{"command": hook(tmp_path, "prompt", "(it is Monday)")}],
        }
    )
    store = Store(tmp_path / "sessions")
    session = None
    for user in ("Plan my shopping.", "Thanks. What next?"):
        async with (
            Client(server.url) as client,
            open_tool_port(tools) as shared,
            given_tools(
                shared,
                tools,
                [],
                notes,
                skills=SkillReader(Roots([notes]), tmp_path / "no-user-skills", Roots([])),
            ) as (port_of_session, _),
        ):
            exact = ExactHistory(client)
            fmt = await exact.format(make_baseline(SYSTEM), thinking=True)
            rt = Runtime(
                loop=LoopConfig(max_tokens=32),
                inference=client,
                port=port_of_session,
                registry=port_of_session.registry,
                sampling={"temperature": 0, "seed": 1},
                exact=exact,
                prefill=prefill_of(fmt, calls(port)),
                hooks=Hooks(hooks),
            )
            if session is None:
                session = await store.create(make_baseline(SYSTEM), cwd=notes)
            else:
                session = await store.open(session.id)  # a restart: all from the log
            try:
                await run_turn(session, rt, user, lambda _: None)
            except TurnLimit:
                pass  # the model repeated its own call: logged, and the cache figures stand
            finally:
                session.close()
    assert session is not None
    records = list(store.read(session.id)[1])
    results = [r for r in records if isinstance(r, ToolResultRecord)]
    assert [r.name for r in results][:5] == ["find_tool", *["call_tool"] * 4]
    assert "update_plan" in results[0].content
    assert "Plan updated." in results[1].content
    assert "list.md" in results[2].content
    assert "Group by aisle." in results[3].content
    assert "1 euro" in results[4].content
    assert all("(checked by a hook)" in r.content for r in results)
    assert any(isinstance(r, PlanRecord) for r in records)
    assert sum(isinstance(r, HookRecord) for r in records) >= len(results) + 2
    usages = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    assert len(usages) >= 6
    for previous, new in itertools.pairwise(usages):
        assert new.cache_n == slot_tokens(previous)  # 0 tokens recomputed
    assert not [r for r in records if isinstance(r, CacheLossRecord)]
    assert conversation_problems(records) == []
