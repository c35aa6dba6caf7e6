"""The protocol's docs stay true: every example parses, every message is shown, the schemas
are current; and the messages that carry a session's mode read as they should."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ValidationError

from loopd.wire.proto import CLIENT_MESSAGE, DAEMON_MESSAGE, ModeSet, SetMode, json_schema

DOCS = Path(__file__).resolve().parent.parent / "docs"
_CLIENT_PART, _DAEMON_PART = (DOCS / "protocol.md").read_text().split("## Daemon to client")
SECTIONS = {"client": _CLIENT_PART, "daemon": _DAEMON_PART}
ADAPTERS: dict[str, Any] = {"client": CLIENT_MESSAGE, "daemon": DAEMON_MESSAGE}
Direction = Literal["client", "daemon"]


def examples(direction: Direction) -> list[str]:
    return re.findall(r"```json\n(.*?)\n```", SECTIONS[direction], re.DOTALL)


@pytest.mark.parametrize("direction", ["client", "daemon"])
def test_every_example_in_the_protocol_doc_parses(direction: Direction) -> None:
    for example in examples(direction):
        parsed = ADAPTERS[direction].validate_json(example)
        assert parsed.type == json.loads(example)["type"]


@pytest.mark.parametrize("direction", ["client", "daemon"])
def test_the_doc_shows_every_message_type(direction: Direction) -> None:
    shown = {json.loads(e)["type"] for e in examples(direction)}
    definitions = ADAPTERS[direction].json_schema()["$defs"].values()
    types = {d["properties"]["type"]["const"] for d in definitions if "type" in d["properties"]}
    assert types == shown


@pytest.mark.parametrize("direction", ["client", "daemon"])
def test_the_schemas_in_docs_are_current(direction: Direction) -> None:
    path = DOCS / f"protocol-{direction}.schema.json"
    assert json.loads(path.read_text()) == json_schema(direction), f"{path} is stale: just docs"


def test_set_mode_names_what_changes_and_an_empty_one_only_asks() -> None:
    asked = CLIENT_MESSAGE.validate_json('{"type": "set_mode"}')
    assert isinstance(asked, SetMode)
    assert (asked.mode, asked.thinking) == (None, None)
    both = CLIENT_MESSAGE.validate_json('{"type": "set_mode", "mode": "ask", "thinking": true}')
    assert isinstance(both, SetMode)
    assert (both.mode, both.thinking) == ("ask", True)


@pytest.mark.parametrize(
    "line",
    [
        '{"type": "set_mode", "mode": "yolo"}',
        '{"type": "set_mode", "mode": "READ_ONLY"}',
        '{"type": "set_mode", "thinking": "maybe"}',
    ],
)
def test_set_mode_refuses_a_mode_loopd_does_not_have(line: str) -> None:
    with pytest.raises(ValidationError):
        CLIENT_MESSAGE.validate_json(line)


def test_the_mode_answer_says_the_mode_and_thinking_in_full() -> None:
    line = '{"type": "mode", "session": "s", "mode": "accept_edits", "thinking": false}'
    answer = DAEMON_MESSAGE.validate_json(line)
    assert isinstance(answer, ModeSet)
    assert (answer.mode, answer.thinking) == ("accept_edits", False)
    with pytest.raises(ValidationError):  # the answer always says both
        DAEMON_MESSAGE.validate_json('{"type": "mode", "session": "s", "mode": "ask"}')
