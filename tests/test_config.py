"""The config: defaults with no file, and one clear line for each kind of mistake."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from loopd.cli import main
from loopd.config import Config, ConfigError, dump_toml, load_config, reference
from loopd.tools import policy_for


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "loopd.toml"
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LOOPD_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config-here"))


def test_no_file_gives_the_defaults() -> None:
    config, source = load_config(None)
    assert source is None
    assert config == Config()
    assert config.server.url is None  # the embedded default: loopd starts its own server
    assert config.loop.tool_iterations > 0


def test_a_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = write(tmp_path, '[loop]\ntool_iterations = 3\n[server]\nurl = "http://gpu:8080"\n')
    config, source = load_config(path)
    assert source == path
    assert config.loop.tool_iterations == 3
    assert config.server.urls == ["http://gpu:8080"]
    assert config.loop.thinking_cap == Config().loop.thinking_cap


def test_loopd_config_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[server]\nslots = 2\n")
    monkeypatch.setenv("LOOPD_CONFIG", str(path))
    assert load_config(None)[0].server.slots == 2


def test_the_user_config_file_is_read_when_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "xdg"
    (home / "loopd").mkdir(parents=True)
    (home / "loopd" / "config.toml").write_text("[server]\nslots = 1\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    assert load_config(None)[0].server.slots == 1


def test_an_unknown_key_names_file_line_table_and_key_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "[loop]\n\ntool_iteration = 3\n")
    assert error_of(path) == (
        f"{path}:3: [loop] tool_iteration: unknown key (did you mean 'tool_iterations'?)"
    )


def test_an_unknown_table_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "[plugins]\nname = 3\n")
    assert error_of(path) == f"{path}:1: [plugins] is not a table loopd knows"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[servr]\nslots = 2\n", "1: [servr] is not a table loopd knows (did you mean [server]?)"),
        (
            '[server]\nslots = 2\n[server.managd]\nmodel = "m.gguf"\n',
            "3: [server.managd] is not a table loopd knows (did you mean [server.managed]?)",
        ),
        (
            '[tools.mcpp.cal]\ncommand = ["cal-mcp"]\n',
            "1: [tools.mcpp] is not a table loopd knows (did you mean [tools.mcp]?)",
        ),
        (
            '[tools.mcp.cal]\ncommand = ["cal-mcp"]\n[tools.mcp.cal.polcy]\naction = "ask"\n',
            (
                "3: [tools.mcp.cal.polcy] is not a table loopd knows "
                "(did you mean [tools.mcp.cal.policy]?)"
            ),
        ),
    ],
)
def test_an_unknown_table_suggests_the_one_meant(tmp_path: Path, text: str, said: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}:{said}"


def test_an_unknown_key_of_an_mcp_server_suggests_the_one_meant(tmp_path: Path) -> None:
    """Inside a table of named ones (`[tools.mcp.NAME]`) as anywhere else."""
    path = write(tmp_path, '[tools.mcp.cal]\ncommand = ["cal-mcp"]\nenvs = "TZ=UTC"\n')
    assert error_of(path) == f"{path}:3: [tools.mcp.cal] envs: unknown key (did you mean 'env'?)"


def test_a_wrong_type_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, '[loop]\nrepeat_detection = "often"\n')
    assert error_of(path) == (
        f'{path}:2: [loop] repeat_detection: must be true or false, not the string "often"'
    )


def test_a_string_that_pydantic_would_read_as_a_boolean_is_refused(tmp_path: Path) -> None:
    """`"yes"` is not `true`: the file says what it means in TOML's own types."""
    path = write(tmp_path, '[loop]\nrepeat_detection = "yes"\n')
    assert error_of(path) == (
        f'{path}:2: [loop] repeat_detection: must be true or false, not the string "yes"'
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[loop]\nthinking = 1\n", "2: [loop] thinking: must be true or false, not the number 1"),
        (
            '[tools.run]\nnetwork = "true"\n',
            (
                '2: [tools.run] network: must be true or false, not the string "true" '
                "(write it without quotes: true)"
            ),
        ),
        (
            '[tools.policies.read_file]\nuntrusted = "false"\n',
            (
                "2: [tools.policies.read_file] untrusted: must be true or false, "
                'not the string "false" (write it without quotes: false)'
            ),
        ),
    ],
)
def test_a_boolean_in_any_table_must_be_a_toml_boolean(
    tmp_path: Path, text: str, said: str
) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}:{said}"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            '[loop]\ntool_iterations = "5"\n',
            (
                '2: [loop] tool_iterations: must be a whole number, not the string "5" '
                "(write it without quotes: 5)"
            ),
        ),
        (
            '[server]\nread_timeout = "0.5"\n',
            (
                '2: [server] read_timeout: must be a number, not the string "0.5" '
                "(write it without quotes: 0.5)"
            ),
        ),
        (
            "[loop]\nmax_tokens = 5.0\n",
            "2: [loop] max_tokens: must be a whole number, not the number 5.0",
        ),
        ("[store]\ndirectory = 5\n", "2: [store] directory: must be a string, not the number 5"),
        (
            "[tools]\nroots = [true]\n",
            "2: [tools] roots[0]: must be a string, not the boolean true",
        ),
        (
            '[server]\nslots = "four"\n',
            '2: [server] slots: must be a whole number, not the string "four"',
        ),
        ("loop = 5\n", "1: loop: must be a table, not the number 5"),
    ],
)
def test_a_value_of_another_toml_type_is_refused_not_converted(
    tmp_path: Path, text: str, said: str
) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}:{said}"


def test_a_whole_number_is_taken_where_a_number_is_wanted(tmp_path: Path) -> None:
    """TOML writes 30 and 30.0 apart; both are a number of seconds."""
    path = write(tmp_path, "[tools]\ntimeout = 30\n")
    assert load_config(path)[0].tools.timeout == 30.0


def test_mistakes_are_reported_in_the_order_of_their_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[tools]\ntimeout = 0\n[loop]\nthinking = 1\n[server]\nslots = 0\n[servr]\n",
    )
    lines = error_of(path).splitlines()
    assert [line.split(":")[1] for line in lines] == ["2", "4", "6", "7"]


def test_a_validators_message_comes_without_pydantics_prefix(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nurl = "gpu-box:8080"\n')
    assert error_of(path) == (
        f"{path}:2: [server] url: 'gpu-box:8080' is not an http:// or https:// URL"
    )


def test_a_mistake_in_a_table_with_a_quoted_name_names_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[tools.policies."notes.search"]\naction = "maybe"\n')
    assert error_of(path).startswith(f'{path}:2: [tools.policies."notes.search"] action: ')


def test_a_multi_line_string_is_not_read_for_keys(tmp_path: Path) -> None:
    """Text inside the system prompt that looks like a table does not move a mistake's line."""
    path = write(
        tmp_path,
        '[session]\nsystem_prompt = """\n[loop]\nthinking = 1\n"""\n[loop]\nthinking = 2\n',
    )
    assert error_of(path).startswith(f"{path}:7: [loop] thinking: ")


def test_a_negative_limit_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "[loop]\ntool_result_cap = -5\n")
    assert error_of(path) == (f"{path}:2: [loop] tool_result_cap: Input should be greater than 0")


def test_a_nested_table_mistake_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, '[tools.policies.read_file]\naction = "maybe"\n')
    assert error_of(path).startswith(f"{path}:2: [tools.policies.read_file] action: ")


def test_a_server_url_must_be_http(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nurl = "gpu-box:8080"\n')
    assert error_of(path).startswith(f"{path}:2: [server] url: ")


def test_an_affinity_header_must_be_a_header_name(tmp_path: Path) -> None:
    """A name that is not one would go out on the wire as it is, before any check."""
    path = write(tmp_path, '[server]\nurl = "http://gpu:8000"\naffinity_header = "X Id:"\n')
    said = error_of(path)
    assert said.startswith(f"{path}:3: [server] affinity_header: ")
    assert "is not a header's name" in said


def test_an_engine_must_be_one_loopd_knows(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nurl = "http://gpu:8000"\nengine = "sglang"\n')
    assert error_of(path).startswith(f"{path}:3: [server] engine: ")


def test_every_mistake_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "[loop]\ntool_iterations = 0\nturn_timeout = -1\n")
    assert len(error_of(path).splitlines()) == 2


def test_toml_syntax_errors_name_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[loop\n")
    message = error_of(path)
    assert message.startswith(f"{path}: not valid TOML: ")
    assert "line 1" in message


def test_a_missing_file_named_by_the_user_is_an_error(tmp_path: Path) -> None:
    assert error_of(tmp_path / "nope.toml") == f"{tmp_path / 'nope.toml'}: no such config file"


def test_the_effective_config_prints_as_toml_that_loads_back(tmp_path: Path) -> None:
    config = Config()
    path = write(tmp_path, dump_toml(config))
    assert load_config(path)[0] == config


def test_policy_tables_print_as_written_so_a_printed_config_means_the_same(
    tmp_path: Path,
) -> None:
    """A table that sets only a class printed with `action = "allow"` spelled out would make
    run_command run without asking once the printed config is used."""
    written = write(tmp_path, '[tools.policies.run_command]\nclass = "private"\n')
    config = load_config(written)[0]
    printed = dump_toml(config)
    assert tomllib.loads(printed)["tools"]["policies"]["run_command"] == {"class": "private"}
    again = load_config(write(tmp_path, printed))[0]
    assert again == config
    ask = policy_for(again.tools, "run_command", "builtin")
    assert ask == policy_for(config.tools, "run_command", "builtin")
    assert ask.action == "ask"


def test_check_config_prints_the_config_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "[loop]\ntool_iterations = 4\n")
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# effective config: {path}\n")
    assert tomllib.loads(out)["loop"]["tool_iterations"] == 4


def listed(out: str, tool: str) -> str:
    """What check-config's list of policies says of a tool, spaces squeezed."""
    (line,) = [line for line in out.splitlines() if line.startswith(f"#   {tool} ")]
    return " ".join(line.removeprefix(f"#   {tool}").split())


def test_check_config_names_a_command_that_runs_without_asking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Listed as comments after the config, with the table that lets it run."""
    tools = f'[tools]\nroots = ["{tmp_path}"]\n[tools.policies.run_command]\n'
    allowed = write(tmp_path, tools + 'action = "allow"\n')
    assert main(["check-config", "--config", str(allowed)]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["tools"]["policies"]["run_command"]["action"] == "allow"
    assert listed(out, "run_command") == "allow (runs without asking: [tools.policies.run_command])"
    assert listed(out, "write_file") == "ask"
    asking = write(tmp_path, tools + 'class = "private"\n')
    assert main(["check-config", "--config", str(asking)]) == 0
    assert listed(capsys.readouterr().out, "run_command") == "ask"


def test_check_config_names_an_mcp_server_whose_tools_run_without_asking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = f"command = [{json.dumps(sys.executable)}]\n"
    path = write(
        tmp_path,
        f'[tools.mcp.web]\n{program}policy = {{ action = "allow" }}\n'
        f'[tools.mcp.mail]\n{program}policy = {{ action = "ask" }}\n',
    )
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["tools"]["mcp"]["web"]["policy"]["action"] == "allow"
    web = listed(out, "every tool of server web:")
    assert web == "allow (runs without asking: [tools.mcp.web] policy)"
    assert listed(out, "every tool of server mail:") == "ask"


def test_check_config_says_an_mcp_servers_tools_ask_unless_the_config_allows_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = f"command = [{json.dumps(sys.executable)}]\n"
    path = write(
        tmp_path,
        f"[tools.mcp.cal]\n{server}[tools.mcp.notes]\n{server}"
        '[tools.policies."notes.search"]\naction = "allow"\n',
    )
    main(["check-config", "--config", str(path)])
    out = capsys.readouterr().out
    assert listed(out, "every tool of server cal:") == "ask"
    assert listed(out, "every tool of server notes:") == "ask"
    search = listed(out, "notes.search")
    assert search == 'allow (runs without asking: [tools.policies."notes.search"])'


def test_check_config_fails_naming_an_mcp_server_whose_program_is_not_on_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, '[tools.mcp.cal]\ncommand = ["cal-mcp-nowhere", "--db", "x"]\n')
    assert main(["check-config", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "# MCP server cal: cannot start: cal-mcp-nowhere is not found on PATH" in out


def test_check_config_fails_naming_an_mcp_program_that_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "cal-mcp"
    script.write_text("#!/bin/sh\n")  # not executable
    path = write(
        tmp_path,
        f'[tools.mcp.cal]\ncommand = ["{script}"]\n'
        f'[tools.mcp.mail]\ncommand = ["{tmp_path / "gone"}"]\n',
    )
    assert main(["check-config", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"# MCP server cal: cannot start: {script} is not an executable file" in out
    assert f"# MCP server mail: cannot start: {tmp_path / 'gone'} does not exist" in out


def test_check_config_finds_an_mcp_program_on_the_path_its_env_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server starts with its `env` over loopd's: its PATH is where its program is found."""
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "cal-mcp"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    path = write(
        tmp_path,
        f'[tools.mcp.cal]\ncommand = ["cal-mcp"]\nenv = {{ PATH = "{tmp_path / "bin"}" }}\n',
    )
    assert main(["check-config", "--config", str(path)]) == 0
    assert f"# MCP server cal: {script}\n" in capsys.readouterr().out


def test_check_config_fails_when_the_model_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOPD_MODEL", str(tmp_path / "gone.gguf"))
    assert main(["check-config", "--config", str(write(tmp_path, ""))]) == 1
    out = capsys.readouterr().out
    assert f"the model {tmp_path / 'gone.gguf'} does not exist" in out


def test_check_config_fails_when_the_llama_server_binary_is_missing_or_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "llama-server"
    for written in ("", "#!/bin/sh\n"):  # missing, then there but not executable
        if written:
            binary.write_text(written)
        path = write(tmp_path, f'[server.managed]\nbinary = "{binary}"\n')
        assert main(["check-config", "--config", str(path)]) == 1
        out = capsys.readouterr().out
        said = "is not executable" if written else "does not exist"
        assert f"the llama-server {binary} {said}" in out


def test_check_config_reports_a_mistake_with_exit_status_2(tmp_path: Path) -> None:
    """As a real process, the way a user meets it: one message, no traceback."""
    path = write(tmp_path, "[loop]\ntool_iterations = -1\n")
    done = subprocess.run(
        [sys.executable, "-m", "loopd", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"{path}:2: [loop] tool_iterations: Input should be greater than 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_help_says_it_serves_every_session_on_the_socket() -> None:
    """Not the latest session alone, as it once said: any client opens any session."""
    done = subprocess.run(
        [sys.executable, "-m", "loopd", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    said = " ".join(done.stdout.split())
    assert "latest session" not in said
    assert "every session" in said
    assert "[server] url" in said
    assert "starts a llama-server of its own" in said


def test_the_config_reference_in_docs_is_up_to_date() -> None:
    """docs/config.md is generated from the models; `just docs` writes it anew."""
    docs = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert docs.read_text() == reference(), "docs/config.md is stale: run `just docs`"
