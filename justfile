# loopd's tasks. `just` lists them.

set shell := ["bash", "-euo", "pipefail", "-c"]
# Arguments reach commands as "$@", quoted as the user typed them.
set positional-arguments := true

py := ".venv/bin/python"
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
    .venv/bin/loopd serve "$@"

# `continue` (just 1.54): a Ctrl-C that bxctl took (it cancels the turn) does not fail the
# recipe; bxctl's own exit status is `just chat`'s, and bxctl has said why already.

# Chat with the model: bxctl starts loopd on the bundled server and model if none runs (arguments go to `bxctl chat`)
[continue]
[no-exit-message]
chat *ARGS: setup
    #!/usr/bin/env bash
    set -euo pipefail
    # The set-up named the bundled llama-server and model for this checkout's loopd
    # (loopd.bundled). A new session works in the folder `just chat` was run from, as
    # `bxctl chat` run there.
    cd "{{invocation_directory()}}"
    exec "{{justfile_directory()}}/.venv/bin/bxctl" chat "$@"

# Stop the loopd that `just chat` (or another bxctl) started, and wait until it has exited
stop:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ -x .venv/bin/bxctl ]; then exec .venv/bin/bxctl stop; fi
    echo "no loopd started by bxctl is running"

# The cache property on a real llama-server: four turns with a loopd restart ($LOOPD_SERVER_URL, else the bundled one)
device-check *ARGS: setup
    {{py}} scripts/device_check.py "$@"

# Run the whole test suite (real llama-server and vLLM tests and llama.cpp's own parser cases included)
test *ARGS: setup
    LOOPD_LLAMA_SERVER="$({{py}} scripts/assets.py server-path)" \
    LOOPD_MODEL="$({{py}} scripts/assets.py model-path)" \
    LOOPD_TEMPLATES="$(UV="{{uv}}" {{py}} scripts/assets.py templates-path)" \
    LOOPD_CHAT_CASES="$(UV="{{uv}}" {{py}} scripts/assets.py chat-cases-path)" \
    LOOPD_SWA_MODEL="$(UV="{{uv}}" {{py}} scripts/assets.py candidate-path gemma3-270m)" \
    LOOPD_ACPX="$({{py}} scripts/assets.py acpx-path)" \
    LOOPD_VLLM_PYTHON="$({{py}} scripts/assets.py vllm-python-path)" \
    LOOPD_VLLM_MODEL="$({{py}} scripts/assets.py vllm-model-path)" \
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

# Print Zed's settings for loopd (this checkout's bxctl, the bundled llama-server and model)
zed: setup
    @{{py}} scripts/assets.py zed-settings

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
    LOOPD_SWA_MODEL="$(UV="{{uv}}" {{py}} scripts/assets.py candidate-path gemma3-270m)" \
    LOOPD_VLLM_PYTHON="$({{py}} scripts/assets.py vllm-python-path)" \
    LOOPD_VLLM_MODEL="$({{py}} scripts/assets.py vllm-model-path)" \
    PYTHONPATH=tests:bench {{py}} bench/run.py "$@"

# Write the generated docs (config reference, protocol schemas) from the code
docs: setup
    {{py}} -c 'from loopd.config import reference; print(reference(), end="")' > docs/config.md
    {{py}} -c 'import json; from loopd.wire.proto import json_schema; print(json.dumps(json_schema("client"), indent=1))' > docs/protocol-client.schema.json
    {{py}} -c 'import json; from loopd.wire.proto import json_schema; print(json.dumps(json_schema("daemon"), indent=1))' > docs/protocol-daemon.schema.json
