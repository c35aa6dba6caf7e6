"""The import graph keeps the layers of docs/architecture.md ("Layers"): no module imports from
a layer above its own, no module reaches into another package's private modules, and bxctl
imports nothing of the daemon (its actors, tools, turns, channel)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaves: no import of loopd's own, but of each other.
    (
        "loopd",
        "loopd.groups",
        "loopd.backoff",
        "loopd.canonical",
        "loopd.inbox",
        "loopd.supervise",
        "loopd.server_proc",
        "loopd.locations",
        "loopd.wire.lines",
    ),
    ("loopd.infer",),
    ("loopd.session",),
    ("loopd.config",),
    ("loopd.wire",),
    ("loopd.tools", "loopd.hooks"),
    ("loopd.turn",),
    ("loopd.actors",),
    ("loopd.channel",),
    ("loopd.daemon", "loopd.cli", "loopd.__main__"),
    ("bxctl",),
)
CLIENT_REACH = "loopd.wire"
"""The highest layer bxctl may import: the wire format, the records, the config."""
DAEMON_ONLY = (
    "loopd.tools",
    "loopd.hooks",
    "loopd.turn",
    "loopd.actors",
    "loopd.channel",
    "loopd.daemon",
)


def _layer(module: str) -> int:
    best, found = -1, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    assert found >= 0, f"{module} is in no layer: add it to LAYERS"
    return found


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path) -> set[str]:
    """The modules `module` imports (by name, relative ones resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in {"loopd", "bxctl"}}


def _known(name: str, modules: dict[str, Path]) -> str:
    """`name` as a module: `from loopd.x import y` names y, a module or an attribute."""
    return name if name in modules else name.rpartition(".")[0]


MODULES = _modules()


def _above(module: str, path: Path) -> list[str]:
    mine = _layer(module)
    named = {_known(n, MODULES) for n in _imports(module, path)}
    return sorted(name for name in named if _layer(name) > mine)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_layer_above_its_own(module: str) -> None:
    assert _above(module, MODULES[module]) == [], f"{module} imports from a layer above its own"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_reaches_into_another_packages_private_modules(module: str) -> None:
    reached = sorted(
        name
        for name in {_known(n, MODULES) for n in _imports(module, MODULES[module])}
        if (private := name.rpartition("._")[0]) and not module.startswith(private)
    )
    assert reached == [], f"{module} imports private modules of other packages: {reached}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("bxctl")))
def test_bxctl_imports_no_layer_above_the_wire_format(module: str) -> None:
    reach = _layer(CLIENT_REACH)
    above = sorted(
        name
        for name in {_known(n, MODULES) for n in _imports(module, MODULES[module])}
        if name.startswith("loopd") and _layer(name) > reach
    )
    assert above == [], f"{module} imports the daemon's {above}"


def test_bxctl_loads_none_of_the_daemons_modules_even_indirectly() -> None:
    code = (
        "import sys, bxctl.cli, bxctl.commands, bxctl.acp, bxctl.chat\n"
        f"print(sorted(m for m in sys.modules if m.startswith({DAEMON_ONLY!r})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]"


FACE_HOOKS = frozenset({"__getattr__", "__dir__"})
"""A face may name its modules' things lazily (PEP 562): that is naming, not logic."""


def _logic_in_face(path: Path) -> list[str]:
    """The functions and classes a package's `__init__.py` defines itself, beyond the lazy
    naming hooks: a face names what its modules hold and holds nothing of its own."""
    return sorted(
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.name not in FACE_HOOKS
    )


@pytest.mark.parametrize(
    "package", sorted(m for m, path in MODULES.items() if path.name == "__init__.py")
)
def test_a_package_face_holds_no_logic(package: str) -> None:
    assert _logic_in_face(MODULES[package]) == [], f"{package}'s __init__.py holds logic"


def test_the_face_check_sees_a_function_and_a_class_but_not_the_lazy_hook(
    tmp_path: Path,
) -> None:
    face = tmp_path / "__init__.py"
    face.write_text(
        "from ._a import b\n"
        "def __getattr__(name): ...\n"
        "async def open_thing(): ...\n"
        "class Thing: ...\n"
    )
    assert _logic_in_face(face) == ["Thing", "open_thing"]


def test_the_check_sees_imports_from_above_absolute_and_relative(tmp_path: Path) -> None:
    leaf = tmp_path / "leaf.py"
    leaf.write_text("from loopd.actors import open_core\nfrom ..turn import run_turn\n")
    assert _above("loopd.session.leaf", leaf) == ["loopd.actors", "loopd.turn"]


def test_bxctl_help_loads_neither_trio_nor_pydantic_nor_rich() -> None:
    """`bxctl --help` (and a usage error) is argparse alone: the commands' imports wait for a
    command to run."""
    code = (
        "import contextlib, io, sys\n"
        "from bxctl.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'trio', 'pydantic', 'rich'}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of `graph` with more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            part = []
            while (top := stack.pop()) != module:
                part.append(top)
            if part:
                found.append(sorted([module, *part]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_import_graph_has_no_circle() -> None:
    """Every import counts, those for types alone and those inside functions too: a circle is a
    knot in the design whether or not Python meets it at run time."""
    graph = {
        module: {_known(n, MODULES) for n in _imports(module, path)} - {module}
        for module, path in MODULES.items()
    }
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
