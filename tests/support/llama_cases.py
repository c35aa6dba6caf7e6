"""llama.cpp's own parser test cases (`tests/test-chat.cpp` of the sdist that builds
llama-server), as `scripts/assets.py chat-cases-path` writes them out: each a model's raw
output on one of llama.cpp's templates, with what llama.cpp's parser must make of it.

A case is compared only where loopd has what it tests; `skip_reason` says why not otherwise.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopd.infer import ChatFormat
from loopd.infer._raw import parser_for
from loopd.infer._schema import ArgumentTypes

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Message:
    reasoning: str
    content: str
    calls: tuple[tuple[str, Any], ...]
    """Each call's name and its arguments, decoded (text where they are not JSON)."""

    @classmethod
    def of(cls, msg: dict[str, Any]) -> Message:
        calls = tuple((c["name"], _arguments(c["arguments"])) for c in msg["tool_calls"])
        # As llama.cpp's test compares: whitespace around reasoning and content aside.
        return cls(msg["reasoning_content"].strip(), msg["content"].strip(), calls)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class Case:
    id: str
    """The template's name and the case's place among that template's cases."""
    template: str
    raw: dict[str, Any]

    @property
    def input(self) -> str:
        return str(self.raw["input"])

    @property
    def thinking(self) -> bool:
        return bool(self.raw["enable_thinking"])

    @property
    def expect(self) -> Message:
        return Message.of(self.raw["expect"])

    def skip_reason(self) -> str | None:
        """Why loopd cannot be compared on this case: it tests something loopd does not have."""
        raw = self.raw
        if raw["continue_final_message"] != "none" or not raw["add_generation_prompt"]:
            return "continues a prefilled assistant message"
        if raw["is_partial"]:
            return "the partial-message API"
        if raw["json_schema"]:
            return "a json_schema response format"
        if raw["reasoning_format"] == "none" and raw.get("llama_auto") != raw["llama"]:
            return "reasoning_format none with reasoning in play"
        if "error" in raw:
            return f"llama.cpp itself fails: {raw['error']}"
        return None


def cases_path() -> Path | None:
    path = os.environ.get("LOOPD_CHAT_CASES")
    return Path(path) if path else None


def load_cases(path: Path) -> dict[str, list[Case]]:
    """The cases by template file name, in the order test-chat.cpp has them."""
    by_template: dict[str, list[Case]] = defaultdict(list)
    for line in path.read_text().splitlines():
        raw = json.loads(line)
        template = Path(raw["template"]).name
        stem = template.removesuffix(".jinja")
        by_template[template].append(Case(f"{stem}#{len(by_template[template])}", template, raw))
    return dict(by_template)


def parse(fmt: ChatFormat, case: Case, piece: int) -> Message:
    """What loopd's parser makes of the case's input fed `piece` characters at a time (all of
    it at once when `piece` is 0), with the case's tools."""
    parser, text = parser_for(fmt, ArgumentTypes(case.raw["tools"]), tokens=False), case.input
    pieces = []
    step = piece or max(len(text), 1)
    for at in range(0, len(text), step):
        pieces += parser.feed(text[at : at + step])
    pieces += parser.finish()
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    content = "".join(p.text for p in pieces if p.kind == "content")
    calls = tuple((p.name, _arguments(p.text)) for p in pieces if p.kind == "call")
    return Message(reasoning.strip(), content.strip(), calls)
