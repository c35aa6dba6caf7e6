"""The built-in tools: useful over the roots, and never a step outside them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from loopd.config import RunConfig, ToolsConfig
from loopd.tools import Builtins, ToolFailure, ToolRequest, builtin_entries
from loopd.tools._builtin import FIND_LIMIT, READ_LINES
from loopd.tools._write import plan


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "home"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "today.md").write_text("# Today\nbuy milk\ncall Alice\n")
    (root / "notes" / "old.md").write_text("nothing about milk here? milk!\n")
    (root / "photo.jpg").write_bytes(b"\xff\xd8\xff\0\0JFIF" + bytes(100))
    (tmp_path / "secret.txt").write_text("the password is hunter2\n")
    return root


def tools(*roots: Path) -> Builtins:
    return Builtins(list(roots), timeout=30)


def run(builtins: Builtins, name: str, **arguments: Any) -> str:
    function = {
        "read_file": builtins.read_file,
        "list_directory": builtins.list_directory,
        "search_text": builtins.search_text,
        "find_files": builtins.find_files,
    }[name]
    return function(arguments)


def test_file_tools_exist_with_roots_or_without(tmp_path: Path) -> None:
    """Without roots they work in a session's own folder (an editor's)."""
    assert builtin_entries(ToolsConfig()) == builtin_entries(ToolsConfig(roots=[tmp_path]))
    names = [e.name for e in builtin_entries(ToolsConfig(roots=[tmp_path]))]
    assert names == [
        "read_file",
        "list_directory",
        "search_text",
        "find_files",
        "write_file",
        "edit_file",
        "run_command",
        "update_plan",
        "fetch_url",
        "current_time",
    ]


def test_read_file_reads_a_text_file(root: Path) -> None:
    assert run(tools(root), "read_file", path="notes/today.md") == "# Today\nbuy milk\ncall Alice"


def test_read_file_reads_from_a_line(root: Path) -> None:
    assert run(tools(root), "read_file", path="notes/today.md", start_line=3) == "call Alice"


def test_a_long_file_is_read_a_page_at_a_time(root: Path) -> None:
    (root / "long.txt").write_text("".join(f"line {n}\n" for n in range(1, 1001)))
    text = run(tools(root), "read_file", path="long.txt")
    assert text.splitlines()[-1] == (
        f"[... more from line {READ_LINES + 1}: read_file with start_line {READ_LINES + 1}]"
    )
    assert len(text.splitlines()) == READ_LINES + 1


def test_a_huge_single_line_is_bounded(root: Path) -> None:
    (root / "huge.txt").write_text("x" * (2 * 1024 * 1024))
    text = run(tools(root), "read_file", path="huge.txt")
    assert len(text) < 100
    assert text.startswith("[... more from line 1")


def test_a_binary_file_is_named_as_such(root: Path) -> None:
    with pytest.raises(ToolFailure, match=r"photo.jpg is a binary file \(109 bytes\)"):
        run(tools(root), "read_file", path="photo.jpg")


def test_a_fifo_is_not_opened(root: Path) -> None:
    os.mkfifo(root / "pipe")
    with pytest.raises(ToolFailure, match="not a regular file"):
        run(tools(root), "read_file", path="pipe")


def test_a_missing_file_says_so(root: Path) -> None:
    with pytest.raises(ToolFailure, match=r"nope\.txt: no such file"):
        run(tools(root), "read_file", path="nope.txt")


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../secret.txt", "'..' is refused"),
        ("notes/../../secret.txt", "'..' is refused"),
        ("/etc/passwd", "absolute paths are refused"),
        ("~/secret.txt", "absolute paths are refused"),
    ],
)
def test_paths_out_of_the_root_are_refused(root: Path, path: str, why: str) -> None:
    for name in ("read_file", "list_directory"):
        with pytest.raises(ToolFailure, match=why):
            run(tools(root), name, path=path)


def test_a_symlink_out_of_the_root_is_refused(root: Path) -> None:
    (root / "shortcut.txt").symlink_to(root.parent / "secret.txt")
    (root / "outside").symlink_to(root.parent)
    with pytest.raises(ToolFailure, match="leads outside the allowed folders"):
        run(tools(root), "read_file", path="shortcut.txt")
    with pytest.raises(ToolFailure, match="leads outside the allowed folders"):
        run(tools(root), "list_directory", path="outside")


def test_search_does_not_follow_symlinks_out_of_the_root(root: Path) -> None:
    (root / "shortcut.txt").symlink_to(root.parent / "secret.txt")
    assert "hunter2" not in run(tools(root), "search_text", pattern="password")


def test_a_symlink_inside_the_root_is_fine(root: Path) -> None:
    (root / "today").symlink_to(root / "notes" / "today.md")
    assert run(tools(root), "read_file", path="today").startswith("# Today")


def test_list_directory_lists_names_sizes_and_folders(root: Path) -> None:
    assert run(tools(root), "list_directory", path=".") == "notes/\nphoto.jpg (109 bytes)"
    listed = run(tools(root), "list_directory", path="notes")
    assert listed == "old.md (31 bytes)\ntoday.md (28 bytes)"


def test_search_text_finds_lines_case_insensitively(root: Path) -> None:
    assert run(tools(root), "search_text", pattern="MILK") == (
        "notes/old.md:1: nothing about milk here? milk!\nnotes/today.md:2: buy milk"
    )


def test_search_text_takes_a_regex_and_reports_a_bad_one(root: Path) -> None:
    assert run(tools(root), "search_text", pattern=r"^call \w+$", regex=True) == (
        "notes/today.md:3: call Alice"
    )
    with pytest.raises(ToolFailure, match="not a valid regular expression"):
        run(tools(root), "search_text", pattern="(", regex=True)


def test_search_text_with_no_match_says_so(root: Path) -> None:
    assert run(tools(root), "search_text", pattern="zebra") == "No line under . matches 'zebra'."


def test_find_files_matches_a_name_at_any_depth_sorted(root: Path) -> None:
    (root / "notes" / "deep").mkdir()
    (root / "notes" / "deep" / "week.md").write_text("")
    (root / "readme.md").write_text("")
    assert run(tools(root), "find_files", pattern="*.md") == (
        "notes/deep/week.md\nnotes/old.md\nnotes/today.md\nreadme.md"
    )
    assert run(tools(root), "find_files", pattern="t?day.*") == "notes/today.md"
    assert run(tools(root), "find_files", pattern="[!t]*.md", path="notes") == (
        "notes/deep/week.md\nnotes/old.md"
    )


def test_find_files_with_a_folder_in_the_pattern_matches_the_whole_path(root: Path) -> None:
    (root / "notes" / "deep").mkdir()
    (root / "notes" / "deep" / "week.md").write_text("")
    assert run(tools(root), "find_files", pattern="notes/*.md") == "notes/old.md\nnotes/today.md"
    assert run(tools(root), "find_files", pattern="**/deep/*.md") == "notes/deep/week.md"
    assert run(tools(root), "find_files", pattern="notes/**") == (
        "notes/deep/week.md\nnotes/old.md\nnotes/today.md"
    )
    assert run(tools(root), "find_files", pattern="*.txt") == "No file under . matches '*.txt'."


def test_find_files_never_names_a_hidden_path_or_one_outside_the_roots(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "id.md").write_text("secret")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "log.md").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD.md").write_text("")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.md"
    outside.write_text("")
    (tmp_path / "link.md").symlink_to(outside)
    (tmp_path / "seen.md").write_text("")
    run_config = RunConfig(deny_read=[tmp_path / "keys"])
    tools = Builtins([tmp_path], timeout=30, run=run_config, private=[tmp_path / "state"])
    assert run(tools, "find_files", pattern="*.md") == "seen.md"
    with pytest.raises(ToolFailure, match="absolute paths are refused"):
        run(tools, "find_files", pattern="*", path="/etc")


def test_find_files_gives_at_most_its_limit(root: Path) -> None:
    many = root / "many"
    many.mkdir()
    for n in range(FIND_LIMIT + 5):
        (many / f"f{n:04d}.txt").write_text("")
    found = run(tools(root), "find_files", pattern="*.txt").splitlines()
    assert len(found) == FIND_LIMIT + 1
    assert found[0] == "many/f0000.txt"
    assert found[-1] == "[... and 5 more]"


def test_several_roots_are_named_by_their_folder(root: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "plan.txt").write_text("ship it\n")
    both = tools(root, work)
    assert run(both, "list_directory", path=".") == "home/\nwork/"
    assert run(both, "read_file", path="work/plan.txt") == "ship it"
    with pytest.raises(ToolFailure, match="start with one of the roots: home, work"):
        run(both, "read_file", path="plan.txt")


def test_no_roots_means_no_file_access(tmp_path: Path) -> None:
    with pytest.raises(ToolFailure, match="no folders are open to file tools"):
        run(tools(), "read_file", path="a.txt")


async def test_a_catastrophic_regex_stops_at_the_deadline(root: Path) -> None:
    (root / "notes" / "a.md").write_text("a" * 60 + "b\n")
    with pytest.raises(ToolFailure, match="took too long"):
        await trio.to_thread.run_sync(
            lambda: Builtins([root], timeout=0.5).search_text(
                {"pattern": "^(a|aa)+$", "regex": True}
            )
        )


async def test_a_stuck_tool_takes_none_of_the_threads_the_store_uses(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builtins = tools(root)
    release = threading.Event()
    monkeypatch.setitem(builtins._run, "current_time", lambda _: str(release.wait()))
    (entry,) = [e for e in builtin_entries(ToolsConfig()) if e.name == "current_time"]
    with trio.move_on_after(0.2):
        await builtins.run_tool(entry, ToolRequest("s", 1, "current_time", {}))  # abandoned
    try:
        assert trio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
    finally:
        release.set()


def test_the_file_tools_never_reach_loopds_own_files_or_the_keys(tmp_path: Path) -> None:
    """A root that holds loopd's state or the user's keys (a home folder as the root): reading,
    searching and writing them is refused, the rest of the root is not."""
    (tmp_path / "state" / "sessions").mkdir(parents=True)
    (tmp_path / "state" / "sessions" / "s.jsonl").write_text("the person said: secret plan\n")
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "id_rsa").write_text("secret key\n")
    (tmp_path / "notes.md").write_text("no secret here\n")
    run = RunConfig(deny_read=[tmp_path / "keys"])
    tools = Builtins([tmp_path], timeout=30, run=run, private=[tmp_path / "state"])
    for path in ("state/sessions/s.jsonl", "keys/id_rsa"):
        with pytest.raises(ToolFailure, match="is hidden from the tools"):
            tools.read_file({"path": path})
    assert tools.search_text({"pattern": "secret"}) == "notes.md:1: no secret here"
    with pytest.raises(ToolFailure, match="is hidden from the tools"):
        plan(tools.roots, "write_file", {"path": "keys/authorized_keys", "content": "mine"})


SWAPPER = """
import os, sys
folder = sys.argv[1]
os.chdir(folder)
while True:
    with open("x.new", "w") as f:
        f.write("mine\\n")
    os.replace("x.new", "x")
    os.symlink(os.path.join(folder, "state", "log"), "x.link")
    os.replace("x.link", "x")
"""


def test_a_link_swapped_in_while_files_are_read_never_reads_a_hidden_one(tmp_path: Path) -> None:
    """A command of the model's may swap a file it can read for a link to one the tools never
    reach, again and again, while read_file runs (a process of its own, as a command is):
    some reads see the file, some are refused, none reads through the link."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "log").write_text("loopd's own\n")
    (tmp_path / "x").write_text("mine\n")
    tools = Builtins([tmp_path], timeout=30, private=[tmp_path / "state"])
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(tmp_path)])
    seen: Counter[str] = Counter()
    try:
        for _ in range(2000):
            try:
                seen[tools.read_file({"path": "x"})] += 1
            except ToolFailure:
                seen["refused"] += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert "loopd's own" not in seen
    assert seen["mine"] > 0


def test_a_hidden_file_with_a_second_name_stops_the_tools(tmp_path: Path) -> None:
    """With the home folder as a root, a command can give `.npmrc` a second name before the
    person writes a token there: the tools refuse every call until the second name is gone."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "notes.txt").write_text("")
    os.link(tmp_path / "proj" / "notes.txt", tmp_path / ".npmrc")  # as a command could
    (tmp_path / ".npmrc").write_text("_authToken=npm_SECRET\n")  # the person, in place
    tools = Builtins([tmp_path], timeout=30, run=RunConfig(deny_read=[tmp_path / ".npmrc"]))
    entries = {e.name: e for e in builtin_entries(ToolsConfig(roots=[tmp_path]))}
    calls = [("read_file", {"path": "proj/notes.txt"}), ("run_command", {"command": "true"})]
    for name, arguments in calls:
        request = ToolRequest("s", 1, name, arguments)
        with pytest.raises(ToolFailure, match="a file with another name"):
            trio.run(tools.run_tool, entries[name], request)
    (tmp_path / "proj" / "notes.txt").unlink()
    request = ToolRequest("s", 1, "list_directory", {"path": "proj"})
    assert trio.run(tools.run_tool, entries["list_directory"], request).text == "[proj is empty]"
