"""loopd's configuration: one TOML file, validated with pydantic, defaults for everything.

With no file at all loopd runs the embedded default: it starts its own llama-server with the
model named by `[server.managed]` (or `$LOOPD_MODEL`). Every mistake in a file is reported as
one line per problem naming the file, the line when it can be found, the table and the key,
in the order of the file's lines; never a traceback. An unknown table or key is named with
the one most like it. Each value must be of the TOML type its key wants: `true`, not `"yes"`
or `1`; `5`, not `"5"` or `5.0` (a whole number does where a number of seconds is wanted).

Where the file is: `--config FILE`, else `$LOOPD_CONFIG`, else `config.toml` in the user's
config directory (`~/.config/loopd/` on Linux) when it exists.
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import json
import re
import tomllib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import platformdirs
import tomli_w
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from loopd.locations import APP, config_path, default_socket, default_store
from loopd.session.baseline import DEFAULT_SYSTEM_PROMPT
from loopd.session.records import DataClass

__all__ = [
    "KEPT_ENV",
    "SECRETS",
    "Action",
    "AgentsConfig",
    "ChannelConfig",
    "Config",
    "ConfigError",
    "FetchConfig",
    "Hook",
    "HooksConfig",
    "LoopConfig",
    "ManagedServer",
    "McpServer",
    "ModelConfig",
    "Policy",
    "RetryConfig",
    "RunConfig",
    "ServerConfig",
    "SessionConfig",
    "SlotsConfig",
    "StoreConfig",
    "ToolHook",
    "ToolsConfig",
    "config_path",
    "dump_toml",
    "load_config",
    "private_paths",
    "user_instructions",
]

Action = Literal["allow", "ask", "deny"]


class ConfigError(Exception):
    """The config file is missing, not TOML, or not a valid config: the message says where."""


def _path(value: object) -> object:
    """A path as TOML writes it, a string. The file is validated strictly (no `"yes"` for
    true, no `"5"` for 5), where pydantic would take nothing but a `Path` object."""
    if isinstance(value, str):
        return Path(value)
    if isinstance(value, Path):
        return value
    raise PydanticCustomError("string_type", "Input should be a valid string")


TomlPath = Annotated[Path, BeforeValidator(_path)]
"""A path, written as a string."""


class _Table(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, use_attribute_docstrings=True
    )


class RetryConfig(_Table):
    attempts: PositiveInt = 5
    """Tries in all of a summary's request on connect failures and 503 (model loading). A
    turn's request is tried until the server takes it or `[loop] turn_timeout` passes."""
    base: PositiveFloat = 0.5
    """Seconds before the second try; doubled each time, with jitter."""
    cap: PositiveFloat = 8.0
    """The longest wait between tries, in seconds."""


class ManagedServer(_Table):
    """The llama-server loopd starts itself when `[server] url` is not set."""

    binary: TomlPath | None = None
    """The llama-server binary; default `$LOOPD_LLAMA_SERVER`, then `llama-server` on PATH."""
    model: TomlPath | None = None
    """The GGUF model; default `$LOOPD_MODEL`."""
    n_ctx: PositiveInt = 8192
    """Context size of each slot, in tokens (`[server] slots` of them)."""
    threads: PositiveInt | None = None
    """CPU threads for llama-server; unset: its own default."""
    chat_template_file: TomlPath | None = None
    """A Jinja chat template to use instead of the model's own."""
    extra_args: list[str] = []
    """More llama-server arguments, appended as given."""


def _urls(value: object) -> object:
    """One URL or a list of them, each http(s)."""
    urls = [value] if isinstance(value, str) else value
    if isinstance(urls, list):
        if not urls:
            raise ValueError("name at least one server")
        for url in urls:
            if isinstance(url, str) and not re.match(r"https?://", url):
                raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return urls


def _header_name(name: str) -> str:
    """An HTTP header's name (RFC 9110's token), or empty."""
    if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]*", name):
        raise ValueError(f"{name!r} is not a header's name (letters, digits and - only)")
    return name


Urls = Annotated[list[str], BeforeValidator(_urls)]
"""One URL, or a list of them."""


def _scalar(value: object) -> object:
    """A number, a string or a boolean: one error for anything else, not one per kind."""
    if not isinstance(value, int | float | str):
        raise PydanticCustomError("sampling_type", "must be a number, a string, true or false")
    return value


Sampling = Annotated[float | int | bool | str, BeforeValidator(_scalar)]
"""A value sent as it is in a request's sampling fields."""


class ServerConfig(_Table):
    url: Urls | None = None
    """An llama-server loopd does not manage, e.g. `http://gpu-box:8080`; or a list of them,
    serving the same model, whose slots join one pool (docs/operations.md)."""
    managed: ManagedServer = ManagedServer()
    engine: Literal["llama", "vllm", "openai"] | None = None
    """What serves `url`: `llama` (llama.cpp's llama-server), `vllm` (token-exact, like
    llama-server), or `openai` (any OpenAI-compatible server: history as messages). Unset:
    found from the server itself (`/props` is llama-server's; `/v1/models` names vLLM as its
    owner; any other answer there is OpenAI-compatible)."""
    model: str | None = None
    """The model to ask an OpenAI-compatible server or vLLM for (the `model` field); unset:
    the first its `/v1/models` lists."""
    api_key_env: str | None = None
    """The environment variable that holds the server's API key, sent as `Authorization:
    Bearer ...`; the key itself is never written to a log or a record."""
    affinity_header: Annotated[str, AfterValidator(_header_name)] = "X-Session-ID"
    """The header each request names its session in, for a router in front of several
    servers that keeps a session on the one holding its cache (docs/operations.md, "On a
    cluster"). It goes to every server, a hosted API's too; an empty string sends none."""
    block_size: PositiveInt | None = None
    """vLLM's cache block in tokens, where loopd cannot read it from the server's `/metrics`
    (a router in front of vLLM): the grain of the cache figure's limit (docs/cache.md).
    Unset: read from the server."""
    connect_timeout: PositiveFloat = 5.0
    """Seconds to make the TCP connection."""
    queue_timeout: PositiveFloat = 600.0
    """Seconds to wait for the slot to start on a request (the server says nothing meanwhile)."""
    read_timeout: PositiveFloat = 120.0
    """The longest silence in a stream, in seconds (the server pings every 30 s)."""
    retry: RetryConfig = RetryConfig()

    @property
    def urls(self) -> list[str]:
        """The external servers, none for the embedded one."""
        return list(self.url or ())

    slots: PositiveInt = 4
    """Slots loopd lends to its sessions, one each while it runs a turn, kept while it is idle
    (its cache stays hot): the embedded llama-server starts with this many (`-np`, each with
    `n_ctx`); of an external server's slots (`GET /slots`), loopd uses at most this many. vLLM
    and OpenAI-compatible servers have no slots (their cache is shared by every request):
    there, this many turns run at once on each server."""
    sampling: dict[str, Sampling] = {}
    """Sent with every request, e.g. `{temperature = 0.7, top_p = 0.9}`; unset fields keep
    llama-server's own defaults (its flags, else the model file's). `just chat` and `just
    serve` start the embedded llama-server at temperature 0 (`LLAMA_ARG_TEMPERATURE`), where
    the tiny bundled model answers best; set `temperature` here for a model of your own."""


class ModelConfig(_Table):
    """One model loopd serves beside others (`[models.NAME]`), each on its own server(s): an
    external one (`url`) or a llama-server loopd starts itself (`model`). A session runs on
    one of them at a time, chosen per session (docs/operations.md, "Several models"); the
    rest of `[server]` (engine, timeouts, sampling) holds for every model."""

    url: Urls | None = None
    """Servers of this model that loopd does not manage, as `[server] url`."""
    model: TomlPath | None = None
    """The GGUF model of a llama-server loopd starts for this model."""
    binary: TomlPath | None = None
    """Its llama-server binary; default as `[server.managed] binary`."""
    n_ctx: PositiveInt = 8192
    """Context size of each of its slots, in tokens."""
    slots: PositiveInt | None = None
    """Slots of this model's server(s) loopd lends; default `[server] slots`."""
    threads: PositiveInt | None = None
    """CPU threads for its llama-server; unset: its own default."""
    chat_template_file: TomlPath | None = None
    """A Jinja chat template to use instead of the model's own."""
    extra_args: list[str] = []
    """More llama-server arguments, appended as given."""

    @model_validator(mode="after")
    def _one_kind(self) -> ModelConfig:
        if (self.url is None) == (self.model is None):
            which = "both" if self.url is not None else "neither"
            raise ValueError(
                f"set url (servers of this model loopd does not manage) or model (a GGUF file "
                f"for a llama-server loopd starts), not {which}"
            )
        return self

    def managed(self) -> ManagedServer:
        """Its llama-server, as `[server.managed]` would say it."""
        return ManagedServer(
            binary=self.binary,
            model=self.model,
            n_ctx=self.n_ctx,
            threads=self.threads,
            chat_template_file=self.chat_template_file,
            extra_args=self.extra_args,
        )


class SlotsConfig(_Table):
    save: Literal["turn", "stop", "never"] = "turn"
    """When the slot's KV cache is saved to a file named by the session, so it can come back:
    `turn` after each turn once loopd is idle (a crash loses no cache), `stop` only when loopd
    stops and when it leaves a session, `never` (no slot files at all: nothing is restored
    either). Needs llama-server's `--slot-save-path` (the embedded one has it)."""
    keep_bytes: PositiveInt = 8 * 1024**3
    """Slot files loopd keeps at most, in bytes; the oldest go first. Applies to the embedded
    llama-server's files (an external server keeps its own)."""


class SessionConfig(_Table):
    max_live: PositiveInt = 64
    """Sessions served at once (each with a client attached or a turn running); a client that
    opens one more is refused with `too_many_sessions`."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """Written into each new session's baseline; existing sessions keep theirs."""
    instructions_bytes: NonNegativeInt = 32 * 1024
    """Bytes of `AGENTS.md` files a new session's system prompt carries in all: the user's own
    (`AGENTS.md` in loopd's config folder) and the project's, from the session's folder up to
    its root in `[tools] roots` (docs/tools.md). Given out nearest file first; a file past it
    is cut, and the prompt says where. Read once, when the session is made: a change to a file
    applies to new sessions only. 0: none is read."""
    history: Literal["exact", "template"] = "exact"
    """`exact`: each request is the previous one token for token, plus what is new, so the
    server recomputes nothing it holds (docs/cache.md). `template`: history goes as messages
    and the server's template renders it anew each time, dropping what the template drops
    (past reasoning, for many); the losses are recorded. A template loopd cannot read for an
    exact prompt (its tool calls in none of the shapes docs/cache.md lists) is served as
    `template`."""
    on_full: Literal["stop", "continue"] = "continue"
    """When a message no longer fits the context: `continue` asks the model for a summary of
    the session (on another slot of the pool where one is idle), starts a new session that
    continues it from that summary, and answers the message there; the old log stays as it
    was. `stop` ends the turn with `session_full`. A client can compact at any time
    (`/compact` in bxctl)."""
    summary_tokens: PositiveInt = 1024
    """Tokens a compaction's summary may take; it opens the new session's context."""
    model: str | None = None
    """The `[models.NAME]` a new session runs on; unset: the first of them. A client changes
    it per session (`set_mode`)."""


class LoopConfig(_Table):
    tool_iterations: PositiveInt = 10
    """Rounds of tool calls in one turn before it stops with `turn_limit`."""
    repeat_detection: bool = True
    """Refuse a call repeated with the same arguments in a turn; stop at the second repeat."""
    thinking: bool = True
    """Let the model reason before it answers, where its template can turn that on or off
    (`enable_thinking`); a client can turn it off for one turn."""
    thinking_cap: PositiveInt = 4096
    """Reasoning tokens allowed per request."""
    max_tokens: PositiveInt = 8192
    """Tokens one answer may generate, reasoning included (`finish_reason` `length`)."""
    repetition_cap: NonNegativeInt = 2000
    """An answer (or its reasoning) whose last this many characters are one piece of text, up
    to 400 characters long, said over and over is cut there, long before `max_tokens`: the turn
    ends as `turn_limit`, what was said stays in the log. A small model caught in a loop
    ("She loves her cat. She loves her cat. ...") stops after about 500 tokens instead of 8,192.
    0: never cut."""
    tool_result_cap: PositiveInt = 16_000
    """Characters of a tool result the model sees: its head and its tail, the middle cut with
    a marker."""
    turn_timeout: PositiveFloat = 900.0
    """Seconds one turn may take, tool calls included."""


class AgentsConfig(_Table):
    """Sub-agents: the `delegate` tool hands a task to a new session on a slot of its own."""

    depth: NonNegativeInt = 1
    """How deep delegation goes: 1, a session may delegate and its sub-agents may not; 0, no
    `delegate` tool at all."""
    at_once: PositiveInt | None = None
    """Sub-agents running at once in all of loopd; more are refused until one answers. Unset:
    the pool's slots less one. A sub-agent also needs a slot idle when it starts (it never
    waits for one: the turns holding the others may be waiting for sub-agents)."""
    per_turn: PositiveInt = 8
    """Sub-agents one turn may start; more are refused."""
    tool_iterations: PositiveInt = 10
    """A sub-agent's rounds of tool calls (its `[loop] tool_iterations`)."""
    thinking_cap: PositiveInt = 2048
    """A sub-agent's reasoning tokens per request."""
    repetition_cap: NonNegativeInt = 2000
    """A sub-agent's `[loop] repetition_cap`."""
    turn_timeout: PositiveFloat = 300.0
    """Seconds a sub-agent's turn may take; the delegating turn's own `[loop] turn_timeout`
    still bounds it and all its siblings."""

    def loop(self, parent: LoopConfig) -> LoopConfig:
        """A sub-agent's limits: these, the rest as its parent's."""
        return parent.model_copy(
            update={
                "tool_iterations": self.tool_iterations,
                "thinking_cap": self.thinking_cap,
                "repetition_cap": self.repetition_cap,
                "turn_timeout": self.turn_timeout,
            }
        )


class ChannelConfig(_Table):
    socket: TomlPath = Field(default_factory=default_socket)
    """The Unix socket clients connect to (made 0600, in a 0700 directory). Started by systemd's
    socket activation, loopd listens on the socket systemd passes instead: make its
    `ListenStream=` this path."""
    max_line: PositiveInt = 1 << 20
    """The longest line a client may send, in bytes."""
    subscriber_buffer: PositiveInt = 1024
    """Events buffered per client; a client further behind is dropped with `lagged`."""
    outbox_bytes: PositiveInt = 16 << 20
    """Bytes of answers waiting for one client; a client that lets more pile up (asks and
    never reads) is dropped."""
    max_clients: PositiveInt = 64
    """Connections at once; one more is answered `too_many_clients` and closed."""
    queue_limit: PositiveInt = 8
    """Messages that may wait while a turn runs; more are refused with `busy`."""


class StoreConfig(_Table):
    directory: TomlPath = Field(default_factory=default_store)
    """Where session logs live, one `<id>.jsonl` each."""


class Policy(_Table):
    action: Action = "allow"
    """`allow` runs the call, `deny` refuses it, `ask` waits for a person to approve it
    (`[tools] approval_timeout`; `a` in bxctl approves that tool for the rest of the
    session)."""
    data_class: DataClass = Field(default="public", alias="class")
    """What the results hold: `public`, `private` or `secret`."""
    untrusted: bool = False
    """Results come from outside (web pages, mail): the model sees them marked as data."""


def _mcp_url(url: str) -> str:
    if not re.match(r"https?://[^/?#]", url):
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return url


class McpServer(_Table):
    """One MCP server: a program loopd runs (`command`) or one that runs elsewhere (`url`)."""

    command: list[str] | None = Field(default=None, min_length=1)
    """The server's command line, run over stdio. Set this or `url`, not both."""
    env: dict[str, str] = {}
    """Environment variables for the server, added to loopd's own (with `command`)."""
    url: Annotated[str, AfterValidator(_mcp_url)] | None = None
    """The server's http:// or https:// URL, reached over streamable HTTP, or over SSE where
    the server refuses that (`transport`). Set this or `command`, not both."""
    transport: Literal["auto", "http", "sse"] = "auto"
    """With `url`: `http` (streamable HTTP), `sse` (the older HTTP with server-sent events),
    or `auto`: streamable HTTP, else SSE where the server answers 400, 404 or 405."""
    headers: dict[Annotated[str, AfterValidator(_header_name)], str] = Field(default={}, repr=False)
    """With `url`: headers sent with every request to the server."""
    bearer_token_env: str | None = Field(default=None, min_length=1)
    """With `url`: the environment variable that holds a token, sent as `Authorization: Bearer
    ...`; the token is never written to a log or a record. loopd does not start where the
    variable is not set."""
    policy: Policy = Policy()
    """The policy of every tool of this server (a per-tool policy wins). Without an `action`
    here or in `[tools.policies]`, its tools ask before they run."""

    @model_validator(mode="after")
    def _one_way_in(self) -> McpServer:
        if self.command is not None and self.url is not None:
            raise ValueError("set command or url, not both")
        if self.command is None and self.url is None:
            raise ValueError(
                "set command (a program loopd runs over stdio) or url (a server over HTTP)"
            )
        # By value, not by the keys written: check-config's dump spells out every default.
        if self.url is None and (self.headers or self.bearer_token_env or self.transport != "auto"):
            raise ValueError("transport, headers and bearer_token_env are for a server with a url")
        if self.command is None and self.env:
            raise ValueError("env is for a server with a command (one at a url has its own)")
        return self


SECRETS = (
    *("~/.ssh", "~/.gnupg", "~/.aws", "~/.azure", "~/.config/gcloud", "~/.kube", "~/.docker"),
    *("~/.netrc", "~/.git-credentials", "~/.pypirc", "~/.npmrc", "~/.config/gh"),
    *("~/.cargo/credentials.toml", "~/.password-store", "~/.local/share/keyrings"),
)
"""The user's keys and tokens, which sandboxed commands cannot read unless `allow_read` says."""

KEPT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ")
"""Variables of loopd's environment a command gets (and every `LC_*`); nothing else."""


def _secret(path: Path) -> Path:
    if str(path) not in SECRETS and path.expanduser() not in {
        Path(s).expanduser() for s in SECRETS
    }:
        raise ValueError(f"{path} is not one of the paths hidden by default: {', '.join(SECRETS)}")
    return path


_LABEL = r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?"
_DOMAIN = re.compile(rf"(?:\*\.)?(?:{_LABEL}\.)*{_LABEL}")


def _domain(value: str) -> str:
    """A host pattern of `[tools.fetch]` and `[tools.run] network`, as matched: a name
    (lowercase, no final dot), `*.` and a name, an IP address or a network."""
    text = value.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_network(text, strict=False))
    if not _DOMAIN.fullmatch(text):
        raise ValueError(
            f"{value!r} is not a domain: write example.com, *.example.com (the names under "
            "it), an IP address or a network such as 10.0.0.0/8; no scheme, port or path"
        )
    return text


Domain = Annotated[str, AfterValidator(_domain)]
"""A host pattern (`_domain`)."""


def _network(value: object) -> object:
    """`true`, `false` or a list: anything else is named as a wrong boolean, once (not once
    per member of the union)."""
    if isinstance(value, bool | list):
        return value
    raise PydanticCustomError("bool_type", "Input should be a valid boolean")


class FetchConfig(_Table):
    """`fetch_url`: web pages and files over HTTP(S), for the model to read."""

    allow: list[Domain] = []
    """Domains `fetch_url` reaches without asking: `example.com` (that name alone),
    `*.example.com` (every name under it, not `example.com` itself), an IP address, or a
    network (`10.0.0.0/8`). A domain on neither list asks. Loopback, private and link-local
    addresses (127.0.0.1, 10.x, 192.168.x, 169.254.169.254, fd00::/8, ...) are refused unless
    named here by address or network, whatever name leads to them."""
    deny: list[Domain] = []
    """Domains (patterns as `allow`'s) `fetch_url` refuses without asking; it wins over
    `allow`."""
    max_bytes: PositiveInt = 2 << 20
    """Bytes of a response's body read at most; the rest is cut, saying so."""
    timeout: PositiveFloat = 20.0
    """Seconds a fetch may take in all, redirects included."""
    max_redirects: NonNegativeInt = 5
    """Redirects followed at most, each to a URL checked as the first was."""


class RunConfig(_Table):
    """`run_command`: shell commands in a folder under the roots."""

    sandbox: Literal["bubblewrap", "none"] = "bubblewrap"
    """`bubblewrap`: each command in a `bwrap` sandbox: the filesystem read-only but the roots
    and a private /tmp; nothing of loopd (its socket, state and config hidden) nor the user's
    keys (`deny_read`); no Unix sockets, no privilege (a user namespace, no capabilities, a
    seccomp filter), no network unless `network`, a bounded process tree, a clean environment;
    the roots' `.git` folders read-only (`git_writable`). Refused where `bwrap` or
    libseccomp is missing. `none`: commands run unconfined, as the user."""
    network: Annotated[bool | list[Domain], BeforeValidator(_network)] = False
    """Whether sandboxed commands reach the network: `true` all of it, `false` none (not
    even 127.0.0.1), or a list of domains (patterns as `[tools.fetch] allow`'s): then the
    command's only way out is an HTTP(S) proxy of loopd's (`HTTP_PROXY`, `HTTPS_PROXY` are
    set) that reaches those domains alone, and loopback or private addresses only where the
    list names them by address."""
    timeout: PositiveFloat = 120.0
    """Seconds a command may run at most (the model may ask for less); then it is killed,
    with every process it started."""
    deny_read: list[TomlPath] = []
    """More files and folders sandboxed commands cannot read (a folder shows empty, a file
    cannot be opened) and the file tools cannot reach, besides
    loopd's own and the user's keys: `~/.ssh`, `~/.gnupg`, `~/.aws`, `~/.azure`,
    `~/.config/gcloud`, `~/.kube`, `~/.docker`, `~/.netrc`, `~/.git-credentials`, `~/.pypirc`,
    `~/.npmrc`, `~/.config/gh`, `~/.cargo/credentials.toml`, `~/.password-store`,
    `~/.local/share/keyrings`."""
    allow_read: list[Annotated[TomlPath, AfterValidator(_secret)]] = []
    """Paths of that default list that commands may read after all, on purpose."""
    env: dict[str, str] = {}
    """Environment variables for commands. Besides these they get only `PATH`, `HOME`,
    `USER`, `LOGNAME`, `SHELL`, `LANG`, `LANGUAGE`, `LC_*`, `TERM`, `TZ` of loopd's own and
    `TMPDIR=/tmp`: no token or key loopd was started with."""
    max_processes: PositiveInt = 1024
    """Processes (threads count) a command's whole tree may have at once; a fork past it
    fails."""
    max_memory_mb: PositiveInt = 8192
    """Memory (MiB of data) each process of a command may take; an allocation past it fails."""
    git_writable: bool = False
    """Whether commands may write the `.git` folders in the roots (commit, fetch, switch
    branches). False: each is read-only to them, because its hooks and config name programs
    git runs as the person, outside any sandbox; with true, a command can plant one."""


class ToolsConfig(_Table):
    roots: list[TomlPath] = []
    """Directories the built-in file tools may read, write and run commands in; nothing
    outside them. A client that opens a session in a folder (an editor's `session/new`
    always does) is refused any folder outside them. Unset, such a folder is that session's
    one root, as a coding agent's working folder is: any folder but `/`, the home folder
    itself, one inside the user's keys, or one that holds or is in loopd's own files; a
    session opened with no folder (`bxctl chat` run in a folder loopd refuses) has no file tools
    that work. The hidden paths
    (loopd's own files, the keys, `[tools.run] deny_read`), `.git` kept from writes and the
    command sandbox apply the same either way."""
    timeout: PositiveFloat = 30.0
    """Seconds one tool call may take (`run_command`: `[tools.run] timeout`)."""
    find_limit: PositiveInt = 5
    """Matches `find_tool` returns at most."""
    policies: dict[str, Policy] = {}
    """Per tool name or per source (an MCP server's name, or `builtin`); a tool's own table wins
    over its source's, then an MCP server's `policy`; without any, a built-in tool is allowed
    and an MCP server's tool asks. `write_file`, `edit_file` and
    `run_command` ask unless their own table sets `action`: the `builtin` table can make them
    deny, never allow (its `class` and `untrusted` apply as to any tool), and their own table
    without `action` keeps them asking. `loopd check-config` lists which tools run without
    asking."""
    class_actions: dict[DataClass, Action] = {}
    """The least action for tools whose results have this class, whatever their own policy
    says: `{ secret = "ask" }` asks before any call that would read secret data. The stricter
    of the two wins (deny over ask over allow)."""
    approval_timeout: PositiveFloat = 300.0
    """Seconds a call waits for a person's approval before it is denied. The wait counts
    toward `[loop] turn_timeout`."""
    mcp: dict[str, McpServer] = {}
    """MCP servers, by name, over stdio or at a URL; their tools join the registry."""
    run: RunConfig = RunConfig()
    fetch: FetchConfig = FetchConfig()


def _matcher(pattern: str) -> str:
    if pattern not in ("", "*"):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
    return pattern


class Hook(_Table):
    command: list[str] = Field(min_length=1)
    """The hook's command line, run with no shell (`["sh", "-c", "..."]` for one): as the
    user, not sandboxed, in the session's folder (else the home folder), with loopd's
    environment and the event as one JSON object on stdin (docs/hooks.md). Exit status 0 goes
    on, 2 blocks, any other is logged and blocks nothing."""
    timeout: PositiveFloat = 60.0
    """Seconds it may run; then it is killed with every process of its group, and the turn
    goes on as if it had failed."""


class ToolHook(Hook):
    matcher: Annotated[str, AfterValidator(_matcher)] = ""
    """A regular expression the tool's name must match whole (`run_command`,
    `.*_file`, `calendar\\..*`); empty or `*`: every tool. The name is the tool
    `call_tool` asks for (or `find_tool`)."""


class HooksConfig(_Table):
    """Commands of the user's own at four points of every turn, as Claude Code's and Codex's
    hooks: `[[hooks.pre_tool_use]]` tables, each a `command`, a `timeout`, and for tool events
    a `matcher`."""

    pre_tool_use: list[ToolHook] = []
    """Run before a tool call (before it asks for approval): exit status 2 stops the call, and
    the model reads the hook's stderr as its result."""
    post_tool_use: list[ToolHook] = []
    """Run after a tool call: its stdout (exit status 0), or its stderr (2), is added to the
    call's result the model reads."""
    user_prompt_submit: list[Hook] = []
    """Run as a user message enters a turn: its stdout (exit status 0) is added to the message;
    exit status 2 refuses the message (the turn fails with the hook's stderr, and the message
    never enters the log)."""
    stop: list[Hook] = []
    """Run as a turn ends with an answer: exit status 2 sends the model back to work with the
    hook's stderr as a user message (each time one round of `[loop] tool_iterations`; the hook
    reads `stop_hook_active` true once it has)."""


class Config(_Table):
    server: ServerConfig = ServerConfig()
    slots: SlotsConfig = SlotsConfig()
    session: SessionConfig = SessionConfig()
    loop: LoopConfig = LoopConfig()
    agents: AgentsConfig = AgentsConfig()
    channel: ChannelConfig = Field(default_factory=ChannelConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    tools: ToolsConfig = ToolsConfig()
    hooks: HooksConfig = HooksConfig()
    models: dict[str, ModelConfig] = {}
    """Several models, each on its own server(s), chosen per session; none: the one model of
    `[server]`."""

    @model_validator(mode="after")
    def _models_known(self) -> Config:
        for name in self.models:  # in slot files' names
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(
                    f"[models.{json.dumps(name)}]: a model's name is letters, digits, _ and - only"
                )
        if self.models and self.server.url is not None:
            raise ValueError(
                "[server] url and [models] both name servers: put each url in its model's "
                "[models.NAME] table"
            )
        if self.session.model is not None and self.session.model not in self.models:
            known = ", ".join(self.models) or "none is configured"
            raise ValueError(
                f"[session] model: {self.session.model!r} is not a [models.NAME] table ({known})"
            )
        return self

    @property
    def default_model(self) -> str | None:
        """The model new sessions run on; None: `[server]`'s one unnamed model."""
        return self.session.model or next(iter(self.models), None)


STATE_ENTRIES = ("file-history", "slot-files", "slots", "llama-server.log", "loopd.log")
"""What loopd keeps in its state folder (`[store] directory`'s parent) beside the sessions."""


def private_paths(config: Config, socket: Path, config_file: Path | None) -> list[Path]:
    """loopd's own files, which its tools and the commands they run never reach: its state
    folder (session logs, the undo store, slot files, logs), its socket, its config. A folder
    here that holds a tool root or the home folder is not hidden whole (the tools' `Roots`
    and the sandbox skip it): the entries listed beside it still are."""
    state = config.store.directory.parent
    return [
        state,
        config.store.directory,
        *(state / name for name in STATE_ENTRIES),
        socket.parent,
        socket,
        platformdirs.user_config_path(APP),
        platformdirs.user_state_path(APP),
        *([config_file] if config_file is not None else []),
    ]


def user_instructions() -> Path:
    """The user's own `AGENTS.md`, which every new session's baseline carries where it exists
    (`$XDG_CONFIG_HOME/loopd/AGENTS.md`)."""
    return platformdirs.user_config_path(APP) / "AGENTS.md"


def user_skills() -> Path:
    """The user's own skills, one folder each (`$XDG_CONFIG_HOME/loopd/skills/NAME/SKILL.md`):
    every session has them among its tools (`loopd.tools._skills`)."""
    return platformdirs.user_config_path(APP) / "skills"


def user_commands() -> Path:
    """The user's own slash commands (`$XDG_CONFIG_HOME/loopd/commands/NAME.md`), which
    `bxctl chat` and `bxctl acp` offer in every session."""
    return platformdirs.user_config_path(APP) / "commands"


def load_config(explicit: Path | None = None) -> tuple[Config, Path | None]:
    """The effective config and the file it came from (None: defaults only)."""
    path, named = config_path(explicit)
    if path is None:
        return Config(), None
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if named:
            raise ConfigError(f"{path}: no such config file") from None
        return Config(), None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    try:
        # Strict: a value of the wrong TOML type is a mistake, not something to guess at
        # ("yes" for true, "5" for 5, 5.0 for 5).
        return Config.model_validate(data, strict=True), path
    except ValidationError as e:
        raise ConfigError(_problems(path, text, e.errors())) from None


def _problems(path: Path, text: str, errors: list[Any]) -> str:
    """One line per mistake, in the order of the file's lines (those without a line last)."""
    lines = _lines_of(text)
    # A value that fits no member of a union fails each: one mistake, said once.
    by_key: dict[tuple[str | int, ...], list[Any]] = {}
    for error in errors:
        loc = _untagged(error["loc"])
        by_key.setdefault(loc, []).append({**error, "loc": loc})
    found = []
    for group in by_key.values():
        if len(group) > 1 and all(e["type"] in _WANTED for e in group):
            group = [{**group[0], "kinds": [e["type"] for e in group]}]  # noqa: PLW2901
        found += [_located(path, lines, error) for error in group]
    return "\n".join(message for *_, message in sorted(found, key=lambda f: f[:2]))


def _located(path: Path, lines: dict[tuple[str, ...], int], error: Any) -> tuple[bool, int, str]:
    """A mistake's line (sorted last when it has none), and what to say of it."""
    names = tuple(str(part) for part in error["loc"])
    line = next((lines[names[:n]] for n in range(len(names), 0, -1) if names[:n] in lines), None)
    where = f"{path}:{line}" if line is not None else str(path)
    return (line is None, line or 0, f"{where}: {_describe(error)}")


def _untagged(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """`loc` without the names pydantic gives a union's members (`bool`, `list[str]`), which
    are no key of the file."""
    out: list[str | int] = []
    model: type[BaseModel] | None = Config
    parts = iter(loc)
    for part in parts:
        out.append(part)
        field = model.model_fields.get(str(part)) if model is not None else None
        annotation = field.annotation if field is not None else None
        if get_origin(annotation) is dict:  # a table of named ones: the next part is a name
            out += [name for name in [next(parts, None)] if name is not None]
            annotation = get_args(annotation)[-1]
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        members = [a for a in get_args(annotation) if a is not type(None)]
        if get_origin(annotation) in (Union, UnionType) and len(members) > 1:
            out += [p for p in [next(parts, None)] if isinstance(p, int)]  # a tag is skipped
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return tuple(out)


_PREFIX = re.compile(r"^(Value error|Assertion failed), ")
"""What pydantic puts before the message of an error a validator raised."""

_WANTED = {
    "bool_type": "true or false",
    "int_type": "a whole number",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a table",
    "model_type": "a table",
}
"""What a value of the wrong TOML type should have been, by pydantic's error type."""


def _describe(error: Any) -> str:
    loc = list(error["loc"])
    if error["type"] == "extra_forbidden":
        *table, key = (str(part) for part in loc)
        hint = difflib.get_close_matches(key, _known_keys(table), n=1)
        if isinstance(error["input"], dict):
            better = f" (did you mean [{_dotted([*table, hint[0]])}]?)" if hint else ""
            return f"[{_dotted([*table, key])}] is not a table loopd knows{better}"
        if not table:
            better = f"did you mean [{hint[0]}]?" if hint else "every key goes in a table"
            return f"{key}: unknown key at the top of the file ({better})"
        better = f" (did you mean {hint[0]!r}?)" if hint else ""
        return f"[{_dotted(table)}] {key}: unknown key{better}"
    if not any(isinstance(part, str) for part in loc):  # of the whole file (`Config`'s own)
        return _PREFIX.sub("", error["msg"])
    # The key is the last name; list indexes after it are shown as [0].
    last = max(i for i, part in enumerate(loc) if isinstance(part, str))
    key = str(loc[last]) + "".join(f"[{i}]" for i in loc[last + 1 :])
    table = [str(part) for part in loc[:last]]
    if error["type"] in _WANTED:
        value = error["input"]
        kinds = error.get("kinds", [error["type"]])
        wanted = " or ".join(_WANTED[kind] for kind in kinds)
        message = f"must be {wanted}, not {_toml_kind(value)}"
        if isinstance(value, str) and any(_unquoted(kind, value) for kind in kinds):
            message += f" (write it without quotes: {value})"
    else:
        message = _PREFIX.sub("", error["msg"])
    return f"[{_dotted(table)}] {key}: {message}" if table else f"{key}: {message}"


def _toml_kind(value: object) -> str:
    """A TOML value as a person reads its type: `the string "yes"`, `the number 5`."""
    if isinstance(value, str):
        return f"the string {json.dumps(value)}"
    if isinstance(value, bool | int | float):
        return f"the {'boolean' if isinstance(value, bool) else 'number'} {json.dumps(value)}"
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "a table"
    return f"the date or time {value}"  # TOML's last kinds


def _unquoted(kind: str, value: str) -> bool:
    """Whether the string is what was wanted, written in quotes."""
    try:
        data = tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        return False
    wanted = {"bool_type": bool, "int_type": int, "float_type": int | float}.get(kind)
    return wanted is not None and isinstance(data["v"], wanted)


def _dotted(names: list[str]) -> str:
    """Names as a TOML table header writes them, quoted where they must be."""
    return ".".join(n if re.fullmatch(r"[A-Za-z0-9_-]+", n) else json.dumps(n) for n in names)


def _known_keys(loc: list[str]) -> list[str]:
    """The keys of the table at `loc` (none where it is not one of loopd's models)."""
    model: type[BaseModel] = Config
    names = iter(loc)
    for part in names:
        field = model.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        if get_origin(annotation) in (dict, list):  # named ones, or an array: a name, an index
            annotation = get_args(annotation)[-1]
            if next(names, None) is None:
                return []
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [field.alias or name for name, field in model.model_fields.items()]


_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEYS = rf"{_KEY}(?:\s*\.\s*{_KEY})*"
_HEADER = re.compile(rf"\[\[?\s*({_KEYS})\s*\]")
_ASSIGNMENT = re.compile(rf"({_KEYS})\s*=(.*)")


def _lines_of(text: str) -> dict[tuple[str, ...], int]:
    """The line each table and key of the file is first written on, by its names. A table
    `[a.b]` or a key `a.b = 1` also names `a`. Keys inside an inline table are not found:
    a mistake there is shown on the line of the key that holds it."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    arrays: dict[tuple[str, ...], int] = {}
    open_string: str | None = None  # the quotes of a multi-line string not yet closed
    for number, line in enumerate(text.splitlines(), start=1):
        if open_string is not None:
            if line.count(open_string) % 2:
                open_string = None
            continue
        stripped = line.strip()
        if header := _HEADER.match(stripped):
            table = _names(header.group(1))
            if stripped.startswith("[["):  # an array's tables by index, as pydantic names them
                arrays[table] = index = arrays.get(table, -1) + 1
                table = (*table, str(index))
            names = table
        elif assignment := _ASSIGNMENT.match(stripped):
            names = (*table, *_names(assignment.group(1)))
            rest = assignment.group(2)
            open_string = next((q for q in ('"""', "'''") if rest.count(q) % 2), None)
        else:
            continue
        for n in range(1, len(names) + 1):
            lines.setdefault(names[:n], number)
    return lines


def _names(keys: str) -> tuple[str, ...]:
    """`a."b.c"` as the names `a`, `b.c`: read by TOML itself."""
    value: Any = tomllib.loads(f"{keys} = 0")
    names = []
    while isinstance(value, dict):
        ((name, value),) = value.items()
        names.append(name)
    return tuple(names)


def dump_toml(config: Config) -> str:
    """The config as TOML, every default spelled out (unset optional keys left out), but the
    policy tables as written: a key one leaves out is taken from the next table (`policy_for`),
    so spelling out its default would change what the file means when read again."""
    data = config.model_dump(mode="json", by_alias=True, exclude_none=True)
    tools = data["tools"]
    for name, policy in config.tools.policies.items():
        tools["policies"][name] = _as_written(policy)
    for name, server in config.tools.mcp.items():
        tools["mcp"][name]["policy"] = _as_written(server.policy)
    return tomli_w.dumps(data)


def _as_written(policy: Policy) -> dict[str, Any]:
    return policy.model_dump(mode="json", by_alias=True, exclude_unset=True)


def reference() -> str:
    """docs/config.md, made from the models themselves so that it cannot drift from them."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from loopd/config.py by `just docs`; edit the docstrings there. -->",
        "",
        (__doc__ or "").strip(),
        "",
        (
            "`loopd check-config [--config FILE]` prints the effective config, or the mistakes "
            "and exit status 2. Then what it found of the servers and programs loopd would "
            "use, each `[models.NAME]`'s under its name: exit status 1 where a `[server] url` "
            "or a model's `url` cannot be used, an embedded llama-server's binary or model is "
            "missing, or an MCP server's program is not found (not on `PATH`, or not "
            "executable)."
        ),
    ]
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            _reference_table(field.annotation, [name], out)
        elif get_origin(field.annotation) is dict:  # tables of named ones: `[models.NAME]`
            _reference_table(get_args(field.annotation)[-1], [name, "NAME"], out)
    return "\n".join(out) + "\n"


def _reference_table(
    model: type[BaseModel], path: list[str], out: list[str], *, array: bool = False
) -> None:
    """`array`: a list of these tables, TOML's `[[a.b]]`."""
    rows: list[str] = []
    nested: list[tuple[type[BaseModel], list[str], bool]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((annotation, [*path, key], False))
            continue
        origin = get_origin(annotation)
        value_type = get_args(annotation)[-1] if origin in (dict, list) else None
        if isinstance(value_type, type) and issubclass(value_type, BaseModel):
            named = origin is dict
            nested.append((value_type, [*path, key, "NAME"] if named else [*path, key], not named))
        shown = _DEFAULTS_SHOWN.get(key) or _default_shown(
            field.get_default(call_default_factory=True), required=field.is_required()
        )
        rows.append(f"| `{key}` | {shown} | {(field.description or '').replace(chr(10), ' ')} |")
    header = f"[[{'.'.join(path)}]]" if array else f"[{'.'.join(path)}]"
    out += ["", f"## {header}", "", "| key | default | meaning |", "| --- | --- | --- |"]
    out += rows
    for sub, sub_path, sub_array in nested:
        _reference_table(sub, sub_path, out, array=sub_array)


# Defaults that depend on the machine or on the tool, shown as their rule.
_DEFAULTS_SHOWN = {
    "action": "`ask` for MCP servers' tools and `write_file`, `edit_file`, `run_command`; "
    "else `allow`",
    "socket": "`$XDG_RUNTIME_DIR/loopd/loopd.sock` (without it, `/tmp/loopd-UID/loopd.sock`)",
    "directory": "`$XDG_STATE_HOME/loopd/sessions` (`~/.local/state/loopd/sessions`)",
    "system_prompt": "a short prompt that explains `find_tool`, `call_tool` and untrusted data",
}


def _default_shown(value: Any, *, required: bool) -> str:
    if required:
        return "(required)"
    if value == {}:
        return "(none)"
    return "(unset)" if value is None else f"`{_toml_value(value)}`"


def _toml_value(value: Any) -> str:
    if isinstance(value, Path):
        return f'"{value}"'
    return tomli_w.dumps({"v": value}).strip().removeprefix("v = ")
