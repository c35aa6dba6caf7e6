"""find_tool: BM25 ranking over a registry of realistic tools, deterministic text."""

from __future__ import annotations

import pytest

from loopd.config import Policy, ToolsConfig
from loopd.session.records import Mode
from loopd.tools import Registry, ToolEntry, builtin_entries, find_tool_text, policy_for
from loopd.tools._search import tokens

TOOLS = {
    "read_file": "Read a text file.",
    "write_file": "Write text to a file, replacing it.",
    "append_file": "Append text to the end of a file.",
    "delete_file": "Delete a file.",
    "move_file": "Move or rename a file.",
    "copy_file": "Copy a file to another place.",
    "list_directory": "List the files and folders in a directory.",
    "make_directory": "Create a new directory.",
    "search_text": "Search for text in files.",
    "file_info": "Size, type and modification time of a file.",
    "git_status": "Show the working tree status of a git repository.",
    "git_diff": "Show changes between commits or the working tree.",
    "git_log": "Show the commit history of a git repository.",
    "git_commit": "Record changes to the repository as a commit.",
    "git_branch": "List, create or delete git branches.",
    "send_email": "Send an email message to a recipient.",
    "read_inbox": "Read the latest messages in the mail inbox.",
    "search_email": "Search mail messages by sender, subject or words.",
    "calendar_events": "List events in the user's calendar for a day.",
    "create_event": "Create a calendar event or meeting.",
    "weather_forecast": "Weather forecast for a city: temperature, rain, wind.",
    "current_time": "Tell the current date and time.",
    "convert_currency": "Convert an amount between currencies at today's rate.",
    "unit_convert": "Convert between units of length, mass and temperature.",
    "calculator": "Evaluate an arithmetic expression.",
    "web_search": "Search the web and return the top results.",
    "fetch_url": "Download a web page and return its text.",
    "translate_text": "Translate text into another language.",
    "summarize_text": "Summarize a long text in a few sentences.",
    "spell_check": "Check the spelling of a text.",
    "run_shell": "Run a shell command and return its output.",
    "list_processes": "List the running processes with their memory and CPU use.",
    "kill_process": "Stop a running process by its id.",
    "disk_usage": "Show how much disk space is used and free.",
    "system_info": "Operating system, CPU and memory of this machine.",
    "python_eval": "Run a short Python snippet and return what it prints.",
    "sql_query": "Run an SQL query against the configured database.",
    "list_tables": "List the tables of the configured database.",
    "http_request": "Send an HTTP request to an API and return the response.",
    "create_issue": "Open an issue in the project's issue tracker.",
    "list_issues": "List open issues in the project's issue tracker.",
    "close_issue": "Close an issue in the issue tracker.",
    "set_reminder": "Remind the user of something at a given time.",
    "list_reminders": "List the user's reminders.",
    "add_contact": "Add a person to the address book.",
    "find_contact": "Look up a person's phone number or email address in the address book.",
    "play_music": "Play a song or playlist.",
    "take_screenshot": "Capture the screen to an image file.",
    "compress_files": "Pack files into a zip archive.",
    "extract_archive": "Unpack a zip or tar archive.",
    "image_resize": "Resize an image to a given width and height.",
    "pdf_to_text": "Extract the text of a PDF document.",
    "notes.read_note": "Read one of the user's notes by its title.",
    "notes.list_notes": "List the titles of the user's notes.",
}


def registry() -> Registry:
    schema = {"type": "object", "properties": {}}
    return Registry(
        ToolEntry(name, summary, summary, schema, "builtin", Policy())
        for name, summary in TOOLS.items()
    )


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("read a file", "read_file"),
        ("reading files", "read_file"),
        ("what's the weather in Paris tomorrow", "weather_forecast"),
        ("send an email to Alice", "send_email"),
        ("show the git commit history", "git_log"),
        ("what changed in the working tree", "git_diff"),
        ("find Bob's phone number", "find_contact"),
        ("how much disk space is left", "disk_usage"),
        ("convert 20 dollars into another currency", "convert_currency"),
        ("search the web for trio nurseries", "web_search"),
        ("download a web page", "fetch_url"),
        ("unzip an archive", "extract_archive"),
        ("list the tables in the database", "list_tables"),
        ("remind me to call mum at 5", "set_reminder"),
        ("what time is it", "current_time"),
        ("get the text out of a PDF", "pdf_to_text"),
        ("stop a process", "kill_process"),
        ("my notes titles", "notes.list_notes"),
        ("create a meeting in my calendar", "create_event"),
        ("rename a file", "move_file"),
    ],
)
def test_the_obviously_right_tool_ranks_first(query: str, expected: str) -> None:
    assert registry().search(query, 5)[0].name == expected


def test_the_registry_has_at_least_50_tools() -> None:
    assert len(registry().names()) >= 50


def test_the_text_for_a_query_is_always_the_same() -> None:
    first = find_tool_text(registry(), "read a file", 5)
    assert all(find_tool_text(registry(), "read a file", 5) == first for _ in range(5))
    assert first.startswith("Tools for 'read a file', best first:\n1. read_file: Read a text file.")
    assert "arguments: " in first


def test_at_most_the_limit_is_returned() -> None:
    assert len(registry().search("file", 3)) == 3


def test_no_match_says_so_and_names_some_tools() -> None:
    text = find_tool_text(registry(), "zzzz qqqq", 5)
    assert text.startswith("No tool matches 'zzzz qqqq'. Tools available: ")


def test_unavailable_tools_are_marked() -> None:
    r = registry()
    r.set_available("builtin", available=False)
    assert "(unavailable now: its server is down)" in find_tool_text(r, "read a file", 1)


def test_a_new_source_is_found_after_it_joins() -> None:
    r = registry()
    assert r.search("horoscope", 5) == []
    entry = ToolEntry(
        "astro.horoscope",
        "Today's horoscope for a sign.",
        "",
        {"type": "object"},
        "astro",
        Policy(),
    )
    r.set_source("astro", [entry])
    assert r.search("horoscope", 5) == [entry]


def test_tokens_split_names_and_stem_words() -> None:
    assert tokens("readFile list_directory Searching") == [
        "read",
        "file",
        "list",
        "directory",
        "search",
    ]


def test_tools_that_ask_or_are_denied_say_so() -> None:
    schema = {"type": "object"}
    r = Registry(
        [
            ToolEntry(
                "send_mail", "Send a mail.", "Send a mail.", schema, "m", Policy(action="ask")
            ),
            ToolEntry(
                "wipe_mail", "Wipe a mail.", "Wipe a mail.", schema, "m", Policy(action="deny")
            ),
        ]
    )
    text = find_tool_text(r, "mail", 2)
    assert "send_mail (asks the user before it runs): Send a mail." in text
    assert "wipe_mail (never runs: the user's policy denies it): Wipe a mail." in text


def test_a_policy_comes_from_the_tool_then_its_source_then_is_raised_by_its_class() -> None:
    config = ToolsConfig.model_validate(
        {
            "policies": {
                "read_file": {"class": "secret"},
                "builtin": {"class": "private"},
                "diary": {"action": "deny", "class": "secret"},
            },
            "mcp": {"mail": {"command": ["mail-mcp"], "policy": {"action": "ask"}}},
            "class_actions": {"secret": "ask", "private": "allow"},
        }
    )
    assert policy_for(config, "read_file", "builtin") == Policy(action="ask", data_class="secret")
    assert policy_for(config, "list_directory", "builtin") == Policy(data_class="private")
    assert policy_for(config, "mail.send", "mail") == Policy(action="ask")
    assert policy_for(config, "diary.read", "diary").action == "deny"  # stricter than ask
    assert policy_for(config, "other", "elsewhere") == Policy()


def test_what_find_tool_says_of_a_tool_follows_the_sessions_mode() -> None:
    """The model learns from find_tool what a call will meet in its session: a write asks in
    `ask`, runs in `accept_edits`, and is refused in `read_only`, as the port decides."""
    r = Registry(builtin_entries(ToolsConfig()))

    def said(tool: str, mode: Mode) -> str:
        (line,) = [s for s in find_tool_text(r, tool, 10, mode).splitlines() if f". {tool}" in s]
        return line.split(": ", 1)[0].removeprefix(line.split(" ", 1)[0] + f" {tool}").strip()

    assert [said("write_file", m) for m in ("ask", "accept_edits", "read_only")] == [
        "(asks the user before it runs)",
        "",
        "(refused in this read-only session)",
    ]
    assert said("run_command", "accept_edits") == "(asks the user before it runs)"
    assert said("read_file", "read_only") == ""
