# loopd's tasks. `just` lists them.

set shell := ["bash", "-euo", "pipefail", "-c"]
# Arguments reach commands as "$@", quoted as the user typed them.
set positional-arguments := true

py := ".venv/bin/python"
# The bundled model's sampling temperature, the default of the llama-server that `serve` and
# `chat` start (a request's own `[server] sampling` still wins): SmolLM2-135M answers simple
# questions right only near 0 (docs/benchmarks.md, section 11).
temperature := "0"
# uv from PATH, else the one `setup` installs into the project's cache.
uv := `command -v uv || echo .cache/bootstrap/bin/uv`

# List the recipes
default:
    @just --list

# Create the venv, install the locked dependencies, build llama-server and fetch the model
setup:
    @[ -x "{{uv}}" ] || { python3 -m venv .cache/bootstrap && .cache/bootstrap/bin/pip install --quiet uv; }
    @{{uv}} sync --locked --quiet
    @UV="{{uv}}" {{py}} scripts/assets.py ensure

# Run the daemon on the bundled llama-server and model (arguments go to `loopd serve`)
serve *ARGS: setup
    LOOPD_LLAMA_SERVER="$({{py}} scripts/assets.py server-path)" \
    LOOPD_MODEL="$({{py}} scripts/assets.py model-path)" \
    LLAMA_ARG_TEMPERATURE="${LLAMA_ARG_TEMPERATURE:-{{temperature}}}" \
    .venv/bin/loopd serve "$@"

# Chat with the model: starts loopd on the bundled server and model if none runs (arguments go to `bxctl chat`)
chat *ARGS: setup
    #!/usr/bin/env bash
    set -euo pipefail
    export LOOPD_LLAMA_SERVER="$({{py}} scripts/assets.py server-path)"
    export LOOPD_MODEL="$({{py}} scripts/assets.py model-path)"
    export LLAMA_ARG_TEMPERATURE="${LLAMA_ARG_TEMPERATURE:-{{temperature}}}"
    if ! .venv/bin/bxctl status >/dev/null 2>&1; then
        state="${XDG_STATE_HOME:-$HOME/.local/state}/loopd"
        mkdir -p "$state"
        echo "starting loopd (log: $state/loopd.log; stop it with: just stop)" >&2
        # In a session of its own: the terminal's Ctrl-C and hang-up never reach it.
        .venv/bin/python -c 'import os, sys; os.setsid(); os.execv(sys.argv[1], sys.argv[1:])' \
            .venv/bin/loopd serve >>"$state/loopd.log" 2>&1 </dev/null &
        echo $! >"$state/loopd.pid"
        for _ in $(seq 600); do .venv/bin/bxctl status >/dev/null 2>&1 && break; sleep 0.1; done
    fi
    exec .venv/bin/bxctl chat "$@"

# Stop the loopd that `just chat` started
stop:
    #!/usr/bin/env bash
    pid_file="${XDG_STATE_HOME:-$HOME/.local/state}/loopd/loopd.pid"
    if [ -f "$pid_file" ] && kill -TERM "$(cat "$pid_file")" 2>/dev/null; then
        rm -f "$pid_file"; echo "loopd stopped"
    else
        echo "no loopd started by just chat is running"
    fi

# The cache property on a real llama-server: four turns with a loopd restart ($LOOPD_SERVER_URL, else the bundled one)
device-check *ARGS: setup
    {{py}} scripts/device_check.py "$@"

# Run the whole test suite (real llama-server tests and llama.cpp's own parser cases included)
test *ARGS: setup
    LOOPD_LLAMA_SERVER="$({{py}} scripts/assets.py server-path)" \
    LOOPD_MODEL="$({{py}} scripts/assets.py model-path)" \
    LOOPD_TEMPLATES="$(UV="{{uv}}" {{py}} scripts/assets.py templates-path)" \
    LOOPD_CHAT_CASES="$(UV="{{uv}}" {{py}} scripts/assets.py chat-cases-path)" \
    LOOPD_SWA_MODEL="$(UV="{{uv}}" {{py}} scripts/assets.py candidate-path gemma3-270m)" \
    LOOPD_ACPX="$({{py}} scripts/assets.py acpx-path)" \
    {{py}} -m pytest "$@"

# Format the code
fmt:
    {{uv}} run --locked ruff format .
    {{uv}} run --locked ruff check --fix .

# Format check, lint, types, then the whole test suite
gate: setup
    {{uv}} run --locked ruff format --check .
    {{uv}} run --locked ruff check .
    {{uv}} run --locked mypy
    just test

# Print the llama-server binary's path
llama-server: setup
    @{{py}} scripts/assets.py server-path

# Print the bundled model's path
model: setup
    @{{py}} scripts/assets.py model-path

# Record the llama-server exchanges in recordings/ anew (all, or the named ones)
record *NAMES: setup
    {{py}} scripts/record.py "$@"

# Measure the figures that matter; writes bench/results.md and bench/results.json (names: only those)
bench *NAMES: setup
    LOOPD_LLAMA_SERVER="$({{py}} scripts/assets.py server-path)" \
    LOOPD_MODEL="$({{py}} scripts/assets.py model-path)" UV="{{uv}}" \
    LOOPD_TEMPLATES="$(UV="{{uv}}" {{py}} scripts/assets.py templates-path)" \
    LOOPD_CHAT_CASES="$(UV="{{uv}}" {{py}} scripts/assets.py chat-cases-path)" \
    PYTHONPATH=tests:bench {{py}} bench/run.py "$@"

# Write the generated docs (config reference, protocol schemas) from the code
docs: setup
    {{py}} -c 'from loopd.config import reference; print(reference(), end="")' > docs/config.md
    {{py}} -c 'import json; from loopd.wire.proto import json_schema; print(json.dumps(json_schema("client"), indent=1))' > docs/protocol-client.schema.json
    {{py}} -c 'import json; from loopd.wire.proto import json_schema; print(json.dumps(json_schema("daemon"), indent=1))' > docs/protocol-daemon.schema.json
