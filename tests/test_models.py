"""Several models under one loopd (`[models.NAME]`), chosen per session with `set_mode`: each
model on servers of its own, the history rendered by the new model's template after a
switch, and the switch's cost recorded as such."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import StartDaemon, asset
from loopd.config import ConfigError, load_config
from loopd.infer import slot_tokens
from loopd.session.records import (
    CacheLossRecord,
    ModeRecord,
    PromptRecord,
    Record,
    UsageRecord,
    conversation_problems,
)
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama


def two_models(home: Path) -> Daemon:
    """loopd with a llama-server of its own for each bundled model: SmolLM2 (the default)
    and Gemma 3, one slot each, history token-exact."""
    smol = asset("LOOPD_MODEL", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    gemma = asset("LOOPD_SWA_MODEL", ".cache/models/gemma-3-270m-q4_k_m.gguf")
    d = Daemon(home, "", history="exact")
    d.config.write_text(
        d.config.read_text().replace('url = ""\n', "")
        + "[loop]\nmax_tokens = 12\n[server.sampling]\ntemperature = 0\n"
        + f'[models.smol]\nmodel = "{smol}"\nn_ctx = 4096\nslots = 1\n'
        + f'[models.gemma]\nmodel = "{gemma}"\nn_ctx = 4096\nslots = 1\n'
    )
    return d


async def choose(client: LineClient, model: str) -> dict[str, Any]:
    await client.send({"type": "set_mode", "model": model})
    return (await client.until("mode"))[-1]


async def answered(client: LineClient, turn: str, content: str) -> None:
    assert (await client.turn(turn, content, timeout=120))[-1]["type"] == "turn_done"


async def saved(d: Daemon, session: str, model: str) -> None:
    """Wait until the session's slot file of `model` holds what its last request left."""
    usage = [r for r in Store(d.home / "sessions").read(session)[1] if isinstance(r, UsageRecord)]
    assert usage[-1].timings
    note = d.home / "slot-files" / f"{session}.{model}.json"
    with trio.fail_after(60):
        while not note.is_file() or json.loads(note.read_text())["tokens"] != slot_tokens(  # noqa: ASYNC110 - loopd writes it
            usage[-1].timings
        ):
            await trio.sleep(0.05)


def served(d: Daemon) -> dict[str, int]:
    """Requests each model's llama-server computed since it started (its log's own count)."""
    return {
        name: (d.home / f"llama-server.{name}.log").read_text().count("prompt eval time")
        for name in ("smol", "gemma")
    }


def requests(records: list[Record]) -> list[tuple[PromptRecord, UsageRecord]]:
    """Each request's `prompt` record and its usage, in order."""
    prompts = [r for r in records if isinstance(r, PromptRecord)]
    usages = [r for r in records if isinstance(r, UsageRecord)]
    return list(zip(prompts, usages, strict=True))


@pytest.mark.llama
async def test_a_session_switched_between_two_models_extends_each_models_own_prompt(
    tmp_path: Path,
) -> None:
    """SmolLM2, then Gemma 3, then SmolLM2 again, on two real llama-servers: the first
    request after each switch renders the whole conversation with that model's template (its
    cost, recorded as the switch's, no cache loss), and the next one on the same model
    computes only its new tokens; the choice holds across a loopd restart."""
    d = two_models(tmp_path / "loopd")
    await d.start()
    try:
        client = await d.connect()
        await client.send({"type": "hello"})
        session = (await client.until("welcome"))[-1]["session"]
        await answered(client, "s1", "Name a colour.")
        await answered(client, "s2", "Name a fruit.")
        assert (await choose(client, "gemma"))["model"] == "gemma"
        await answered(client, "g1", "Name a tree.")
        await answered(client, "g2", "Name a bird.")
        await choose(client, "smol")
        await answered(client, "s3", "Name a fish.")
        await answered(client, "s4", "Name a stone.")
        await choose(client, "gemma")
        await answered(client, "g3", "Name a river.")
        await saved(d, session, "gemma")
        before_restart = served(d)
        await d.end()
        await d.start()
        client = await d.connect()
        await client.send({"type": "hello", "session": session})
        await client.until("welcome")
        await client.send({"type": "status"})
        assert (await client.until("status"))[-1]["session_model"] == "gemma"
        await answered(client, "g4", "Name a flower.")
    finally:
        await d.end()
    log = Store(d.home / "sessions").read(session)[1]
    assert conversation_problems(log) == []
    assert not [r for r in log if isinstance(r, CacheLossRecord)]
    assert [r.model for r in log if isinstance(r, ModeRecord)] == ["gemma", "smol", "gemma"]
    assert before_restart == {"smol": 4, "gemma": 3}  # each request on its model's server
    assert served(d) == {"smol": 0, "gemma": 1}  # after the restart: Gemma 3's
    (s1, s2, g1, g2, s3, s4, g3, g4) = requests(log)
    # The first request on each model after a switch renders the whole conversation anew.
    full = [p.full for p, _ in (s1, s2, g1, g2, s3, s4, g3, g4)]
    assert full == [True, False] * 4
    assert g1[1].timings
    assert g1[1].timings.cache_n == 0
    # Each next request on the same model extends that model's last, token for token: after
    # the switch back to SmolLM2 too, and on Gemma 3 across the restart (from its slot file).
    for (_, before), (_, after) in ((s1, s2), (g1, g2), (s3, s4), (g3, g4)):
        assert before.timings
        assert after.timings
        assert after.timings.cache_n == slot_tokens(before.timings)
    assert f"restored the slot of session {session}" in d.log.read_text()


async def test_a_model_loopd_does_not_serve_is_refused_naming_what_it_serves(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([]))
    client = await d.connect()
    await client.send({"type": "hello", "session": "new"})
    session = (await client.until("welcome"))[-1]["session"]
    await client.send({"type": "set_mode", "model": "gemma"})
    error = (await client.until("error"))[-1]
    assert error["code"] == "unknown_model"
    assert error["message"] == (
        "no model 'gemma': loopd serves one model (configure [models.NAME] tables to choose "
        "between several)"
    )
    assert not [r for r in Store(d.home / "sessions").read(session)[1] if r.kind == "mode"]


def config_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "loopd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


def test_a_model_with_both_a_url_and_a_model_file_is_refused(tmp_path: Path) -> None:
    text = '[models.big]\nurl = "http://gpu:8080"\nmodel = "/m/big.gguf"\n'
    assert config_error(tmp_path, text) == (
        f"{tmp_path / 'loopd.toml'}:1: [models] big: set url (servers of this model loopd "
        "does not manage) or model (a GGUF file for a llama-server loopd starts), not both"
    )


def test_a_default_model_that_no_table_names_is_refused(tmp_path: Path) -> None:
    text = '[session]\nmodel = "big"\n[models.small]\nurl = "http://gpu:8080"\n'
    assert config_error(tmp_path, text) == (
        f"{tmp_path / 'loopd.toml'}: [session] model: 'big' is not a [models.NAME] table (small)"
    )


def test_the_default_model_is_the_sessions_else_the_first(tmp_path: Path) -> None:
    path = tmp_path / "loopd.toml"
    models = '[models.a]\nurl = "http://a:1"\n[models.b]\nurl = "http://b:1"\n'
    path.write_text(models)
    assert load_config(path)[0].default_model == "a"
    path.write_text('[session]\nmodel = "b"\n' + models)
    assert load_config(path)[0].default_model == "b"
