"""Text a GBNF grammar allows, drawn at random: what a model under it may write. The subset
loopd's grammars use: literals, character classes (ranges, negation, escapes), rule names,
groups, `|`, `?`, `*`, `+` and `{m,n}`."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

# Characters a model may write, to draw a character class's from.
ALPHABET = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t", "é", "€", "\x00", "\x7f"]
TOKEN = re.compile(
    r'\s*(?:(?P<lit>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<name>[a-zA-Z0-9-]+)'
    r"|(?P<rep>\{\d+(?:,\d*)?\})|(?P<op>[()|?*+]))"
)
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)")


def _unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        if code[0] in "xu" and len(code) > 1:
            return chr(int(code[1:], 16))
        return {"n": "\n", "t": "\t", "r": "\r"}.get(code, code)

    return _ESCAPE.sub(one, text)


@dataclass
class Sampler:
    grammar: str
    rng: random.Random
    depth: int = 6
    """How deep rules nest before every optional part is left out."""

    def __post_init__(self) -> None:
        self.rules = dict(line.split(" ::= ", 1) for line in self.grammar.splitlines())

    def text(self, rule: str = "root") -> str:
        return self._rule(rule, 0)

    def _rule(self, name: str, depth: int) -> str:
        tokens = [m for m in TOKEN.finditer(self.rules[name]) if m.group(0).strip()]
        out, at = self._alternatives(tokens, 0, depth)
        assert at == len(tokens), self.rules[name]
        return out

    def _alternatives(self, tokens: list[re.Match[str]], at: int, depth: int) -> tuple[str, int]:
        options = []
        while True:
            start, at = at, self._skip_sequence(tokens, at)
            options.append((start, at))
            if at < len(tokens) and tokens[at].group("op") == "|":
                at += 1
                continue
            break
        start, end = self.rng.choice(options)
        return self._sequence(tokens, start, end, depth), at

    def _skip_sequence(self, tokens: list[re.Match[str]], at: int) -> int:
        level = 0
        while at < len(tokens):
            op = tokens[at].group("op")
            if level == 0 and op in ("|", ")"):
                break
            level += (op == "(") - (op == ")")
            at += 1
        return at

    def _sequence(self, tokens: list[re.Match[str]], at: int, end: int, depth: int) -> str:
        out = ""
        while at < end:
            item_start = at
            if tokens[at].group("op") == "(":
                at = self._skip_sequence(tokens, at + 1)
                while tokens[at].group("op") == "|":
                    at = self._skip_sequence(tokens, at + 1)
                at += 1  # past ")"
            else:
                at += 1
            low, high = 1, 1
            rep = tokens[at].group("op") or tokens[at].group("rep") if at < end else None
            if rep and (rep in ("?", "*", "+") or rep.startswith("{")):
                low, high = _bounds(rep)
                at += 1
            count = low if depth >= self.depth else self.rng.randint(low, high)
            for _ in range(count):
                out += self._item(tokens, item_start, depth)
        return out

    def _item(self, tokens: list[re.Match[str]], at: int, depth: int) -> str:
        token = tokens[at]
        if token.group("op") == "(":
            return self._alternatives(tokens, at + 1, depth + 1)[0]
        if lit := token.group("lit"):
            return str(json.loads(lit))
        if cls := token.group("cls"):
            return self.rng.choice(_members(cls))
        return self._rule(token.group("name"), depth + 1)


def _bounds(rep: str) -> tuple[int, int]:
    if rep in ("?", "*", "+"):
        return {"?": (0, 1), "*": (0, 3), "+": (1, 3)}[rep]
    low, _, high = rep[1:-1].partition(",")
    top = int(high) if high else int(low) + 3
    return int(low), min(top, int(low) + 3)


def _ranges(cls: str) -> tuple[bool, list[tuple[str, str]]]:
    """A character class: whether it is negated, and its ranges (a character is one)."""
    body, negated = cls[1:-1], cls.startswith("[^")
    body = body[1:] if negated else body
    raw = [m.group(0) for m in re.finditer(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)|.", body)]
    items = [_unescape(i) for i in raw]
    ranges, i = [], 0
    while i < len(items):
        if i + 2 < len(items) and raw[i + 1] == "-":  # a range; an escaped `\-` is itself
            ranges.append((items[i], items[i + 2]))
            i += 3
        else:
            ranges.append((items[i], items[i]))
            i += 1
    return negated, ranges


def _members(cls: str) -> list[str]:
    negated, ranges = _ranges(cls)
    return [c for c in ALPHABET if any(lo <= c <= hi for lo, hi in ranges) != negated]


def _class_regex(cls: str) -> str:
    negated, ranges = _ranges(cls)
    parts = (re.escape(lo) if lo == hi else f"{re.escape(lo)}-{re.escape(hi)}" for lo, hi in ranges)
    return "[" + ("^" if negated else "") + "".join(parts) + "]"


def prefix_allowed(grammar: str, text: str, *, nesting: int = 3) -> str | None:
    """The start of `text` that the grammar allows whole (a call, where the text goes on past
    it), or None; rules that nest themselves are followed `nesting` deep."""
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())

    def regex(name: str, stack: tuple[str, ...]) -> str:
        if stack.count(name) >= nesting:
            return "(?!)"
        out = []
        for m in TOKEN.finditer(rules[name]):
            if lit := m.group("lit"):
                out.append("(?:" + re.escape(str(json.loads(lit))) + ")")
            elif cls := m.group("cls"):
                out.append(_class_regex(cls))
            elif ref := m.group("name"):
                out.append(regex(ref, (*stack, name)))
            else:
                op = m.group("op") or m.group("rep")
                out.append("(?:" if op == "(" else op)
        return "(?:" + "".join(out) + ")"

    found = re.match(regex("root", ()), text, re.DOTALL)
    return found.group(0) if found else None
