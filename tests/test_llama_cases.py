"""loopd's parser against llama.cpp's own: every case of llama.cpp's `tests/test-chat.cpp` (a
real model's raw output on one of its templates, and the message llama.cpp's parser must make
of it) read by loopd with the format it learns from a real llama-server running that template,
streamed three characters at a time and whole.

A case loopd cannot be compared on (it tests something loopd does not have) is skipped with its
reason, counted below. Where loopd still reads a case otherwise than llama.cpp, the case is in
`support/llama_known.py` with why; each template's test fails on any other difference, and on a
known one that went away (so the list only shrinks).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT
from loopd.infer import ChatFormat, FormatError
from support.llama_cases import Case, load_cases, parse
from support.llama_known import KNOWN
from support.template_servers import TemplateServers

pytestmark = pytest.mark.llama

CASES_FILE = Path(os.environ.get("LOOPD_CHAT_CASES") or ROOT / ".cache/llama-chat-cases.jsonl")
TEMPLATES = Path(os.environ.get("LOOPD_TEMPLATES") or ROOT / ".cache/llama-templates")
CASES = load_cases(CASES_FILE) if CASES_FILE.is_file() else {}


SKIPPED = {
    "continues a prefilled assistant message": 72,
    "reasoning_format none with reasoning in play": 8,
    "a json_schema response format": 12,
    "the partial-message API": 10,
}


def test_the_cases_are_there() -> None:
    if not CASES:
        pytest.fail(f"{CASES_FILE} is missing: run `just test` (or set LOOPD_CHAT_CASES)")
    assert len(CASES) >= 50


def test_cases_are_skipped_only_for_what_loopd_does_not_have() -> None:
    reasons = Counter(r for cs in CASES.values() for c in cs if (r := c.skip_reason()))
    assert dict(reasons) == {k: v for k, v in SKIPPED.items() if v}


def _differs(fmt: ChatFormat, case: Case) -> str | None:
    for piece in (3, 0):
        got = parse(fmt, case, piece)
        if got != case.expect:
            how = f"{piece} at a time" if piece else "whole"
            return f"{case.id} ({how}): expected {case.expect}, got {got}"
    return None


@pytest.mark.parametrize("template", sorted(CASES))
async def test_llama_cpp_cases_read_as_llama_cpp_reads_them(
    template_servers: TemplateServers, template: str
) -> None:
    compared = [c for c in CASES[template] if c.skip_reason() is None]
    if not compared:
        pytest.skip("every case of this template tests what loopd does not have")
    formats: dict[bool, ChatFormat | FormatError] = {}
    for thinking in sorted({c.thinking for c in compared}):
        try:
            formats[thinking] = await template_servers.format(
                TEMPLATES / template, thinking=thinking
            )
        except FormatError as e:  # history goes as messages: llama-server's parser reads
            formats[thinking] = e
    differences = {}
    for case in compared:
        fmt = formats[case.thinking]
        if not isinstance(fmt, FormatError) and (why := _differs(fmt, case)):
            differences[case.id] = why
    stem = template.removesuffix(".jinja")
    known = {k for k in KNOWN if k.rpartition("#")[0] == stem}
    new = "\n".join(why for k, why in differences.items() if k not in known)
    assert not new, f"read otherwise than llama.cpp reads it:\n{new}"
    assert not known - differences.keys(), "now read as llama.cpp reads them: drop from KNOWN"
