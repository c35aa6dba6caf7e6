"""Sub-agents on a real llama-server of four slots (SmolLM2): the parent is led into two
`delegate` calls (`Runtime.prefill`), each child answers on a slot of its own, and every
request of each session extends that session's cache exactly: llama-server's own figures."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import trio

from conftest import QWEN_TEMPLATE, StartLlama
from loopd.actors import Agents, SlotFiles, pool_actor
from loopd.actors._agents import AGENTS
from loopd.config import AgentsConfig, LoopConfig, ToolsConfig
from loopd.infer import CALL_ID, ChatFormat, Client, Slot, slot_tokens
from loopd.session.baseline import SUB_AGENT_NOTE, make_baseline
from loopd.session.records import (
    CacheLossRecord,
    Record,
    ToolResultRecord,
    UsageRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.tools import delegate_entry, open_tool_port
from loopd.turn import Runtime, run_turn
from loopd.turn.exact import ExactHistory
from support.prefill import QUOTE_BRACE, gbnf

pytestmark = pytest.mark.llama

SYSTEM = "You are a helpful assistant. Be brief."
TASKS = ("Name a colour.", "Name a fruit.")
PLAIN = "root ::= [A-Za-z ,.]{1,80}"
"""A child's answer: text, never a call."""


def delegating(fmt: ChatFormat) -> Callable[[list[Record]], tuple[str, str]]:
    """The parent: a `delegate` call for each task in turn, then its own answer; a child: a
    plain answer to its task."""
    call = fmt.tool_call
    assert call is not None
    end = (call.close + call.block_close).replace(CALL_ID, "call00001")
    close_thinking = f"{fmt.think[1]}\n\n" if fmt.think and fmt.thinking_open else ""

    def prefill(records: list[Record]) -> tuple[str, str]:
        first = next(r for r in records if isinstance(r, UserRecord))
        if first.content in TASKS:
            return "", PLAIN
        done = sum(isinstance(r, ToolResultRecord) for r in records)
        if done == len(TASKS):
            return "", ""
        head = call.open + "call_tool" + call.mid + '{"name": "delegate", "arguments": {"task": "'
        rest = gbnf(TASKS[done] + QUOTE_BRACE + "}" + end)
        return close_thinking + head, f"root ::= {rest}"

    return prefill


def assert_exact(records: list[Record]) -> None:
    """Every request found all the slot held after the request before it."""
    assert conversation_problems(records) == []
    assert not [r for r in records if isinstance(r, CacheLossRecord)]
    usages = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    for before, after in itertools.pairwise(usages):
        assert after.cache_n == slot_tokens(before)


async def test_a_parent_delegates_two_tasks_and_every_session_extends_its_own_cache(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama(n_ctx=4096, template=QWEN_TEMPLATE, parallel=4)
    store = Store(tmp_path / "sessions")
    files = SlotFiles("never", tmp_path / "notes", None, 1 << 30)
    async with (
        Client(server.url) as client,
        open_tool_port(ToolsConfig()) as port,
        trio.open_nursery() as nursery,
    ):
        pool = await nursery.start(pool_actor, [Slot(client, n) for n in range(4)], files)
        port.registry.set_source(AGENTS, [delegate_entry(ToolsConfig(), AGENTS)])
        exact = ExactHistory(client)
        fmt = await exact.format(make_baseline(SYSTEM), thinking=True)
        agents = Agents(
            AgentsConfig(),
            at_once=3,
            store=store,
            pool=pool,
            files=files,
            baseline=partial(make_baseline, f"{SYSTEM}\n\n{SUB_AGENT_NOTE}"),
        )
        parent = await store.create(make_baseline(SYSTEM))
        async with pool.lease(parent.id) as lease:
            assert lease is not None
            runtime = Runtime(
                loop=LoopConfig(max_tokens=48),
                inference=lease.slot,
                slot=lease.slot.number,
                port=port,
                registry=port.registry,
                sampling={"temperature": 0, "seed": 1},
                exact=exact,
                prefill=delegating(fmt),
            )
            runtime = replace(runtime, delegate=agents.for_turn(parent, runtime))
            await run_turn(parent, runtime, "Two small questions for helpers.", lambda _: None)
        nursery.cancel_scope.cancel()
    log = list(store.read(parent.id)[1])
    results = [r.content for r in log if isinstance(r, ToolResultRecord)]
    children = [i.id for i in await store.sessions() if i.parent == parent.id]
    assert len(children) == len(results) == 2
    for child, result in zip(children, results, strict=True):
        assert result.startswith(f"The sub-agent in session {child} answered:\n\n")
        child_log = list(store.read(child)[1])
        assert len([r for r in child_log if isinstance(r, UsageRecord)]) == 1
        assert_exact(child_log)
    assert len([r for r in log if isinstance(r, UsageRecord)]) == 3
    assert_exact(log)
