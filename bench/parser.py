"""`just bench parser`: loopd's parser against llama.cpp's own, and what it costs.

Agreement: every case of llama.cpp's `tests/test-chat.cpp` (as `scripts/assets.py
chat-cases-path` writes them out) read by loopd's parser with the format learned from a real
llama-server on the case's template, streamed three characters at a time and whole, as
tests/test_llama_cases.py reads them; per template, the cases compared, those that agree, and
those skipped as testing what loopd does not have.

Cost: the same compared inputs fed in three-character pieces through the parser, against
appending the same pieces to a string (the least any streaming reader does), per piece.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loopd.infer import ChatFormat, Client, FormatError
from loopd.infer._raw import parser_for
from loopd.infer._schema import ArgumentTypes
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.baseline import make_baseline
from loopd.turn.exact import ExactHistory
from support.llama_cases import Case, load_cases, parse

PIECE = 3
ROUNDS = 20


async def _formats(
    server: Path, model: Path, template: Path, cases: list[Case], log: Path
) -> dict[bool, ChatFormat | FormatError]:
    spec = LaunchSpec(
        binary=server,
        model=model,
        n_ctx=4096,
        threads=2,
        port=None,
        slot_save_path=log.parent,
        chat_template_file=template,
    )
    formats: dict[bool, ChatFormat | FormatError] = {}
    async with managed_server(spec, log) as running, Client(running.url) as client:
        exact = ExactHistory(client)
        for thinking in sorted({c.thinking for c in cases}):
            try:
                formats[thinking] = await exact.format(
                    make_baseline("Be brief."), thinking=thinking
                )
            except FormatError as e:
                formats[thinking] = e
    return formats


def _agrees(fmt: ChatFormat, case: Case) -> bool:
    return all(parse(fmt, case, piece) == case.expect for piece in (PIECE, 0))


def _cost(work: list[tuple[ChatFormat, Case]]) -> dict[str, float]:
    """Microseconds per piece: parsing, and string concatenation of the same pieces."""
    pieces = [[c.input[i : i + PIECE] for i in range(0, len(c.input), PIECE)] for _, c in work]
    count = sum(map(len, pieces)) * ROUNDS
    started = time.perf_counter()
    for _ in range(ROUNDS):
        for (fmt, case), split in zip(work, pieces, strict=True):
            parser = parser_for(fmt, ArgumentTypes(case.raw["tools"]), tokens=False)
            for piece in split:
                parser.feed(piece)
            parser.finish()
    parsing = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(ROUNDS):
        for split in pieces:
            text = ""
            for piece in split:
                text += piece
    joining = time.perf_counter() - started
    return {
        "pieces": count / ROUNDS,
        "parse_us": parsing / count * 1e6,
        "join_us": joining / count * 1e6,
        "ratio": parsing / joining,
    }


async def measure(server: Path, model: Path, templates: Path, cases_file: Path) -> dict[str, Any]:
    rows, work, skipped = [], [], Counter[str]()
    log = Path(tempfile.mkdtemp(prefix="loopd-bench-parser-")) / "llama-server.log"
    for template, cases in sorted(load_cases(cases_file).items()):
        compared = [c for c in cases if c.skip_reason() is None]
        skipped.update(r for c in cases if (r := c.skip_reason()))
        if not compared:
            continue
        formats = await _formats(server, model, templates / template, compared, log)
        agree = messages = 0
        for case in compared:
            fmt = formats[case.thinking]
            if isinstance(fmt, FormatError):
                messages += 1  # llama-server's own parser reads these
                continue
            work.append((fmt, case))
            agree += _agrees(fmt, case)
        rows.append(
            {
                "template": template.removesuffix(".jinja"),
                "compared": len(compared),
                "agree": agree,
                "as_messages": messages,
                "skipped": len(cases) - len(compared),
            }
        )
    return {"rows": rows, "skipped": dict(skipped), "cost": _cost(work)}


def table(f: dict[str, Any]) -> list[str]:
    rows = f["rows"]
    compared = sum(r["compared"] for r in rows)
    agree = sum(r["agree"] for r in rows)
    cost = f["cost"]
    skipped = ", ".join(f"{why} ({n})" for why, n in sorted(f["skipped"].items()))
    lines = [
        (
            f"{agree} of {compared} compared cases agree ({agree / compared:.1%}) on "
            f"{len(rows)} templates; skipped: {skipped}."
        ),
        "",
        (
            f"Cost, over {cost['pieces']:.0f} pieces of {PIECE} characters: "
            f"{cost['parse_us']:.1f} us a piece through the parser against "
            f"{cost['join_us']:.2f} us appending it to a string ({cost['ratio']:.0f}x)."
        ),
        "",
        "| template | compared | agree | as messages | skipped |",
        "| --- | --- | --- | --- | --- |",
    ]
    columns = ("template", "compared", "agree", "as_messages", "skipped")
    lines.extend("| " + " | ".join(str(r[k]) for k in columns) + " |" for r in rows)
    return lines
