"""What to do with one tool call of the model: answer it here, or send it to the port.

The model sees two tools. `find_tool` is answered at once from the registry. `call_tool` goes
to the port, but only once its arguments are known to be right: JSON, an object, a tool that
exists, arguments that fit its schema. Anything else is answered here with a text that tells
the model exactly what was wrong, so it can correct itself, and nothing runs.

Arguments are bounded before they are parsed: a size and a nesting depth, since `json.loads`
and schema validation recurse, and a model can write anything.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from referencing.exceptions import Unresolvable

from loopd.canonical import canonical
from loopd.session.records import Mode

from ._registry import Registry, read_only_refuses

__all__ = [
    "MAX_ARGUMENT_BYTES",
    "MAX_DEPTH",
    "Dispatch",
    "Local",
    "Port",
    "call_key",
    "dispatch",
    "find_tool_text",
    "requested_tool",
]

MAX_ARGUMENT_BYTES = 1024 * 1024
"""Arguments larger than this are refused unread."""
MAX_DEPTH = 64
"""Objects and lists nested deeper than this are refused; no tool needs it."""

_POLICY_NOTES = {
    "ask": " (asks the user before it runs)",
    "deny": " (never runs: the user's policy denies it)",
}

_READ_ONLY_NOTE = " (refused in this read-only session)"

USAGE = (
    'Use find_tool {"query": "..."} to find a tool, then '
    'call_tool {"name": ..., "arguments": {...}}.'
)


@dataclass(frozen=True)
class Local:
    """The answer, made here; nothing is sent to the port."""

    text: str


@dataclass(frozen=True)
class Port:
    """A checked call for the port to run."""

    tool: str
    arguments: dict[str, Any]


Dispatch = Local | Port


def dispatch(
    registry: Registry, name: str, arguments: str, *, find_limit: int = 5, mode: Mode = "ask"
) -> Dispatch:
    """`name` and `arguments` exactly as the model sent them, in a session of mode `mode`."""
    if name not in ("find_tool", "call_tool"):
        hint = ""
        if registry.get(name) is not None:
            hint = f' To run it: call_tool {{"name": "{name}", "arguments": {{...}}}}.'
        return Local(f"There is no tool {name!r} to call directly.{hint} {USAGE}")
    parsed = _object(arguments, name)
    if isinstance(parsed, Local):
        return parsed
    if name == "find_tool":
        query = parsed.get("query")
        if not isinstance(query, str) or not query.strip():
            return Local('find_tool needs {"query": "<what you want to do>"}.')
        return Local(find_tool_text(registry, query, find_limit, mode))
    return _call_tool(registry, parsed)


def _object(arguments: str, name: str) -> dict[str, Any] | Local:
    size = len(arguments.encode(errors="replace"))
    if size > MAX_ARGUMENT_BYTES:
        return Local(
            f"The arguments of {name} are {size} bytes; at most {MAX_ARGUMENT_BYTES} are read."
        )
    try:
        value = json.loads(arguments)
    except ValueError as e:
        return Local(f"The arguments of {name} are not valid JSON ({e}): {arguments[:200]!r}")
    except RecursionError:  # deeper than Python's stack
        return _too_deep(name)
    if _depth(value) > MAX_DEPTH:
        return _too_deep(name)
    if not isinstance(value, dict):
        return Local(f"The arguments of {name} must be a JSON object, not {type(value).__name__}.")
    return value


def _too_deep(name: str) -> Local:
    return Local(f"The arguments of {name} nest objects or lists more than {MAX_DEPTH} deep.")


def _depth(value: object) -> int:
    """How deep objects and lists nest, without recursion (1 for a flat object)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:  # deeper is refused anyway: no need to walk it
                children = item.values() if isinstance(item, dict) else item
                stack.extend((child, level + 1) for child in children)
    return deepest


def call_key(name: str, arguments: str) -> tuple[str, str]:
    """What makes two calls the same: the name and the arguments as values, so spacing and key
    order do not tell them apart."""
    parsed = _object(arguments, name)
    if isinstance(parsed, Local):
        return name, arguments
    inner = parsed.get("arguments")
    if isinstance(inner, str) and isinstance(value := _object(inner, name), dict):
        parsed = {**parsed, "arguments": value}  # the object sent as a JSON string
    return name, json.dumps(parsed, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _call_tool(registry: Registry, parsed: dict[str, Any]) -> Dispatch:
    tool = parsed.get("name")
    if not isinstance(tool, str):
        return Local(f'call_tool needs "name": the name of a tool. {USAGE}')
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):  # some models send the object as a JSON string
        arguments = _object(arguments, tool)
        if isinstance(arguments, Local):
            return arguments
    if not isinstance(arguments, dict):
        return Local(f'call_tool needs "arguments" as a JSON object for {tool}.')
    entry = registry.get(tool)
    if entry is None:
        close = difflib.get_close_matches(tool, registry.names(), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return Local(f"There is no tool named {tool!r}.{hint} {USAGE}")
    problems = _schema_problems(entry.schema, arguments)
    if problems:
        return Local(
            f"The arguments for {tool} do not fit its schema: {'; '.join(problems)}. "
            f"Its schema: {canonical(entry.schema).decode()}"
        )
    return Port(tool, arguments)


def _schema_problems(schema: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    try:
        validator = Draft202012Validator(schema)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    except (SchemaError, Unresolvable):
        return []  # a server's broken schema is its own business; the tool will say
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors[:5]]


def find_tool_text(registry: Registry, query: str, limit: int, mode: Mode = "ask") -> str:
    """What the model reads back from `find_tool`: names, summaries, argument schemas, and
    what a call of each meets in a session of mode `mode`."""
    matches = registry.search(query, limit)
    if not matches:
        names = ", ".join(registry.names()[:20]) or "none"
        return f"No tool matches {query!r}. Tools available: {names}."
    lines = [f"Tools for {query!r}, best first:"]
    for number, entry in enumerate(matches, start=1):
        status = "" if entry.available else " (unavailable now: its server is down)"
        if mode == "read_only" and read_only_refuses(entry):
            status += _READ_ONLY_NOTE
        else:
            status += _POLICY_NOTES.get(entry.policy_in(mode).action, "")
        lines.append(f"{number}. {entry.name}{status}: {entry.summary}")
        if entry.description != entry.summary:
            lines.append(f"   {entry.description}")
        lines.append(f"   arguments: {canonical(entry.schema).decode()}")
    lines.append('Call one with call_tool {"name": ..., "arguments": {...}}.')
    return "\n".join(lines)


def requested_tool(name: str, arguments: str) -> str | None:
    """The tool a `call_tool` call asks for, when its arguments name one; for showing it."""
    if name != "call_tool":
        return None
    parsed = _object(arguments, name)  # bounded: a display never fails on what the model wrote
    tool = parsed.get("name") if isinstance(parsed, dict) else None
    return tool if isinstance(tool, str) else None
