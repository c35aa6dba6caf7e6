"""How a template writes a tool call's arguments: JSON, Gemma 4's own notation, or Python.

Gemma 4 writes `{path:<|"|>a.md<|"|>,depth:2}`: keys bare, strings between `<|"|>` tokens,
numbers, booleans, lists and objects as in JSON otherwise. LFM2 writes a Python call,
`read_file(path='a.md', depth=2)`. All decode to the same JSON object, which is what a tool
gets. Sans-IO.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Literal

__all__ = ["GEMMA_QUOTE", "OPENING", "Notation", "decode_arguments"]

Notation = Literal["json", "gemma", "python"]

OPENING: dict[Notation, str] = {"json": "{", "gemma": "{", "python": "("}
"""What the arguments start with."""

GEMMA_QUOTE = '<|"|>'

_SCALAR = re.compile(r"[^,}\]]*")


def decode_arguments(notation: Notation, text: str, at: int) -> tuple[dict[str, object], int]:
    """The object that starts at `text[at]`, and where it ends; `ValueError` when it is not
    one, or not whole yet."""
    if notation == "json":
        value, end = json.JSONDecoder().raw_decode(text, at)
    elif notation == "gemma":
        value, end = _gemma(text, at)
    else:
        value, end = _python(text, at)
    if not isinstance(value, dict):
        raise ValueError("the arguments are not an object")  # noqa: TRY004 - one error for all
    return value, end


def _gemma(text: str, at: int) -> tuple[object, int]:
    at = _skip_space(text, at)
    if text.startswith(GEMMA_QUOTE, at):
        end = text.find(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        if end < 0:
            raise ValueError("a string not closed")
        return text[at + len(GEMMA_QUOTE) : end], end + len(GEMMA_QUOTE)
    opening = text[at : at + 1]
    if opening == "{":
        return _gemma_object(text, at + 1)
    if opening == "[":
        return _gemma_list(text, at + 1)
    scalar = _SCALAR.match(text, at)
    assert scalar is not None  # noqa: S101 - the pattern matches the empty string
    raw = scalar.group(0).strip()
    if not raw or scalar.end() >= len(text):
        raise ValueError("no value, or one that may go on")
    try:
        return json.loads(raw), scalar.end()
    except json.JSONDecodeError:
        return raw, scalar.end()


def _gemma_object(text: str, at: int) -> tuple[dict[str, object], int]:
    out: dict[str, object] = {}
    at = _skip_space(text, at)
    if text.startswith("}", at):
        return out, at + 1
    while True:
        at = _skip_space(text, at)
        if text.startswith(GEMMA_QUOTE, at):
            key, at = _gemma(text, at)
        else:
            colon = text.find(":", at)
            if colon < 0:
                raise ValueError("a key without its value")
            key, at = text[at:colon].strip(), colon
        at = _skip_space(text, at)
        if not text.startswith(":", at) or not isinstance(key, str) or not key:
            raise ValueError("not a key and a value")
        out[key], at = _gemma(text, at + 1)
        closed, at = _after_item(text, at, "}")
        if closed:
            return out, at


def _gemma_list(text: str, at: int) -> tuple[list[object], int]:
    out: list[object] = []
    at = _skip_space(text, at)
    if text.startswith("]", at):
        return out, at + 1
    while True:
        item, at = _gemma(text, at)
        out.append(item)
        closed, at = _after_item(text, at, "]")
        if closed:
            return out, at


def _after_item(text: str, at: int, closer: str) -> tuple[bool, int]:
    """Past the comma before the next item (False), or past the closer (True)."""
    at = _skip_space(text, at)
    if text.startswith(",", at):
        return False, at + 1
    if text.startswith(closer, at):
        return True, at + 1
    raise ValueError(f"no {closer} closes it")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _python(text: str, at: int) -> tuple[dict[str, object], int]:
    """`(key=value, ...)` with Python literals (LFM2.5's calls): up to the first `)` after
    which the whole is a call of keywords."""
    if not text.startswith("(", at):
        raise ValueError("no arguments")
    end = text.find(")", at)
    while end >= 0:
        try:
            tree = ast.parse("f" + text[at : end + 1], mode="eval").body
        except SyntaxError:
            end = text.find(")", end + 1)
            continue
        if not isinstance(tree, ast.Call) or tree.args or any(k.arg is None for k in tree.keywords):
            raise ValueError("not keyword arguments")
        try:
            return {str(k.arg): _literal(k.value) for k in tree.keywords}, end + 1
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
            raise ValueError("a value that is not a literal") from e
    raise ValueError("arguments not closed")


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> object:
    """A Python literal, where an object may be written as JSON (`{"a": true}`)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** in a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)
