"""How a template writes a tool call's arguments: JSON, Gemma 4's own notation, or Python.

Gemma 4 writes `{path:<|"|>a.md<|"|>,depth:2}`: keys bare, strings between `<|"|>` tokens,
numbers, booleans, lists and objects as in JSON otherwise. LFM2 writes a Python call,
`read_file(path='a.md', depth=2)`: as llama.cpp reads it, keyword arguments only, strings in
either quote with Python's escapes and newlines as they are, lists, tuples and sets as JSON lists,
`True` and `true` alike. All decode to the same JSON object, which is what a tool
gets. Sans-IO.
"""

from __future__ import annotations

import json
import re
from string import hexdigits
from typing import Literal

__all__ = ["GEMMA_QUOTE", "OPENING", "Notation", "decode_arguments", "python_literal"]

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
    """`(key=value, ...)`, LFM2's calls, read as llama.cpp reads them: keyword arguments only,
    each value a Python literal where an object may be written as JSON (`{"a": true}`).
    `ValueError` when it is not one, or not whole yet."""
    return _PythonReader(text).call(at)


def python_literal(text: str) -> object:
    """A whole value written as a Python literal: a mapping or a list as a template's
    `| string` writes one (`{'path': 'a.md'}`, ByteDance Seed-OSS). `ValueError` where it is
    none."""
    reader = _PythonReader(text + "\n")  # a number at the end is whole
    value, end = reader.value(0, 0)
    if text[end:].strip():
        raise ValueError("more than one value")
    return value


_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_NAME = re.compile(r"[A-Za-z_]\w*")
_WORDS: dict[str, object] = {
    "True": True,
    "False": False,
    "None": None,
    "true": True,
    "false": False,
    "null": None,
}
_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "a": "\a",
    "0": "\0",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "/": "/",
    "\n": "",
}
_HEX = {"x": 2, "u": 4, "U": 8}
_DEPTH = 64
"""How deep lists and objects may nest: deeper is not a call's arguments."""


class _PythonReader:
    def __init__(self, text: str) -> None:
        self.text = text

    def call(self, at: int) -> tuple[dict[str, object], int]:
        if not self.text.startswith("(", at):
            raise ValueError("no arguments")
        out: dict[str, object] = {}
        at = _skip_space(self.text, at + 1)
        while not self.text.startswith(")", at):
            name = _NAME.match(self.text, at)
            at = _skip_space(self.text, name.end()) if name else at
            if name is None or not self.text.startswith("=", at):
                raise ValueError("not keyword arguments")
            out[name.group(0)], at = self.value(at + 1, 0)
            at = self._after_item(at, ")")
        return out, at + 1

    def value(self, at: int, depth: int) -> tuple[object, int]:
        at = _skip_space(self.text, at)
        if depth > _DEPTH:
            raise ValueError("nested too deep")
        char = self.text[at : at + 1]
        if char in ("'", '"'):
            return self.string(at + 1, char)
        if char in ("[", "("):
            return self.items(at + 1, "]" if char == "[" else ")", depth)
        if char == "{":
            return self.braces(at + 1, depth)
        if number := _NUMBER.match(self.text, at):
            end = number.end()
            if end >= len(self.text):
                raise ValueError("a number that may go on")
            return json.loads(number.group(0)), end
        word = _NAME.match(self.text, at)
        if word and word.group(0) in _WORDS and word.end() < len(self.text):
            return _WORDS[word.group(0)], word.end()
        raise ValueError("not a literal")

    def string(self, at: int, quote: str) -> tuple[str, int]:
        """A string's text, escapes decoded; newlines may be in it as they are."""
        out: list[str] = []
        text = self.text
        while at < len(text):
            char = text[at]
            if char == quote:
                return "".join(out), at + 1
            if char != "\\":
                out.append(char)
                at += 1
                continue
            code = text[at + 1 : at + 2]
            if code in _HEX:
                digits = text[at + 2 : at + 2 + _HEX[code]]
                if len(digits) < _HEX[code] or not all(c in hexdigits for c in digits):
                    raise ValueError("an escape not whole")
                out.append(chr(int(digits, 16)))
                at += 2 + _HEX[code]
            elif code:  # an escape Python does not know keeps its backslash, as in Python
                out.append(_ESCAPES.get(code, "\\" + code))
                at += 2
            else:
                break
        raise ValueError("a string not closed")

    def items(self, at: int, closer: str, depth: int) -> tuple[list[object], int]:
        """A list or a tuple: a JSON list."""
        out: list[object] = []
        at = _skip_space(self.text, at)
        while not self.text.startswith(closer, at):
            item, at = self.value(at, depth + 1)
            out.append(item)
            at = self._after_item(at, closer)
        return out, at + 1

    def braces(self, at: int, depth: int) -> tuple[object, int]:
        """An object (`{}` too), or a set: a JSON list."""
        at = _skip_space(self.text, at)
        if self.text.startswith("}", at):
            return {}, at + 1
        _, after = self.value(at, depth + 1)
        if not self.text.startswith(":", _skip_space(self.text, after)):
            return self.items(at, "}", depth)
        out: dict[str, object] = {}
        while not self.text.startswith("}", at):
            key, at = self.value(at, depth + 1)
            at = _skip_space(self.text, at)
            if not isinstance(key, str) or not self.text.startswith(":", at):
                raise ValueError("not a key and a value")
            out[key], at = self.value(at + 1, depth + 1)
            at = self._after_item(at, "}")
        return out, at + 1

    def _after_item(self, at: int, closer: str) -> int:
        """At the next item past its comma, or at the closer (a comma before it allowed)."""
        at = _skip_space(self.text, at)
        if self.text.startswith(",", at):
            return _skip_space(self.text, at + 1)
        if self.text.startswith(closer, at):
            return at
        raise ValueError(f"no {closer} closes it")
