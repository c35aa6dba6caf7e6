"""Hooks (`[hooks]`): the user's own commands before and after tool calls, as a prompt enters
a turn and as a turn ends. A real `loopd serve` on a scripted model that makes the calls;
the hooks are small Python scripts the tests write, run for real."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import StartDaemon
from loopd.config import ConfigError, load_config
from loopd.session.records import (
    ApprovalRequestRecord,
    CacheLossRecord,
    HookRecord,
    Record,
    ToolResultRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.wire.proto import PROTOCOL
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply, render
from test_tools_write import eventually


def read_file(path: str = "today.md", call_id: str = "c1") -> Reply:
    arguments = json.dumps({"name": "read_file", "arguments": {"path": path}})
    return Reply(tool_calls=((call_id, "call_tool", arguments),))


def find_tool(query: str = "files", call_id: str = "c2") -> Reply:
    return Reply(tool_calls=((call_id, "find_tool", json.dumps({"query": query})),))


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    """A hook: a Python script that keeps its stdin in `NAME.in` beside it, then runs `body`."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import json, os, signal, subprocess, sys, time\n"
        "event = json.load(sys.stdin)\n"
        f"with open({str(tmp_path / name)!r} + '.in', 'a') as f:\n"
        "    f.write(json.dumps(event) + '\\n')\n"
        f"{body}\n"
    )
    return [sys.executable, str(path)]


def seen(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    """What hook `name` read on its stdin, each run's."""
    path = tmp_path / f"{name}.in"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def table(event: str, command: list[str], **keys: Any) -> str:
    lines = [f"[[hooks.{event}]]", f"command = {json.dumps(command)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


class Desk:
    """A loopd with notes to read, hooks, and a session in the notes folder."""

    def __init__(self, d: Daemon, fake: FakeLlama, notes: Path, client: LineClient) -> None:
        self.d, self.fake, self.notes, self.client = d, fake, notes, client

    def log(self) -> list[Record]:
        store = Store(self.d.home / "sessions")
        return list(store.read(store.latest() or "")[1])

    def hooks(self) -> list[HookRecord]:
        return [r for r in self.log() if isinstance(r, HookRecord)]

    def results(self) -> list[str]:
        return [r.content for r in self.log() if isinstance(r, ToolResultRecord)]

    async def turn(self, content: str, turn: str = "t1") -> dict[str, Any]:
        return (await self.client.turn(turn, content))[-1]

    def extends(self) -> bool:
        """Each request's messages extend the previous request's and its answer, and the log
        shows no cache loss: the prompt's prefix held."""
        bodies = self.fake.bodies
        for before, after in itertools.pairwise(bodies):
            if not render(after["messages"]).startswith(render(before["messages"])):
                return False
        return not any(isinstance(r, CacheLossRecord) for r in self.log())


async def desk(
    daemon: StartDaemon, tmp_path: Path, hooks: str, *replies: Reply, tools: str = "", **kw: Any
) -> Desk:
    notes = tmp_path / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "today.md").write_text("buy milk")
    fake = FakeLlama(list(replies))
    d = await daemon(fake, tools=f'roots = ["{notes}"]\n{tools}\n{hooks}', **kw)
    client = await d.connect()
    hello = {"type": "hello", "protocol": PROTOCOL, "session": "new", "cwd": str(notes)}
    await client.send(hello)
    await client.until("welcome")
    return Desk(d, fake, notes, client)


# pre_tool_use


async def test_a_pre_tool_use_hook_reads_the_call_on_stdin_and_exit_0_lets_it_run(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "pre", "sys.exit(0)")
    h = await desk(daemon, tmp_path, table("pre_tool_use", hook), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    assert h.results() == ["buy milk"]
    ((event,),) = [seen(tmp_path, "pre")]
    session = Store(h.d.home / "sessions").latest()
    assert event == {
        "session_id": session,
        "cwd": str(h.notes),
        "hook_event_name": "pre_tool_use",
        "tool_name": "read_file",
        "tool_input": {"path": "today.md"},
        "tool_use_id": "c1",
    }


async def test_a_pre_tool_use_hook_that_exits_2_stops_the_call_and_the_model_reads_its_stderr(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    """The call is not run, nor asked about: the hook comes before its approval."""
    hook = script(tmp_path, "pre", "print('notes are private today', file=sys.stderr); exit(2)")
    policy = '[tools.policies.read_file]\naction = "ask"'
    h = await desk(
        daemon, tmp_path, table("pre_tool_use", hook), read_file(), Reply("OK."), tools=policy
    )
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    blocked = "Not run: a pre_tool_use hook blocked this call: notes are private today"
    assert h.results() == [blocked]
    assert h.fake.bodies[1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": blocked,
    }
    assert not any(isinstance(r, ApprovalRequestRecord) for r in h.log())
    assert conversation_problems(h.log()) == []
    assert h.extends()


async def test_a_hook_that_exits_with_another_status_is_logged_and_blocks_nothing(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "pre", "print('jq: not found', file=sys.stderr); exit(1)")
    h = await desk(daemon, tmp_path, table("pre_tool_use", hook), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    assert h.results() == ["buy milk"]
    ((run,),) = [h.hooks()]
    assert (run.event, run.status, run.stderr, run.error) == (
        "pre_tool_use",
        1,
        "jq: not found\n",
        None,
    )


async def test_each_hook_run_is_a_record_of_what_ran_how_it_ended_and_how_long(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "pre", "print('looked'); print('fine', file=sys.stderr)")
    h = await desk(daemon, tmp_path, table("pre_tool_use", hook), read_file(), Reply("Milk."))
    await h.turn("what do I buy?")
    ((run,),) = [h.hooks()]
    assert (run.kind, run.event, run.command, run.call, run.tool) == (
        "hook",
        "pre_tool_use",
        tuple(hook),
        1,
        "read_file",
    )
    assert (run.status, run.stdout, run.stderr, run.error, run.feedback) == (
        0,
        "looked\n",
        "fine\n",
        None,
        None,
    )
    assert run.seconds >= 0
    # Before the result the call's own number carries.
    kinds = [r.kind for r in h.log()]
    assert kinds.index("hook") < kinds.index("tool_result")


async def test_a_hooks_output_is_bounded_in_the_log_and_in_what_the_model_reads(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "post", "sys.stdout.write('x' * 300_000)")
    h = await desk(daemon, tmp_path, table("post_tool_use", hook), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    ((run,),) = [h.hooks()]
    assert run.stdout == "x" * 2_000
    (result,) = h.results()
    assert result == "buy milk\n\n[post_tool_use hook] " + "x" * 10_000


async def test_a_hook_that_hangs_is_killed_with_its_processes_at_its_timeout_and_the_turn_goes_on(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    body = (
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)"
    )
    hook = script(tmp_path, "pre", body)
    h = await desk(
        daemon, tmp_path, table("pre_tool_use", hook, timeout=1), read_file(), Reply("Milk.")
    )
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    assert h.results() == ["buy milk"]
    ((run,),) = [h.hooks()]
    assert (run.status, run.error) == (None, "killed at its timeout of 1 s")
    child = int((tmp_path / "child").read_text())

    async def gone() -> bool:
        try:
            stat = await trio.Path(f"/proc/{child}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped

    assert await eventually(gone)


async def test_a_hook_command_that_does_not_exist_is_logged_and_blocks_nothing(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-hook")
    h = await desk(daemon, tmp_path, table("pre_tool_use", [missing]), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    assert h.results() == ["buy milk"]
    ((run,),) = [h.hooks()]
    assert run.status is None
    assert run.error is not None
    assert run.error.startswith("it did not start: [Errno 2] No such file or directory")


async def test_a_hook_killed_by_a_signal_is_logged_and_blocks_nothing(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "pre", "os.kill(os.getpid(), signal.SIGKILL)")
    h = await desk(daemon, tmp_path, table("pre_tool_use", hook), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    assert h.results() == ["buy milk"]
    ((run,),) = [h.hooks()]
    assert run.status == -9


async def test_the_matcher_chooses_the_tools_a_hook_runs_for(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    reads = script(tmp_path, "reads", "print('no', file=sys.stderr); exit(2)")
    runs = script(tmp_path, "runs", "exit(2)")
    every = script(tmp_path, "every", "exit(0)")
    hooks = (
        table("pre_tool_use", reads, matcher="read_.*")
        + table("pre_tool_use", runs, matcher="run_command|write_file")
        + table("pre_tool_use", every, matcher="*")
    )
    h = await desk(daemon, tmp_path, hooks, read_file(), find_tool(), Reply("Done."))
    assert (await h.turn("look around"))["type"] == "turn_done"
    assert [e["tool_name"] for e in seen(tmp_path, "reads")] == ["read_file"]
    assert seen(tmp_path, "runs") == []
    # The first hook blocked the read: those after it did not run for it.
    assert [e["tool_name"] for e in seen(tmp_path, "every")] == ["find_tool"]
    assert [(r.call, r.tool, r.status) for r in h.hooks()] == [
        (1, "read_file", 2),
        (2, "find_tool", 0),
    ]


# post_tool_use


async def test_a_post_tool_use_hook_adds_its_stdout_to_the_result_the_model_reads(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "post", "print('the file was read at noon')")
    h = await desk(daemon, tmp_path, table("post_tool_use", hook), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    result = "buy milk\n\n[post_tool_use hook] the file was read at noon"
    assert h.results() == [result]
    assert h.fake.bodies[1]["messages"][-1]["content"] == result
    (event,) = seen(tmp_path, "post")
    assert (event["hook_event_name"], event["tool_name"], event["tool_response"]) == (
        "post_tool_use",
        "read_file",
        "buy milk",
    )
    assert h.extends()


async def test_a_post_tool_use_hook_that_exits_2_adds_its_stderr_to_the_result(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "post", "print('lint: 2 errors', file=sys.stderr); exit(2)")
    h = await desk(daemon, tmp_path, table("post_tool_use", hook), read_file(), Reply("Milk."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    assert h.results() == ["buy milk\n\n[post_tool_use hook] lint: 2 errors"]


# user_prompt_submit


async def test_a_user_prompt_submit_hook_adds_its_stdout_to_the_message_the_model_reads(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "prompt", "print('Today is a holiday.')")
    h = await desk(daemon, tmp_path, table("user_prompt_submit", hook), Reply("Rest."))
    assert (await h.turn("what do I do?"))["type"] == "turn_done"
    said = "what do I do?\n\nToday is a holiday."
    assert [r.content for r in h.log() if isinstance(r, UserRecord)] == [said]
    assert h.fake.bodies[0]["messages"][-1] == {"role": "user", "content": said}
    (event,) = seen(tmp_path, "prompt")
    assert (event["hook_event_name"], event["prompt"]) == ("user_prompt_submit", "what do I do?")


async def test_a_user_prompt_submit_hook_that_exits_2_refuses_the_prompt_and_says_why(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    body = "if 'password' in event['prompt']:\n    print('no secrets', file=sys.stderr); exit(2)"
    hook = script(tmp_path, "prompt", body)
    h = await desk(daemon, tmp_path, table("user_prompt_submit", hook), Reply("Hello."))
    failed = await h.turn("my password is hunter2")
    assert (failed["type"], failed["message"]) == (
        "turn_failed",
        "a user_prompt_submit hook refused the prompt: no secrets",
    )
    assert h.fake.bodies == []  # the model never saw it
    assert not any(isinstance(r, UserRecord) for r in h.log())
    assert conversation_problems(h.log()) == []
    assert (await h.turn("hello", "t2"))["type"] == "turn_done"
    assert [r.content for r in h.log() if isinstance(r, UserRecord)] == ["hello"]


# stop


async def test_a_stop_hook_that_exits_2_sends_the_model_back_with_its_stderr(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    body = (
        "if not event['stop_hook_active']:\n"
        "    print('run the tests first', file=sys.stderr); exit(2)"
    )
    hook = script(tmp_path, "stop", body)
    h = await desk(
        daemon, tmp_path, table("stop", hook), Reply("Done."), Reply("Tests pass. Done.")
    )
    done = await h.turn("fix it")
    assert (done["type"], done["content"]) == ("turn_done", "Tests pass. Done.")
    again = "A stop hook asks you to go on: run the tests first"
    assert h.fake.bodies[1]["messages"][-2:] == [
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": again},
    ]
    assert [
        (e["stop_hook_active"], e["last_assistant_message"]) for e in seen(tmp_path, "stop")
    ] == [
        (False, "Done."),
        (True, "Tests pass. Done."),
    ]
    assert [(r.status, r.feedback) for r in h.hooks()] == [(2, again), (0, None)]
    assert conversation_problems(h.log()) == []
    assert h.extends()


async def test_a_stop_hook_that_never_lets_the_turn_end_is_held_by_tool_iterations(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "stop", "print('more', file=sys.stderr); exit(2)")
    h = await desk(
        daemon, tmp_path, table("stop", hook), Reply("Done."), loop="tool_iterations = 2"
    )
    failed = await h.turn("fix it")
    assert (failed["type"], failed["kind"]) == ("turn_failed", "turn_limit")
    assert len(h.fake.bodies) == 3
    assert conversation_problems(h.log()) == []


async def test_a_stop_hook_that_exits_0_lets_the_turn_end_with_its_answer(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    hook = script(tmp_path, "stop", "print('noted')")
    h = await desk(daemon, tmp_path, table("stop", hook), Reply("Done."))
    done = await h.turn("fix it")
    assert (done["type"], done["content"]) == ("turn_done", "Done.")
    assert len(h.fake.bodies) == 1
    assert [(r.event, r.status, r.stdout) for r in h.hooks()] == [("stop", 0, "noted\n")]


async def test_a_log_with_hook_records_replays_to_the_same_messages(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    body = "if not event['stop_hook_active']:\n    exit(2)"
    hooks = table("stop", script(tmp_path, "stop", body)) + table(
        "post_tool_use", script(tmp_path, "post", "print('checked')")
    )
    h = await desk(daemon, tmp_path, hooks, read_file(), Reply("Done."), Reply("Sure."))
    assert (await h.turn("what do I buy?"))["type"] == "turn_done"
    command = h.d.command("replay", "latest")
    with trio.fail_after(60):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    assert done.returncode == 0, done.stderr.decode()


# config


def test_a_matcher_that_is_not_a_regular_expression_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "loopd.toml"
    config.write_text('[[hooks.pre_tool_use]]\ncommand = ["true"]\nmatcher = "read_(file"\n')
    with pytest.raises(ConfigError, match=r"loopd.toml:3: .*matcher: not a regular expression"):
        load_config(config)


def test_only_tool_events_take_a_matcher(tmp_path: Path) -> None:
    config = tmp_path / "loopd.toml"
    config.write_text('[[hooks.stop]]\ncommand = ["true"]\nmatcher = "read_file"\n')
    with pytest.raises(ConfigError, match="matcher: unknown key"):
        load_config(config)


def test_a_hook_takes_a_timeout_of_60_s_unless_it_says(tmp_path: Path) -> None:
    config = tmp_path / "loopd.toml"
    config.write_text(
        '[[hooks.stop]]\ncommand = ["true"]\n[[hooks.stop]]\ncommand = ["false"]\ntimeout = 5\n'
    )
    loaded, _ = load_config(config)
    assert [(h.command, h.timeout) for h in loaded.hooks.stop] == [(["true"], 60), (["false"], 5)]
