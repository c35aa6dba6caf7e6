"""Stream one answer from the bundled model: `just ask "Why is the sky blue?"`.

Starts llama-server with the bundled model, sends one request through loopd's client, prints
the answer as it streams and the request's cache figures, and stops the server.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import assets  # beside this script, so on sys.path when it runs
import trio

from loopd.infer import ChatEvent, ChatRequest, Client, Content, InferError, Reasoning
from loopd.server_proc import LaunchSpec, ServerStartError, managed_server


def show(event: ChatEvent) -> None:
    if isinstance(event, Content | Reasoning):
        print(event.text, end="", flush=True)


async def ask(prompt: str) -> int:
    spec = LaunchSpec(binary=assets.server_path(), model=assets.MODEL_PATH, n_ctx=4096)
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            managed_server(spec, Path(tmp) / "llama-server.log") as server,
            Client(server.url) as client,
        ):
            messages = [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": prompt},
            ]
            done = await client.chat(ChatRequest(messages, max_tokens=256), show)
    t = done.timings
    if t is not None:
        rate = t.predicted_n / t.predicted_ms * 1000 if t.predicted_ms else 0.0
        print(
            f"\n[{t.prompt_n} prompt tokens, {t.cache_n} cached, {t.predicted_n} generated, "
            f"{rate:.0f} tokens/s]",
            file=sys.stderr,
        )
    return 0


def main() -> int:
    prompt = " ".join(sys.argv[1:]) or "Say hello and tell me one fact about llamas."
    try:
        return trio.run(ask, prompt)
    except (InferError, ServerStartError) as e:
        print(f"ask: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
