"""A scripted conversation through `run_turn` on a real llama-server: a note to read, a tool
chain the model is made to write (tests/support/prefill.py), and the session reopened from its
log by a new client before each turn after the first. Shared by the real-server tests and
`just bench templates`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from loopd.config import LoopConfig, ToolsConfig
from loopd.infer import ChatFormat, Client, FormatError
from loopd.session.baseline import make_baseline
from loopd.session.records import Record
from loopd.session.store import Store
from loopd.tools import open_tool_port
from loopd.turn import Runtime, TurnError, TurnLimit, run_turn
from loopd.turn.exact import ExactHistory
from support.prefill import prefills

SYSTEM = "You are a helpful assistant. Be brief."
Prefills = Callable[[ChatFormat], Callable[[list[Record]], tuple[str, str]]]


async def conversation(
    url: str,
    home: Path,
    history: Literal["exact", "template"],
    turns: Sequence[str],
    *,
    make_prefill: Prefills | None = prefills,
    tolerate: bool = False,
) -> list[Record]:
    """The log of the conversation. `tolerate`: a template loopd cannot read gets no tool
    calls, and a failed turn is left to the figures, instead of failing the run."""
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "today.md").write_text("buy milk\n")
    store = Store(home / "sessions")
    session = None
    for user in turns:
        tools = ToolsConfig(roots=[home / "notes"])
        async with Client(url) as client, open_tool_port(tools) as port:
            exact = ExactHistory(client)
            try:
                fmt: ChatFormat | None = await exact.format(make_baseline(SYSTEM), thinking=True)
            except FormatError:
                if not tolerate:
                    raise
                fmt = None
            calls = make_prefill and fmt and fmt.tool_call and make_prefill(fmt)
            rt = Runtime(
                # Room for a prefilled call's close where each delimiter is many tokens on
                # this model (MiniMax-M3's `]<]minimax[>[` before every tag).
                loop=LoopConfig(max_tokens=64),
                inference=client,
                port=port,
                registry=port.registry,
                sampling={"temperature": 0, "seed": 1},
                exact=exact if history == "exact" else None,
                prefill=calls or None,
            )
            if session is None:
                session = await store.create(make_baseline(SYSTEM))
            else:
                session = await store.open(session.id)  # a restart: everything from the log
            try:
                await run_turn(session, rt, user, lambda _: None)
            except TurnLimit:
                pass  # a loop limit ended the turn (the model repeated its own call): logged
            except TurnError:
                if not tolerate:
                    raise
            finally:
                session.close()
    assert session is not None
    return list(store.read(session.id)[1])
