"""docs/inference.md against the code it describes: the request's signatures name the fields of
`ChatRequest` and `Generation` in their order, and its error tree is the client's error classes,
each under its base. A field or an error added or moved in the code fails here until the doc
says it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from loopd import infer
from loopd.infer import ChatRequest, Generation, InferError

DOC = (Path(__file__).resolve().parent.parent / "docs" / "inference.md").read_text()


def signature(name: str) -> list[str]:
    """The parameters the doc gives `name(...)`, in order."""
    match = re.search(rf"`{name}\(([^)]*)\)", DOC) or re.search(rf"{name}\(([^)]*)\)`", DOC)
    assert match is not None, f"docs/inference.md has no {name}(...)"
    return [part.strip() for part in " ".join(match.group(1).split()).split(",")]


def test_the_request_signatures_are_the_dataclasses_fields() -> None:
    for cls in (ChatRequest, Generation):
        assert signature(cls.__name__) == [f.name for f in dataclasses.fields(cls)]


def test_the_error_tree_is_the_clients_errors_each_under_its_base() -> None:
    tree = DOC[DOC.index("InferError ") :].split("```", 1)[0]
    documented: dict[str, str] = {}
    parents: list[tuple[int, str]] = []
    for line in tree.splitlines():
        found = re.search(r"([A-Z][A-Za-z]+)\s", line + " ")
        if found is None:
            continue
        depth = found.start()
        while parents and parents[-1][0] >= depth:
            parents.pop()
        if parents:
            documented[found.group(1)] = parents[-1][1]
        parents.append((depth, found.group(1)))
    errors = {
        name: cls.__mro__[1].__name__
        for name in dir(infer)
        if isinstance(cls := getattr(infer, name), type)
        and issubclass(cls, InferError)
        and cls is not InferError
    }
    assert documented == errors
