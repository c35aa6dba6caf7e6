"""`loopd serve`: one nursery that supervises everything a running loopd is.

    serve ─┬─ signals            SIGINT/SIGTERM: say goodbye, stop; a second one: exit now
           ├─ own files          its socket or its store folder gone: say why, stop, exit 1
           ├─ llama-server       the embedded default: started, watched, restarted at once
           └─ open_core ── channel server

Start-up fails early and clearly: a live daemon on the socket, no llama-server or model to
start. Started by systemd's socket activation, it listens on the socket systemd passes
(`loopd.channel.systemd_socket`) instead of binding its own. Shutdown cancels the running turns
(their logs stay valid), saves the caches the slots hold, says `bye` to every client, removes
the socket it bound (systemd's stays, for the next activation), and exits 0. Only what leaves
loopd unable to serve anyone stops it otherwise (`Unusable`): its own files gone, or the slot
pool or the tool port failing past their restart bound (`loopd.supervise`); a session that
fails closes alone (`actors`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import trio

from loopd.actors import PoolHandle, open_core
from loopd.backoff import RESTART
from loopd.bundled import bundled
from loopd.channel import ChannelServer, DaemonInfo, UnixSocket, open_socket, systemd_socket
from loopd.collector import collect_when_quiet
from loopd.config import Config, ManagedServer, private_paths
from loopd.infer import (
    TITLES,
    Access,
    BadAnswer,
    Client,
    EngineName,
    InferError,
    RetryPolicy,
    ServerFacts,
    ServerHealth,
    Timeouts,
)
from loopd.server_proc import LaunchSpec, ServerStartError, free_port, managed_server
from loopd.session.store import Store
from loopd.supervise import RESTARTS
from loopd.tools import missing_tokens

__all__ = ["StartupError", "Unusable", "check_servers", "launch_spec", "serve", "server_access"]

log = logging.getLogger(__name__)

HEALTH_EVERY = 1.0
"""Seconds between two looks at an external llama-server's `/health`."""
OWN_FILES_EVERY = 1.0
"""Seconds between two looks at loopd's socket and store folder."""
HEALTH_TIMEOUT = 5.0
"""Seconds a `/health` answer may take before the server counts as not answering; also the
start-up probe's deadline."""


class StartupError(Exception):
    """loopd cannot start; the message says why and what to do."""


class Unusable(Exception):
    """loopd stopped because it could no longer serve anyone; the message says why."""


def launch_spec(managed: ManagedServer, slots: int, state: Path) -> LaunchSpec:
    """The embedded llama-server: from the config, else the environment, else what the
    set-up bundled (`loopd.bundled`), else PATH; with `slots` slots."""
    pair = bundled()
    binary = (
        managed.binary
        or _env_path("LOOPD_LLAMA_SERVER")
        or (pair.binary if pair else None)
        or _which("llama-server")
    )
    if binary is None:
        raise StartupError(
            "no llama-server to start: set [server.managed] binary or $LOOPD_LLAMA_SERVER, put "
            "llama-server on PATH, point [server] url at a running one, or run `just setup` "
            "in loopd's checkout to build the bundled one"
        )
    model = managed.model or _env_path("LOOPD_MODEL") or (pair.model if pair else None)
    if model is None:
        raise StartupError(
            "no model to load: set [server.managed] model or $LOOPD_MODEL, or run `just setup` "
            "in loopd's checkout to fetch the bundled one"
        )
    for what, path in (("llama-server", binary), ("model", model)):
        if not path.expanduser().is_file():
            raise StartupError(f"the {what} {path} does not exist")
    extra = tuple(managed.extra_args)
    # The bundled model answers right only near its own temperature: the server's default
    # unless the environment names another (a request's [server] sampling still wins).
    if (
        pair is not None
        and model == pair.model
        and pair.temperature is not None
        and "LLAMA_ARG_TEMPERATURE" not in os.environ
    ):
        extra = ("--temp", pair.temperature, *extra)
    return LaunchSpec(
        binary=binary.expanduser(),
        model=model.expanduser(),
        n_ctx=managed.n_ctx,
        parallel=slots,
        threads=managed.threads,
        slot_save_path=state / "slots",
        port=free_port(),
        chat_template_file=managed.chat_template_file,
        extra_args=extra,
        swa_full=True,  # slot files that restore on sliding-window models too
    )


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _which(name: str) -> Path | None:
    found = shutil.which(name)
    return Path(found) if found else None


async def _keep_running(
    spec: LaunchSpec,
    log_path: Path,
    restarted: trio.MemorySendChannel[None],
    health: ServerHealth,
    *,
    task_status: trio.TaskStatus[None],
) -> None:
    """Run the embedded llama-server; start it again at once whenever it dies (with backoff
    between starts that fail), and say so on
    `restarted` (its slots are empty then). Meanwhile `health` says why it is away, for the
    turns that wait for it (its client reads it)."""
    failures = 0
    started = False
    while True:
        try:
            async with managed_server(spec, log_path) as server:
                failures = 0
                health.up()
                if not started:
                    task_status.started()
                    started = True
                else:
                    restarted.send_nowait(None)
                log.info("llama-server is up at %s (pid %d)", server.url, server.process.pid)
                code = await server.process.wait()
                health.exited(f"it exited with status {code}")
                log.warning("llama-server exited with status %s; starting it again", code)
        except ServerStartError as e:
            if not started:
                raise StartupError(f"llama-server did not start: {e}") from e
            failures += 1
            delay = RESTART.delay(failures)
            log.warning("llama-server did not start (%s); next try in %.0f s", e, delay)
            await trio.sleep(delay)


async def _probe(
    client: Client, forced: EngineName | None, *, at_start: bool = True
) -> ServerFacts | None:
    """Ask an external server what it is (the engine, found unless `[server] engine` names
    it), which model it runs and its context window. None while it cannot say (it does not
    answer, or still loads its model): requests wait for it, and the health watch asks again.
    At start, a server that answers none of what an engine would is a `StartupError`; later,
    it is said in the log and asked again."""
    say = log.warning if at_start else log.debug  # the watch asks every second
    with trio.move_on_after(HEALTH_TIMEOUT):
        try:
            client.be(forced or await client.identify())
            facts = await client.describe()
        except BadAnswer as e:
            if forced is None and at_start:
                raise StartupError(str(e)) from e
            say("%s does not say what it serves: %s", client.base_url, e)
            return None
        except InferError as e:
            say("%s is not ready yet (%s); requests will wait for it", client.base_url, e)
            return None
        log.info(
            "%s serves %s (a window of %s tokens)",
            client.engine.title,
            facts.model or "a model it does not name",
            facts.context or "unknown",
        )
        return facts
    say("%s does not answer yet; requests will wait for it", client.base_url)
    return None


async def check_servers(config: Config) -> tuple[list[str], bool]:
    """What `check-config` says of the servers: each external one reached (its engine, model
    and context window, or why it cannot be used), or the embedded llama-server's binary and
    model found, of `[server]` or of each `[models.NAME]`; and whether loopd could serve with
    them (every model's)."""
    if config.models:
        lines, ok = [], True
        for name, model in config.models.items():
            slots = model.slots or config.server.slots
            said, usable = await _check(config, model.url or [], model.managed(), slots, name)
            lines += said
            ok = ok and usable
        return lines, ok
    return await _check(config, config.server.urls, config.server.managed, config.server.slots)


async def _check(
    config: Config,
    urls: list[str],
    managed: ManagedServer,
    slots: int,
    name: str | None = None,
) -> tuple[list[str], bool]:
    """`check_servers` for one model (`name`, of `[models.NAME]`; None: `[server]`'s): its
    servers at `urls`, else its embedded llama-server."""
    of = f" (model {name})" if name is not None else ""
    if not urls:
        try:
            spec = launch_spec(managed, slots, Path())
        except StartupError as e:
            return [f"# server{of}: the embedded llama-server cannot start: {e}"], False
        embedded = (
            f"# server{of}: the embedded llama-server {spec.binary}, model {spec.model}, "
            f"{spec.n_ctx} tokens a slot"
        )
        return [embedded], True
    try:
        access = server_access(config)
    except StartupError as e:
        return [f"# server{of}: {e}"], False
    lines, ok = [], True
    for url in urls:
        timeouts = Timeouts(connect=HEALTH_TIMEOUT, read=HEALTH_TIMEOUT)
        async with Client(url, timeouts=timeouts, access=access) as client:
            try:
                with trio.fail_after(HEALTH_TIMEOUT * 2):
                    client.be(config.server.engine or await client.identify())
                    facts = await client.describe()
            except (InferError, trio.TooSlowError) as e:
                said = str(e) or "no answer in time"
                lines.append(f"# server {url}{of}: cannot be used: {said}")
                ok = False
                continue
        window = f"a window of {facts.context} tokens" if facts.context else "window not said"
        found = "named by [server] engine" if config.server.engine else "found"
        lines.append(
            f"# server {url}{of}: {TITLES[facts.engine]} ({found}), model "
            f"{facts.model or 'not named'}, {window}"
        )
    return lines, ok


@dataclass
class _Stop:
    """What a stop signal ends: start-up, or, once loopd serves, the serving (so the slots are
    still saved before loopd's own llama-server goes)."""

    starting: trio.CancelScope = field(default_factory=trio.CancelScope)
    serving: trio.CancelScope | None = None
    channel: ChannelServer | None = None
    unusable: str | None = None
    """Why loopd stops on its own, when it does."""

    async def stop(self, why: str = "loopd is shutting down") -> None:
        if self.channel is not None:
            await self.channel.goodbye(why)
        (self.serving or self.starting).cancel()

    async def unusable_now(self, why: str) -> None:
        """loopd can serve nobody, because of `why`: say so, stop, exit 1."""
        self.unusable = why
        await self.stop(f"loopd stops: {why}")


async def serve(config: Config, socket_path: Path, config_file: Path | None = None) -> None:
    """Serve until SIGINT or SIGTERM, heard from the first moment: a signal while the embedded
    llama-server starts stops loopd as cleanly as one later. `config_file`: where `config` came
    from, hidden from the tools like the rest of loopd's own files."""
    activated = systemd_socket()  # first: no child may inherit its variables
    if activated is not None:
        if activated.path != socket_path:
            log.warning(
                "systemd's socket %s is not the one loopd's clients look for (%s): make the "
                ".socket unit's ListenStream= and [channel] socket the same",
                activated.path,
                socket_path,
            )
        socket_path = activated.path
    private = private_paths(config, socket_path, config_file)
    if missing := missing_tokens(config.tools):
        raise StartupError("; ".join(missing))
    stop = _Stop()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, stop)
            with stop.starting:
                await _open_and_serve(config, socket_path, stop, private, activated)
            nursery.cancel_scope.cancel()
    if stop.unusable is not None:
        raise Unusable(f"loopd stopped: {stop.unusable}")
    log.info("stopped")


async def _open_and_serve(
    config: Config,
    socket_path: Path,
    stop: _Stop,
    private: list[Path],
    activated: UnixSocket | None,
) -> None:
    store = Store(config.store.directory)
    # Bound before start-up (clients that started loopd wait on the socket), but said to
    # listen only once start-up has succeeded and loopd serves.
    unix = activated or await open_socket(socket_path)
    where = f"{socket_path} (systemd's socket)" if activated else str(socket_path)
    try:
        with store.hold():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_own_files, store, unix, stop)
                nursery.start_soon(collect_when_quiet)
                await _serve(config, store, unix.listener, stop, private, where)
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await unix.aclose()


async def _serve(  # noqa: PLR0913, PLR0917 - `where`: said once start-up has succeeded
    config: Config,
    store: Store,
    listener: trio.SocketListener,
    stop: _Stop,
    private: list[Path],
    where: str,
) -> None:
    # Unbounded: the keeper of the embedded server says "restarted" with `send_nowait` and
    # must never block; it restarts at most once per backoff period.
    restarted_send, restarted = trio.open_memory_channel[None](math.inf)
    slot_directory: Path | None = None
    access = server_access(config)
    served: dict[str, str] = {}
    restarts_of: list[tuple[trio.MemoryReceiveChannel[None], Client]] = []
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        if config.models:
            clients, info, slot_directory = await _start_models(
                config, access, nursery, stack, served, restarts_of
            )
        elif config.server.urls:
            clients = [_client(config, url, access) for url in config.server.urls]
            for client in clients:
                await stack.enter_async_context(client)
            found = [await _probe(client, config.server.engine) for client in clients]
            info = DaemonInfo(", ".join(config.server.urls), None, engine=config.server.engine)
            if (first := next((facts for facts in found if facts is not None), None)) is not None:
                info.model, info.context_size, info.engine = (
                    first.model,
                    first.context,
                    first.engine,
                )
        else:
            spec = launch_spec(
                config.server.managed, config.server.slots, config.store.directory.parent
            )
            log_path = config.store.directory.parent / "llama-server.log"
            health = ServerHealth()
            embedded = _client(config, f"http://{spec.host}:{spec.port}", access, health)
            await stack.enter_async_context(embedded)
            await nursery.start(_keep_running, spec, log_path, restarted_send, health)
            info = DaemonInfo(embedded.base_url, spec.model.name, spec.n_ctx, "llama")
            slot_directory = spec.slot_save_path
            clients = [embedded]
            restarts_of.append((restarted, embedded))
        with trio.CancelScope() as stop.serving:
            restarts = replace(RESTARTS, gave_up=stop.unusable_now)
            async with (
                open_core(
                    config,
                    store,
                    clients,
                    slot_directory,
                    private,
                    restarts=restarts,
                    served=served,
                ) as core,
                trio.open_nursery() as watch,
            ):
                managed = {id(client) for _, client in restarts_of}
                external = [client for client in clients if id(client) not in managed]
                for client in external:
                    # Alone: no other server of its model to go on on.
                    model = served.get(client.base_url)
                    alone = sum(served.get(c.base_url) == model for c in clients) == 1
                    watching = partial(_watch_health, alone=alone)
                    watch.start_soon(watching, client, core.pool, info, config.server.engine)
                for restarted_of, client in restarts_of:
                    watch.start_soon(_forget_after_restarts, restarted_of, core.pool, client)
                stop.channel = ChannelServer(core, info, config.channel)
                log.info("listening on %s", where)
                await stop.channel.serve(listener)
        nursery.cancel_scope.cancel()


async def _start_models(  # noqa: PLR0913, PLR0917 - what starting them fills in
    config: Config,
    access: Access,
    nursery: trio.Nursery,
    stack: AsyncExitStack,
    served: dict[str, str],
    restarts_of: list[tuple[trio.MemoryReceiveChannel[None], Client]],
) -> tuple[list[Client], DaemonInfo, Path | None]:
    """The servers of every `[models.NAME]`, the default model's first (its first server
    renders templates for sub-agents and summaries): each external one probed as `[server]
    url`'s are, each managed llama-server started and kept running. `served` is filled with
    each server's model, `restarts_of` with each managed server's restarts."""
    state = config.store.directory.parent
    default = config.default_model
    order = sorted(config.models.items(), key=lambda item: item[0] != default)
    clients: list[Client] = []
    directory: Path | None = None
    described: list[str] = []
    each: dict[str, DaemonInfo] = {}
    for name, model in order:
        if model.url is not None:
            found = []
            for url in model.url:
                client = await stack.enter_async_context(_client(config, url, access))
                found.append(await _probe(client, config.server.engine))
                clients.append(client)
                served[client.base_url] = name
            described.append(f"{name}: {', '.join(model.url)}")
            each[name] = DaemonInfo(", ".join(model.url), None, engine=config.server.engine)
            if (facts := next((f for f in found if f is not None), None)) is not None:
                each[name].model, each[name].context_size = facts.model, facts.context
                each[name].engine = facts.engine
            continue
        slots = model.slots or config.server.slots
        spec = launch_spec(model.managed(), slots, state)
        health = ServerHealth()
        client = _client(config, f"http://{spec.host}:{spec.port}", access, health)
        await stack.enter_async_context(client)
        restarted_send, restarted = trio.open_memory_channel[None](math.inf)
        log_path = state / f"llama-server.{name}.log"
        await nursery.start(_keep_running, spec, log_path, restarted_send, health)
        clients.append(client)
        served[client.base_url] = name
        restarts_of.append((restarted, client))
        directory = spec.slot_save_path
        described.append(f"{name}: {spec.model.name}")
        each[name] = DaemonInfo(client.base_url, spec.model.name, spec.n_ctx, "llama")
        log.info("model %s: llama-server with %s", name, spec.model.name)
    first = clients[0]
    info = DaemonInfo(first.base_url, "; ".join(described), engine=config.server.engine)
    if (facts := first.engine.facts) is not None:
        info.context_size, info.engine = facts.context, facts.engine
    elif config.models[order[0][0]].url is None:
        info.context_size, info.engine = config.models[order[0][0]].n_ctx, "llama"
    info.models, info.default = each, default
    return clients, info, directory


def server_access(config: Config) -> Access:
    """How the servers are reached besides their URLs; the API key read from the variable
    `[server] api_key_env` names (a `StartupError` where it is not set)."""
    s = config.server
    key = None
    if s.api_key_env is not None:
        key = os.environ.get(s.api_key_env)
        if not key:
            raise StartupError(
                f"[server] api_key_env names ${s.api_key_env}, which is not set: export the "
                "server's API key in it"
            )
    return Access(
        engine=s.engine or "llama",
        model=s.model,
        api_key=key,
        affinity_header=s.affinity_header or None,
        block_size=s.block_size,
    )


def _client(config: Config, url: str, access: Access, health: ServerHealth | None = None) -> Client:
    """`health`: what the keeper of a server loopd runs says of it; None for another's."""
    s = config.server
    return Client(
        url,
        timeouts=Timeouts(connect=s.connect_timeout, queue=s.queue_timeout, read=s.read_timeout),
        retry=RetryPolicy(attempts=s.retry.attempts, base=s.retry.base, cap=s.retry.cap),
        access=access,
        health=health,
    )


async def _forget_after_restarts(
    restarted: trio.MemoryReceiveChannel[None], pool: PoolHandle, client: Client
) -> None:
    """A llama-server that died and started again has empty slots: each session's cache comes
    back from its slot file when it next takes a slot."""
    async for _ in restarted:
        pool.reset(client.base_url)


async def _watch_health(
    client: Client, pool: PoolHandle, info: DaemonInfo, forced: EngineName | None, *, alone: bool
) -> None:
    """Tell the pool whether an external server answers: its slots are lent only while it
    does. Told at every look, not only when it changes: a turn whose request the server could
    not take tells the pool too, and the next look that finds it answering undoes that. Until
    the server has said what it is (down or loading at start), each look asks it that instead
    of its health; one that comes back is asked again: it may have restarted, with an empty
    cache, or with another model."""
    up = True
    while True:
        if client.engine.facts is None:
            answers = await _probe(client, forced, at_start=False) is not None
        else:
            answers = False
            with trio.move_on_after(HEALTH_TIMEOUT):
                answers = await client.healthy()
            if answers and not up:  # it may have restarted: `describe` notes when
                await _probe(client, client.engine.name, at_start=False)
        if (facts := client.engine.facts) is not None and info.model is None:
            info.model, info.context_size, info.engine = facts.model, facts.context, facts.engine
        pool.health(client.base_url, up=answers)
        if answers != up:
            up = answers
            if up:
                log.info("%s answers again: its slots are lent again", client.engine.title)
            elif alone:
                log.warning("%s does not answer: turns wait for it", client.engine.title)
            else:
                log.warning(
                    "%s does not answer: its sessions go on on the other servers, their "
                    "caches restored from slot files where the servers share them",
                    client.engine.title,
                )
        await trio.sleep(HEALTH_EVERY)


async def _watch_own_files(store: Store, unix: UnixSocket, stop: _Stop) -> None:
    """Stop loopd when it can no longer serve anyone: its socket gone (no client can reach it,
    and no new loopd can start while this one holds the store) or its store folder gone (the
    logs it writes would be found by nobody). Anything smaller is a session's own failure."""
    # Polled: a file's removal sends no event loopd could wait for without inotify.
    while (why := unix.gone() or store.gone()) is None:  # noqa: ASYNC110
        await trio.sleep(OWN_FILES_EVERY)
    log.error("%s: loopd cannot serve anyone and stops", why)
    await stop.unusable_now(why)


async def _stop_on_signal(signals: AsyncIterator[int], stop: _Stop) -> None:
    async for number in signals:
        log.info("%s: shutting down (again to exit at once)", signal.Signals(number).name)
        break

    async def exit_on_second() -> None:
        async for _ in signals:
            log.warning("second signal: exiting now")
            os._exit(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(exit_on_second)
        await stop.stop()  # a running turn is cancelled and writes its closing records
