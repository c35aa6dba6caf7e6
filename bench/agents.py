"""Figure 14: sub-agents at once. Four independent tasks given to four sub-agents in one round
of `delegate` calls (they run side by side, a slot each), against the same four tasks given one
after another, on the same llama-server (five slots, SmolLM2-135M, two threads).

Both sides go through the same machinery (the turn's calls, the sub-agents, the slot pool,
the real server); only what runs at once differs. The delegating calls are made directly, not
by a model: the figure is the sub-agents'. Every answer runs to MAX_TOKENS (`ignore_eos`, and a
grammar of plain text so no answer is read as a call). Rounds alternate which side goes first.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from loopd.actors import Agents, PoolHandle, SlotFiles, pool_actor
from loopd.actors._agents import AGENTS
from loopd.config import AgentsConfig, LoopConfig, ToolsConfig
from loopd.infer import Client, Slot, ToolCall
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.baseline import SUB_AGENT_NOTE, make_baseline
from loopd.session.records import Record, UsageRecord
from loopd.session.store import Store
from loopd.tools import PortHandle, delegate_entry, open_tool_port
from loopd.turn import Runtime
from loopd.turn.calls import ToolCalls

TASKS = 4
ROUNDS = 4
MAX_TOKENS = 64
SYSTEM = "You are a helpful assistant. Be brief."
PLAIN = "root ::= [A-Za-z ,.]*"


def _plain(_: list[Record]) -> tuple[str, str]:
    return "", PLAIN


async def _round(  # noqa: PLR0913 - the parts of the machinery, and the round's own
    agents: Agents, pool: PoolHandle, port: PortHandle, store: Store, tag: str, *, together: bool
) -> tuple[float, int]:
    """The four tasks from one session: wall time, and the tokens the sub-agents generated."""
    parent = await store.create(make_baseline(SYSTEM))
    calls = [
        ToolCall(
            id=f"d{n}",
            name="call_tool",
            arguments=json.dumps(
                {"name": "delegate", "arguments": {"task": f"{tag}, task {n}: tell a story."}}
            ),
        )
        for n in range(TASKS)
    ]
    loop = LoopConfig(max_tokens=MAX_TOKENS)
    async with pool.lease(parent.id) as lease:
        assert lease is not None  # noqa: S101 - a waiting lease always comes
        runtime = Runtime(
            loop=loop,
            inference=lease.slot,
            slot=lease.slot.number,
            port=port,
            registry=port.registry,
            sampling={"temperature": 0, "ignore_eos": True},
            prefill=_plain,
        )
        delegate = agents.for_turn(parent, runtime)
        turn = ToolCalls(parent, loop, port, port.registry, 5, lambda _: None, delegate)
        start = time.perf_counter()
        if together:
            await turn.answer_round(calls)
        else:
            for call in calls:
                await turn.answer_round([call])
        wall = time.perf_counter() - start
    parent.close()
    tokens = 0
    for info in await store.sessions():
        if info.parent == parent.id:
            records = store.read(info.id)[1]
            tokens += sum(
                r.timings.predicted_n for r in records if isinstance(r, UsageRecord) and r.timings
            )
    return wall, tokens


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=2048, parallel=TASKS + 1, threads=2)
    at_once: list[tuple[float, int]] = []
    in_turn: list[tuple[float, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "sessions")
        files = SlotFiles("never", Path(tmp) / "notes", None, 1 << 30)
        config = AgentsConfig(at_once=TASKS, per_turn=TASKS)
        async with (
            managed_server(spec, Path(tmp) / "llama.log") as server,
            Client(server.url) as client,
            open_tool_port(ToolsConfig()) as port,
            trio.open_nursery() as nursery,
        ):
            slots = [Slot(client, n) for n in range(TASKS + 1)]
            pool = await nursery.start(pool_actor, slots, files)
            port.registry.set_source(AGENTS, [delegate_entry(ToolsConfig(), AGENTS)])
            baseline = partial(make_baseline, f"{SYSTEM}\n\n{SUB_AGENT_NOTE}")
            agents = Agents(
                config, at_once=TASKS, store=store, pool=pool, files=files, baseline=baseline
            )
            run = partial(_round, agents, pool, port, store)
            await run("warm up", together=True)  # the sub-agents' system prompt, every slot
            for r in range(ROUNDS):
                if r % 2:
                    in_turn.append(await run(f"r{r} one by one", together=False))
                    at_once.append(await run(f"r{r} at once", together=True))
                else:
                    at_once.append(await run(f"r{r} at once", together=True))
                    in_turn.append(await run(f"r{r} one by one", together=False))
            nursery.cancel_scope.cancel()
    wall_together = statistics.median(w for w, _ in at_once)
    wall_apart = statistics.median(w for w, _ in in_turn)
    return {
        "tasks": TASKS,
        "rounds": ROUNDS,
        "max_tokens": MAX_TOKENS,
        "at_once_s": wall_together,
        "one_by_one_s": wall_apart,
        "wall_ratio": wall_together / wall_apart,
        "at_once_tokens_per_s": statistics.median(t / w for w, t in at_once),
        "one_by_one_tokens_per_s": statistics.median(t / w for w, t in in_turn),
    }


def table(f: dict[str, Any]) -> list[str]:
    rate = f["at_once_tokens_per_s"] / f["one_by_one_tokens_per_s"]
    together = f"{f['at_once_s']:.2f} s | {f['at_once_tokens_per_s']:.1f}"
    apart = f"{f['one_by_one_s']:.2f} s | {f['one_by_one_tokens_per_s']:.1f}"
    return [
        "| | wall time | tokens/s (all sub-agents) |",
        "| --- | --- | --- |",
        f"| {f['tasks']} sub-agents at once | {together} |",
        f"| the same {f['tasks']} tasks one after another | {apart} |",
        f"| ratio (at once / one after another) | {f['wall_ratio']:.2f} | {rate:.2f} |",
    ]
