"""`just bench [NAMES]`: measure the figures that matter; write bench/results.md and .json.

Each figure stands beside a baseline measured in the same run, as a ratio, so it means
something on a noisy machine. Nothing here is a test: no figure can fail.

    cache     tokens processed per request against the minimum; loopd and pydantic-ai
    overhead  time to first token and total through the socket and loopd, against direct
    relay     events per second from a fast server to a socket client, against plain httpx
    store     opening a 10,000-record session; one append with fsync
    memory    the daemon's resident memory at rest and after 1,000 turns
    history   time to first token against the length of the history
    templates every chat template: token-exact history against history as messages
    freeze    how long `status` waits while a tool call burns its whole deadline
    parser    llama.cpp's own parser cases read by loopd's parser; its cost per streamed piece
    concurrency  1, 2 and 4 sessions at once: tokens/s and time to first token, against direct
    agents    four sub-agents at once against the same four tasks one after another
    hands     a sandboxed command against a bare one; an edit against a plain write
    startup   bxctl --help and bxctl status, whole processes, against python -c pass
    fork      time to first token of a fork's first turn, against the conversation uncached
    prompt    a long session's next prompt and body, against both built from the whole history
    vllm      loopd on vLLM: tokens processed, time to first token, sessions at once, against
              clients of vLLM's chat endpoint
    stacks    a streamed completion's and a JSON request's cost over h11 (loopd's), against httpx
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import agents
import cache
import concurrency
import fork
import freeze
import hands
import history
import memory
import models
import overhead
import parser
import prompt
import relay
import slots
import stacks
import startup
import store
import trio
import vllm

import templates

HERE = Path(__file__).resolve().parent
COMMAND = "just bench"


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}"


def _assets() -> tuple[Path, Path]:
    return Path(os.environ["LOOPD_LLAMA_SERVER"]), Path(os.environ["LOOPD_MODEL"])


def _swa_model() -> Path | None:
    """Gemma 3 270M, where it was fetched: a second model, with other delimiters."""
    path = os.environ.get("LOOPD_SWA_MODEL")
    return Path(path) if path else None


FIGURES: dict[str, Callable[[], dict[str, Any]]] = {
    "cache": lambda: trio.run(cache.measure, *_assets()),
    "overhead": lambda: trio.run(overhead.measure, *_assets()),
    "relay": lambda: trio.run(relay.measure),
    "store": store.run,
    "memory": lambda: trio.run(memory.measure),
    "history": lambda: trio.run(history.measure, *_assets(), _swa_model()),
    "freeze": lambda: trio.run(freeze.measure),
    "slots": lambda: trio.run(slots.measure, *_assets()),
    "models": lambda: trio.run(models.measure),
    "templates": lambda: trio.run(
        templates.measure, *_assets(), Path(os.environ["LOOPD_TEMPLATES"])
    ),
    "concurrency": lambda: trio.run(concurrency.measure, *_assets()),
    "agents": lambda: trio.run(agents.measure, *_assets()),
    "hands": lambda: trio.run(hands.measure),
    "startup": lambda: trio.run(startup.measure),
    "fork": lambda: trio.run(fork.measure, *_assets()),
    "parser": lambda: trio.run(
        parser.measure,
        *_assets(),
        Path(os.environ["LOOPD_TEMPLATES"]),
        Path(os.environ["LOOPD_CHAT_CASES"]),
    ),
    "prompt": prompt.run,
    "vllm": lambda: trio.run(vllm.measure, Path(os.environ["LOOPD_TEMPLATES"])),
    "stacks": lambda: trio.run(stacks.measure, *_assets()),
}


def _section(name: str, f: dict[str, Any]) -> list[str]:  # noqa: PLR0911, PLR0912, C901 - one per figure
    if name == "cache":
        return [
            "## 1-2. Tokens processed per request against the minimum",
            "",
            (
                "Eight turns, restart after the fourth (loopd restarted; pydantic-ai's history "
                "saved and loaded), SmolLM2-135M on the bundled llama-server. The minimum is the "
                "tokens of each prompt that the slot did not hold after the previous request (its "
                "prompt and the tokens generated, less the last): 1.0 is the physical limit, "
                "anything above it was recomputed."
            ),
            "",
            *cache.table(f),
        ]
    if name == "overhead":
        return [
            "## 3. Overhead of the socket and loopd",
            "",
            "| figure | through loopd | direct httpx | ratio (median of pairs) |",
            "| --- | --- | --- | --- |",
            (
                f"| time to first token | {f['loopd_ttft_ms']:.0f} ms "
                f"| {f['direct_ttft_ms']:.0f} ms | {f['ttft_ratio']:.2f}x |"
            ),
            f"| total | | | {f['total_ratio']:.2f}x |",
        ]
    if name == "relay":
        return [
            "## 4. Relay throughput",
            "",
            "| | events/s |",
            "| --- | --- |",
            f"| plain httpx SSE reader | {f['direct_events_per_s']:,.0f} |",
            f"| through loopd to a socket client | {f['loopd_events_per_s']:,.0f} |",
            f"| ratio | {f['ratio']:.2f}x |",
        ]
    if name == "history":
        return [
            "## 8. Time to first token against the length of the history",
            "",
            (
                "Medians of 9 rounds per size for SmolLM2-135M, 6 for Gemma 3 270M "
                "(bench/history.py): time to the first token of a question after a cached "
                "document, through loopd and the socket, and with the very request body loopd "
                "sends for it, sent straight to `/completion`, alone and with the rendering "
                "loopd checks its guessed rendering by asked beside it. Before each, the slot "
                "is set back to the history as the log holds it, so all process the same "
                "tokens. What loopd adds is compared round by round: outside the server's "
                "prompt time (each side's time less its prompt time, which takes out the "
                "prompt's noise, tens of milliseconds here), split into what the check's "
                "rendering costs the server and what is loopd's own; and in all (which keeps "
                "what loopd's work beside the request costs the prompt on a server whose cores "
                "all compute it, and the prompt's noise). The "
                "next column sends the whole history as messages, which the server renders "
                "and tokenizes again on every request (SmolLM2 only, to keep the run short). "
                "The last column takes the server out: loopd, restarted on the same session, "
                "and the very request it sends, sent directly, both against a server that "
                "answers each request as the real one did when first asked (bench/instant.py, "
                "its own process), after a fixed 20 ms to the first token (a short prompt on a "
                "GPU) and 5 ms a token after it; medians of 20 rounds, each side first as "
                "often. What is left is loopd's own work on the way to the first content."
            ),
            "",
            *history.table(f),
        ]
    if name == "templates":
        return [
            "## 7. Every chat template: token-exact history against history as messages",
            "",
            (
                "llama.cpp's `models/templates` on SmolLM2-135M; three user turns, a find_tool "
                "-> call_tool chain in the first, a restart from the log after it "
                "(bench/templates.py). Recomputed: tokens the slot held that a request did not "
                "find in the cache."
            ),
            "",
            *templates.table(f),
        ]
    if name == "parser":
        return [
            "## 12. llama.cpp's own parser cases, read by loopd's parser",
            "",
            (
                "Every case of llama.cpp's tests/test-chat.cpp read with the format loopd learns "
                "from a real llama-server on the case's template, three characters at a time and "
                "whole (bench/parser.py, as tests/test_llama_cases.py reads them)."
            ),
            "",
            *parser.table(f),
        ]
    if name == "concurrency":
        return [
            "## 13. Several conversations at once",
            "",
            (
                "One llama-server with four slots, SmolLM2-135M on two threads "
                f"(bench/concurrency.py): N clients send at the same moment, each through loopd "
                f"in a session of its own, or straight to the server with the very request loopd "
                f"sends, on a slot each; every answer runs to {f['max_tokens']} tokens. Medians "
                f"of {f['rounds']} rounds, alternating which side goes first; tokens/s is every "
                "client's generated tokens over the round's wall time."
            ),
            "",
            *concurrency.table(f),
        ]
    if name == "agents":
        return [
            "## 14. Sub-agents at once",
            "",
            (
                f"One llama-server with {f['tasks'] + 1} slots, SmolLM2-135M on two threads "
                f"(bench/agents.py): {f['tasks']} tasks given to {f['tasks']} sub-agents in one "
                "round of `delegate` calls, against the same tasks one after another, through "
                f"the same machinery; every answer runs to {f['max_tokens']} tokens. Medians of "
                f"{f['rounds']} rounds, alternating which side goes first."
            ),
            "",
            *agents.table(f),
        ]
    if name == "startup":
        return [
            "## 16. How fast bxctl starts",
            "",
            (
                f"bench/startup.py: whole-process runs, medians of {f['runs']}, alternating with "
                "`python -c pass` on the same interpreter; `status` against a running loopd on a "
                "scripted llama-server."
            ),
            "",
            *startup.table(f),
        ]
    if name == "fork":
        return [
            "## 17. A fork's first turn",
            "",
            (
                "SmolLM2-135M on two threads, a session whose first message is a document "
                "(bench/fork.py): forks of it at turn 1, each with a question, through loopd "
                "and the socket, against the very request loopd sends sent straight to "
                "`/completion` with `cache_prompt: false` on a slot of its own (the "
                "conversation as a new prompt); medians of the pairs, alternating which goes "
                "first. The first fork takes over the session's hot slot, the later ones "
                "restore its slot file. Its new message is the least a fork can compute: the "
                "request's tokens less those the session's slot held."
            ),
            "",
            *fork.table(f),
        ]
    if name == "hands":
        return [
            "## 15. The agent's hands",
            "",
            (
                f"bench/hands.py: `true` through `run_command`, in the sandbox (bubblewrap, "
                "the seccomp filter, the process bound, the hidden paths), bare, and in the "
                "previous release's sandbox (bubblewrap's namespaces and mounts only), fork to "
                f"exit (median of {f['runs']}, alternating); an `edit_file` of a "
                f"{f['size'] // 1024} KiB file (read, edit, diff, both contents kept, the log "
                "record, a temporary file, fsync, rename) against a plain write of the same "
                f"bytes with one fsync (median of {f['edits']})."
            ),
            "",
            *hands.table(f),
        ]
    if name == "freeze":
        return [
            "## 9. Answering while a tool call burns its deadline",
            "",
            (
                "A `search_text` whose regular expression backtracks exponentially runs until "
                "`[tools] timeout` (3 s); a second client asks `status` every 20 ms meanwhile "
                "(bench/freeze.py), against the same asked while loopd is idle."
            ),
            "",
            *freeze.table(f),
        ]
    if name == "slots":
        return [
            "## 10. Slot files: saving the cache against computing it again",
            "",
            (
                "SmolLM2-135M on two CPU threads (bench/slots.py): a prompt of each size read "
                "into the slot, then saved to a file, restored, and, as the baseline, computed "
                "again from an empty slot; medians of 3. loopd saves after each turn once idle "
                '(`[slots] save = "turn"`): a crash or a session switch then costs the '
                "restore instead of the recompute."
            ),
            "",
            *slots.table(f),
        ]
    if name == "models":
        return [
            "## 11. The small chat models the registries ship",
            "",
            (
                "Each scored through loopd on its own llama-server, two threads, temperature 0 "
                "(bench/models.py): three facts, a request that needs a file read, and a "
                "two-step chain over the built-in file tools; each prompt in a fresh session."
            ),
            "",
            *models.table(f),
        ]
    if name == "prompt":
        return [
            "## 18. A long session's next request",
            "",
            (
                "A token-exact session of 100-token answers between questions (bench/prompt.py, "
                f"medians of {prompt.ROUNDS}): the prompt of the request after the next answer, "
                "built from the trail the session keeps as its records come, against the same "
                "read out of every record of the log (a ChatML stand-in renders the new "
                "messages in both, the server's work); and its body, on the history as a list "
                "that only grows and with the JSON its slot kept of the last prompt, against "
                "the same body encoded whole."
            ),
            "",
            "| figure | loopd | baseline (same run) | ratio |",
            "| --- | --- | --- | --- |",
            *(f"| {' | '.join(row)} |" for row in prompt.rows(f)),
        ]
    if name == "vllm":
        return [
            "## 19. loopd on vLLM",
            "",
            (
                f"vLLM {f.get('version') or ''} (the CPU build, two cores), SmolLM2-135M, "
                "prefix caching in blocks of 32 tokens (bench/vllm.py, tests/support/vllm.py): "
                'loopd (`history = "exact"`, temperature 0) against a client that sends the '
                "same conversation as messages straight to `/v1/chat/completions` (the same "
                "system prompt, tools and thinking; each answer sent back as the content it "
                "got), on the same server. Tokens: processed is `prompt_tokens - cached_tokens`; "
                "the minimum is what the request's prompt holds beyond what the conversation's "
                "previous request left in whole blocks (`loopd.infer.cache_limit`), so 1.00 is "
                "the limit; recomputed, what that left and the request did not find. The prefix "
                "cache is emptied before each side; the three llama.cpp templates are served "
                "with `--chat-template` (and `-O0`: the same tokens, a faster start). Times: "
                "SmolLM2's own template, `[server] slots = 4`; time to first content through "
                "the socket, against the first content chunk of the streamed chat request; each "
                "side first as often, after the same history (its blocks filled beforehand, so "
                "both compute the same tokens)."
            ),
            "",
            *vllm.table(f),
        ]
    if name == "stacks":
        return [
            "## 20. One HTTP stack: loopd's own over h11 against httpx",
            "",
            (
                f"The same streamed `/completion` (a cached prompt, one token and {f['tokens']}) "
                "and the same `/tokenize`, on the bundled llama-server, through each stack; "
                f"medians of {f['rounds']} rounds, each side first as often (bench/stacks.py). "
                "CPU: the client process's own time, whatever the server's noise."
            ),
            "",
            *stacks.table(f),
        ]
    if name == "store":
        return [
            "## 5. Store",
            "",
            "| figure | loopd | baseline (same run) | ratio |",
            "| --- | --- | --- | --- |",
            *(f"| {' | '.join(row)} |" for row in store.rows(f)),
        ]
    per_live = (f.get("live_sessions_mib", 0) - f["after_turns_mib"]) / f.get("sessions", 1)
    per_left = (f.get("sessions_left_mib", 0) - f["after_turns_mib"]) / f.get("sessions", 1)
    return [
        "## 6. Memory",
        "",
        "| | resident MiB |",
        "| --- | --- |",
        f"| a bare Python importing loopd's packages (floor) | {f['python_floor_mib']:.0f} |",
        f"| loopd serve at rest | {f['at_rest_mib']:.0f} |",
        f"| after {f['turns']:,} turns | {f['after_turns_mib']:.0f} |",
        *(
            [
                (
                    f"| then {f['sessions']} more sessions live, a client and a turn in each "
                    f"| {f['live_sessions_mib']:.0f} (+{per_live:.2f} per session) |"
                ),
                (
                    "| once their clients left (the sessions closed) "
                    f"| {f['sessions_left_mib']:.0f} (+{per_left:.2f} per session) |"
                ),
            ]
            if "sessions" in f
            else []
        ),
    ]


def main(names: list[str]) -> int:
    unknown = set(names) - set(FIGURES)
    if unknown:
        print(f"bench: no such figure: {', '.join(sorted(unknown))}; of {', '.join(FIGURES)}")
        return 2
    started = datetime.now(UTC)
    print(f"$ {COMMAND} {' '.join(names)}".rstrip() + f"   ({machine()})", file=sys.stderr)
    figures = {}
    for name in names or FIGURES:
        print(f"measuring {name}…", file=sys.stderr)
        figures[name] = FIGURES[name]()
    lines = [
        "# Benchmark results",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {machine()}, by `{COMMAND}`.",
        "",
    ]
    for name, result in figures.items():
        lines += [*_section(name, result), ""]
    text = "\n".join(lines)
    print(text)
    _save(started, figures, whole=not names)
    return 0


def _save(started: datetime, figures: dict[str, Any], *, whole: bool) -> None:
    """A whole run replaces the saved figures; a partial one replaces its own sections and
    says when each was measured."""
    saved = HERE / "results.json"
    record = {} if whole or not saved.exists() else json.loads(saved.read_text())
    dates = record.get("measured", {})
    for name in FIGURES:  # sections saved before dates were kept per section
        if name in record and name not in dates:
            dates[name] = record["date"]
    for name in figures:
        dates[name] = started.isoformat()
    record.update({"date": started.isoformat(), "machine": machine(), "command": COMMAND})
    record.update(figures)
    record["measured"] = dates
    saved.write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# Benchmark results", "", f"By `{COMMAND}` on {machine()}.", ""]
    for name in FIGURES:
        if name in record:
            when = dates.get(name, record["date"])[:16].replace("T", " ")
            lines += [*_section(name, record[name]), "", f"_Measured {when} UTC._", ""]
    (HERE / "results.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
