"""`just bench slots`: what saving the slot's KV cache costs, against computing it again.

For each size, one llama-server (SmolLM2-135M, two threads, `--slot-save-path`) reads a
prompt of that many tokens into its slot; then, three times each: the slot saved to a file
(milliseconds and bytes, as the server reports them), the slot restored from it, and, as the
baseline, the same prompt computed again from an empty slot. A save is worth it when it costs
less than what it spares: the ratio restore / recompute is what a crash or a switch then costs.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx

from loopd.server_proc import LaunchSpec, managed_server

SIZES = (1_000, 3_000, 7_000)
RUNS = 3
WORDS = "the quick brown fox jumps over a lazy dog while seven birds sing".split()  # noqa: SIM905


async def _compute(http: httpx.AsyncClient, prompt: str) -> float:
    """Read `prompt` into slot 0 from an empty slot; the server's prompt time (ms)."""
    await http.post("/slots/0", params={"action": "erase"})
    body = {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True}
    answer = (await http.post("/completion", json=body)).json()
    return float(answer["timings"]["prompt_ms"])


async def _slot(http: httpx.AsyncClient, action: str) -> dict[str, Any]:
    answer = await http.post("/slots/0", params={"action": action}, json={"filename": "b.bin"})
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


async def _size(binary: Path, model: Path, tokens: int, tmp: Path) -> dict[str, Any]:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(tokens))
    spec = LaunchSpec(
        binary=binary, model=model, n_ctx=tokens + 512, threads=2, slot_save_path=tmp / "slots"
    )
    async with (
        managed_server(spec, tmp / f"llama-{tokens}.log") as server,
        httpx.AsyncClient(base_url=server.url, timeout=3600) as http,
    ):
        save_ms, restore_ms, compute_ms, size, held = [], [], [], 0, 0
        for _ in range(RUNS):
            compute_ms.append(await _compute(http, prompt))
            saved = await _slot(http, "save")
            save_ms.append(saved["timings"]["save_ms"])
            size, held = saved["n_written"], saved["n_saved"]
            await http.post("/slots/0", params={"action": "erase"})
            restored = await _slot(http, "restore")
            restore_ms.append(restored["timings"]["restore_ms"])
    return {
        "tokens": held,
        "bytes": size,
        "save_ms": statistics.median(save_ms),
        "restore_ms": statistics.median(restore_ms),
        "compute_ms": statistics.median(compute_ms),
    }


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loopd-bench-slots-") as tmp:
        rows = [await _size(binary, model, tokens, Path(tmp)) for tokens in SIZES]
    return {"rows": rows}


def table(f: dict[str, Any]) -> list[str]:
    head = "| tokens in the slot | file | save | restore | computed again (baseline) | ratio |"
    return [
        head,
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['tokens']:,} | {r['bytes'] / 2**20:.1f} MiB | {r['save_ms']:.0f} ms "
            f"| {r['restore_ms']:.0f} ms | {r['compute_ms']:,.0f} ms "
            f"| restore {r['restore_ms'] / r['compute_ms']:.3f}x |"
            for r in f["rows"]
        ),
    ]
