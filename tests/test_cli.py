"""The `devd` command as a user runs it: tables and `key: value` lines for people and `--json` for scripts, `devd
inspect` showing one session, errors in the command's terms, exit codes, what it says when the daemon is not there,
flags passed through as given, `devd serve`'s flags read from the environment, help for every flag, and `devd watch`
following a session for as long as it lasts."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from devd import __version__, cli
from devd.addresses import TcpListen
from devd.cli.parser import _parsers
from devd.cli.sessions import trace_line
from devd.client import Client, NotRunningError
from devd.errors import HandleError, InternalError, InvalidParamsError, UnauthorizedError
from devd.messages import Action, Browse, Call, Exec, Git, Op, Read, Write, answer, ask, done, turn
from tests.daemon import Daemon, daemon_env, free_port, running, state_dir, stop, wait_connectable
from tests.harness import InProcess
from tests.helpers import devd, subcommands, until, user


def test_without_a_daemon_the_cli_says_how_to_start_one(tmp_path: Path) -> None:
    run = devd("ls", "--connect", str(tmp_path / "none.sock"))
    assert (run.returncode, run.stderr.startswith(f"devd: no daemon is listening at {tmp_path / 'none.sock'}")) == (
        3,
        True,
    )
    assert "start one with `devd serve`" in run.stderr


def test_without_a_daemon_the_client_raises_not_running(tmp_path: Path) -> None:
    with pytest.raises(NotRunningError, match="start one with `devd serve`"):
        Client.connect(tmp_path / "none.sock")


def test_an_empty_key_is_sent_and_refused_not_dropped(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{"Timer":true}', "--key", "", "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (1, "devd: INVALID_PARAMS: the key must be 1-256 bytes of UTF-8\n")


def test_a_zero_timeout_is_sent_and_refused_not_dropped(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{"Timer":true}', "--timeout-ms", "0", "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (
        1,
        "devd: INVALID_PARAMS: timeout_ms must be a positive number of milliseconds\n",
    )


def test_fork_takes_its_step_and_name_as_flags_and_prints_the_forks_name(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "fix the build"))
        run = devd("fork", "s", "--at", "1", "--as", "f", "--connect", str(daemon.socket))
        assert (run.returncode, run.stdout, [a.id for a in c.pending("f")]) == (0, "f\n", [1])


def test_watch_follows_a_session_and_exits_0_when_it_closes(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
        watch = subprocess.Popen(
            [sys.executable, "-m", "devd", "watch", "s", "--connect", str(daemon.socket)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        until(lambda: c.list().sessions[0].watchers == 1)
        c.step("s", turn(1, "x"))
        assert watch.stdout is not None
        first = watch.stdout.readline()
        c.call("session/close", {"session": "s"})
        rest, err = watch.communicate(timeout=30)
    methods = [line.split('"method":"')[1].split('"')[0] for line in [first, *rest.splitlines()]]
    assert (watch.returncode, methods, err) == (0, ["session/actions", "session/unwatched"], "")


def test_the_blocking_client_waits_for_a_notification_past_its_own_timeout(daemon: InProcess) -> None:
    with daemon.client() as stepper, Client.connect(daemon.socket, timeout=0.3) as watcher:
        stepper.new(session="s")
        watcher.call("session/watch", {"session": "s"})
        started = time.monotonic()
        later = threading.Timer(1.0, lambda: stepper.step("s", turn(1, "x")))
        later.start()
        notice = watcher.wait_notification()
        later.join()
    assert (notice.method, time.monotonic() - started >= 1.0) == ("session/actions", True)


# -- tables and summaries for people ----------------------------------------------------------------------------------

STATUS: dict[str, Any] = {
    "server": {"name": "devd", "version": "0.1.0"},
    "uptime_s": 12.5,
    "sessions": {"live": 1, "stored": 2, "ended": 0, "poisoned": 0},
    "connections": 1,
    "steps": 5,
    "durable_writes": 6,
    "errors": {"INTERNAL": 1, "BUSY": 2},
    "deadline_hits": 0,
    "offloaded": 3,
    "rebuilt": 4,
    "hibernated": 7,
    "live_memory_bytes": 1245184,
    "expired": 8,
    "commit_ms_p50": 1.1,
    "commit_ms_p99": 1.4,
    "memory_rss_bytes": 63991808,
}


def test_status_is_summarized_as_key_value_lines() -> None:
    assert cli.status_summary(STATUS) == (
        "daemon:         devd 0.1.0, up 12.5s\n"
        "sessions:       1 live, 2 stored, 0 ended, 0 poisoned\n"
        "connections:    1\n"
        "steps:          5\n"
        "durable writes: 6 (commit p50 1.1 ms, p99 1.4 ms)\n"
        "deadline hits:  0\n"
        "offloaded:      3\n"
        "rebuilt:        4\n"
        "hibernated:     7\n"
        "expired:        8\n"
        "errors:         2 BUSY, 1 INTERNAL\n"
        "memory:         61.0 MiB resident, 1.2 MiB in live sessions\n"
    )


def test_sessions_are_a_table_with_a_reason_column_only_when_one_has_a_reason() -> None:
    live = {
        "session": "a",
        "state": "live",
        "seq": 12,
        "created": "2026-11-30T12:07:18.912Z",
        "last_used": "2026-11-30T12:09:01.004Z",
        "watchers": 2,
    }
    ended = {
        "session": "build-7",
        "state": "ended",
        "seq": 3,
        "created": "2026-11-30T12:07:20.000Z",
        "last_used": "2026-11-30T12:07:31.500Z",
        "reason": "its call ran past its deadline",
    }
    assert cli.sessions_table([live]) == (
        "NAME  STATE  SEQ  WATCHERS  CREATED               LAST USED\n"
        "a     live    12         2  2026-11-30T12:07:18Z  2026-11-30T12:09:01Z\n"
    )
    assert cli.sessions_table([live, ended]) == (
        "NAME     STATE  SEQ  WATCHERS  CREATED               LAST USED             REASON\n"
        "a        live    12         2  2026-11-30T12:07:18Z  2026-11-30T12:09:01Z\n"
        "build-7  ended    3         0  2026-11-30T12:07:20Z  2026-11-30T12:07:31Z  its call ran past its deadline\n"
    )
    assert cli.sessions_table([]) == "no sessions\n"


def test_a_trace_error_quoting_a_models_words_shows_their_controls_escaped() -> None:
    record = {"n": 3, "started": "2026-11-30T12:07:18Z", "action": 2, "kind": "exec", "outcome": "denied"}
    record |= {"duration_ms": 0.5, "error": "denied by rule rm: rm -rf \r\x1b[2K\u202e"}
    assert trace_line(record) == (
        "   3 2026-11-30T12:07:18Z action 2 exec denied 0.5 ms: denied by rule rm: rm -rf \\r\\x1b[2K\\u202e\n"
    )


def test_durations_show_their_two_largest_units() -> None:
    shown = [cli._duration(s) for s in (0.25, 12.5, 245, 11_520, 183_600)]
    assert shown == ["0.2s", "12.5s", "4m 5s", "3h 12m", "2d 3h"]


def test_ls_shows_the_sessions_as_a_table(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="a")
        c.new(session="b")
        c.step("a", turn(1, "x"))
        run = devd("ls", "--connect", str(daemon.socket))
        listed = c.call("session/list")["sessions"]
    assert (run.returncode, run.stdout, run.stderr) == (0, cli.sessions_table(listed), "")
    assert [line.split()[:4] for line in run.stdout.splitlines()] == [
        ["NAME", "STATE", "SEQ", "WATCHERS"],
        ["a", "live", "1", "0"],
        ["b", "live", "0", "0"],
    ]


def test_ls_pages_with_limit_and_cursor_and_says_how_to_get_the_next_page(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="a")
        c.new(session="b")
    first = devd("ls", "--limit", "1", "--connect", str(daemon.socket))
    last = devd("ls", "--limit", "1", "--cursor", "a", "--connect", str(daemon.socket))
    assert [line.split()[0] for line in first.stdout.splitlines()] == ["NAME", "a"]
    assert first.stderr == "devd: more sessions follow: devd ls --limit 1 --cursor a\n"
    assert ([line.split()[0] for line in last.stdout.splitlines()], last.stderr) == (["NAME", "b"], "")


def test_json_prints_the_daemons_answer_exactly_as_it_came(daemon: InProcess) -> None:
    at = ("--connect", str(daemon.socket), "--json")
    new = devd("new", "--session", "s", *at)
    step = devd("step", "s", '{"Turn":{"id":1,"prompt":"x"}}', *at)
    ls = devd("ls", *at)
    with daemon.client() as c:
        listed = c.call_raw("session/list")
    close = devd("close", "s", *at)
    assert (new.stdout, close.stdout) == ('{"session":"s"}\n', "{}\n")
    assert step.stdout == '{"actions":[{"id":1,"op":{"Model":{"messages":[{"User":"x"}]}}}]}\n'
    assert ls.stdout.encode() == listed + b"\n"


def test_status_shows_key_value_lines_and_json_the_counters(daemon: InProcess) -> None:
    text = devd("status", "--connect", str(daemon.socket))
    as_json = devd("status", "--json", "--connect", str(daemon.socket))
    keys = [line.split(":")[0] for line in text.stdout.splitlines()]
    assert keys == [
        "daemon",
        "sessions",
        "connections",
        "steps",
        "durable writes",
        "deadline hits",
        "offloaded",
        "rebuilt",
        "hibernated",
        "expired",
        "errors",
        "memory",
    ]
    assert text.stdout.startswith(f"daemon:         devd {__version__}, up ")
    assert msgspec.json.decode(as_json.stdout)["server"] == {"name": "devd", "version": __version__}


# -- devd inspect ----------------------------------------------------------------------------------------------------


def test_inspect_shows_a_session_at_a_glance_and_the_actions_its_turn_waits_for(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="demo")
        c.step("demo", turn(1, "fix the build"))
        c.step("demo", answer(1, calls=[Call(Exec=Exec(argv=["make", "-C", "src dir"])), Call(Read=Read(path="a.c"))]))
        (entry,) = c.call("session/list")["sessions"]
    run = devd("inspect", "demo", "--connect", str(daemon.socket))
    assert (run.returncode, run.stdout, run.stderr) == (
        0,
        "session:   demo\n"
        "state:     live\n"
        "seq:       2\n"
        "watchers:  0\n"
        f"created:   {entry['created'][:19]}Z\n"
        f"last used: {entry['last_used'][:19]}Z\n"
        "turn:      running, waiting for 2 actions\n"
        "  2  Exec make -C 'src dir'\n"
        "  3  Read a.c\n",
        "",
    )


def test_inspect_json_is_the_list_entry_and_the_pending_actions_as_the_daemon_sent_them(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "x"))
        pending = c.call_raw("session/pending", {"session": "s"})  # first: it marks the session used
        listed = c.call_raw("session/list")
    run = devd("inspect", "s", "--json", "--connect", str(daemon.socket))
    entry = listed.removeprefix(b'{"sessions":[').removesuffix(b"]}")
    actions = pending.removeprefix(b'{"actions":').removesuffix(b"}")
    assert run.stdout.encode() == b'{"session":' + entry + b',"pending":' + actions + b"}\n"


def test_inspect_finds_its_session_among_names_that_sort_beside_it(daemon: InProcess) -> None:
    names = ["a", "a-", "a-a", "a0", "aa", "b", "Z"]
    with daemon.client() as c:
        for name in names:
            c.new(session=name)
    found = [
        msgspec.json.decode(devd("inspect", name, "--json", "--connect", str(daemon.socket)).stdout)["session"]
        for name in names
    ]
    assert [entry["session"] for entry in found] == names


def test_inspect_of_a_session_that_does_not_exist_is_the_daemons_handle_error_with_exit_1(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="a")
        c.new(session="c")
    run = devd("inspect", "b", "--connect", str(daemon.socket))
    assert (run.returncode, run.stdout, run.stderr) == (
        1,
        "",
        "devd: HANDLE: no session is named 'b'; `devd ls` shows the sessions there are\n",
    )


ENTRY: dict[str, Any] = {
    "session": "build-7",
    "state": "live",
    "seq": 3,
    "created": "2026-11-30T12:07:20.000Z",
    "last_used": "2026-11-30T12:07:31.500Z",
}


def test_an_idle_session_with_watchers_is_shown_with_no_turn_running() -> None:
    assert cli.inspection({**ENTRY, "watchers": 2}, []) == (
        "session:   build-7\n"
        "state:     live\n"
        "seq:       3\n"
        "watchers:  2\n"
        "created:   2026-11-30T12:07:20Z\n"
        "last used: 2026-11-30T12:07:31Z\n"
        "turn:      none running\n"
    )


def test_an_ended_session_is_shown_with_its_reason_and_how_to_bring_it_back() -> None:
    ended = {**ENTRY, "state": "ended", "reason": "its call ran past its deadline"}
    assert cli.inspection(ended, None) == (
        "session:   build-7\n"
        "state:     ended\n"
        "reason:    its call ran past its deadline\n"
        "seq:       3\n"
        "watchers:  0\n"
        "created:   2026-11-30T12:07:20Z\n"
        "last used: 2026-11-30T12:07:31Z\n"
        "turn:      none: the session is ended; `devd recover build-7` brings it back\n"
    )


def test_pending_actions_are_listed_one_a_line_with_their_ids_aligned() -> None:
    actions = [Action(id=9, op=Op(Read=Read(path="src/lib.rs"))), Action(id=10, op=Op(Browse=Browse(url="x")))]
    assert cli.inspection(ENTRY, actions).splitlines()[-3:] == [
        "turn:      running, waiting for 2 actions",
        "   9  Read src/lib.rs",
        "  10  Browse x",
    ]


def test_each_kind_of_action_is_summarized_on_one_line() -> None:
    ops = [
        ask(user("fix it"), user("and test it")),
        ask(user("once")),
        Op(Exec=Exec(argv=["cc", "-o", "my prog", "main.c"])),
        Op(Read=Read(path="src/lib.rs")),
        Op(Write=Write(path="notes.txt", text="two\nlines")),
        Op(Git=Git(argv=["status", "--short"])),
        Op(Browse=Browse(url="https://example.com/a")),
        Op(Emit="Declared   x.\nDone."),
        Op(Save=True),
        done(4),
        Op(Emit="y" * 100),
    ]
    assert [cli.action_summary(Action(id=1, op=op)) for op in ops] == [
        "Model (2 messages)",
        "Model (1 message)",
        "Exec cc -o 'my prog' main.c",
        "Read src/lib.rs",
        "Write notes.txt (9 characters)",
        "Git status --short",
        "Browse https://example.com/a",
        "Emit Declared x. Done.",
        "Save",
        "Done turn 4",
        "Emit " + "y" * 69 + "...",
    ]


def test_an_action_summary_shows_a_forged_command_with_its_escapes_visible() -> None:
    forged = Op(Exec=Exec(argv=["sh", "-c", "echo PWNED #\r\x1b[2K$ ls"]))
    assert cli.action_summary(Action(id=1, op=forged)) == "Exec sh -c $'echo PWNED #\\r\\x1b[2K$ ls'"


# -- errors in the command's terms, and exit codes -------------------------------------------------------------------


def args(**given: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"connect": "/run/devd.sock", "token": None, "token_file": None, **given})


def test_a_method_named_in_an_error_becomes_the_command_that_does_it() -> None:
    ended = HandleError("session 'x' ended (its deadline passed); `session/recover` brings it back")
    missing = HandleError("no session is named 'y'; `session/list` shows the sessions there are")
    base64 = InvalidParamsError("the snapshot must be base64, as session/snapshot gives it")
    notice = InvalidParamsError("watchers get session/actions")
    assert [
        cli.in_cli_terms(ended, args(session="x")),
        cli.in_cli_terms(missing, args(session="y")),
        cli.in_cli_terms(base64, args(session=None)),
        cli.in_cli_terms(notice, args()),
    ] == [
        "session 'x' ended (its deadline passed); `devd recover x` brings it back",
        "no session is named 'y'; `devd ls` shows the sessions there are",
        "the snapshot must be base64, as `devd snapshot SESSION` gives it",
        "watchers get session/actions",
    ]


def test_an_internal_error_says_where_the_daemons_log_is() -> None:
    said = cli.in_cli_terms(InternalError("the daemon failed to answer; see its log"), args())
    assert said == (
        "the daemon failed to answer; see its log (the daemon's log: `journalctl -u devd`, with --user for a daemon "
        "of yours, or its stderr)"
    )


def test_a_refused_token_is_said_as_the_flag_to_pass() -> None:
    error = UnauthorizedError("this connection must first call initialize with the token from the daemon's state")
    without = cli.in_cli_terms(error, args(connect="tcp://127.0.0.1:7411"))
    wrong = cli.in_cli_terms(error, args(connect="tcp://127.0.0.1:7411", token_file="/tmp/t"))
    assert without.startswith(
        "the daemon at tcp://127.0.0.1:7411 wants its token first: pass --token-file PATH; the daemon writes its "
        "token to STATE_DIR/token when it listens on TCP ("
    )
    assert wrong.startswith(
        "the daemon at tcp://127.0.0.1:7411 refused the token in /tmp/t: it is not this daemon's token; the daemon "
        "writes its token to STATE_DIR/token"
    )
    assert "initialize" not in without + wrong


def test_an_unknown_session_is_answered_in_the_commands_terms_with_exit_1(daemon: InProcess) -> None:
    run = devd("step", "nope", '{"Timer":true}', "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (
        1,
        "devd: HANDLE: no session is named 'nope'; `devd ls` shows the sessions there are\n",
    )


def test_a_token_file_that_cannot_be_read_is_a_local_problem_with_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "token"
    run = devd("ls", "--connect", f"tcp://127.0.0.1:{free_port()}", "--token-file", str(missing))
    unreadable = devd("ls", "--connect", f"tcp://127.0.0.1:{free_port()}", "--token-file", str(tmp_path))
    assert (run.returncode, unreadable.returncode) == (2, 2)
    assert run.stderr.startswith(
        f"devd: cannot read the token file {missing}: No such file or directory; the daemon writes its token to "
        "STATE_DIR/token when it listens on TCP"
    )
    assert unreadable.stderr.startswith(f"devd: cannot read the token file {tmp_path}: Is a directory; ")


def test_tcp_without_the_token_says_to_pass_token_file_and_with_it_answers(tmp_path: Path) -> None:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with Daemon(tmp_path, "--listen", address) as d:
        without = devd("ls", "--connect", address)
        with_it = devd("ls", "--connect", address, "--token-file", str(d.state / "token"))
    assert (without.returncode, with_it.returncode, with_it.stdout) == (1, 0, "no sessions\n")
    assert without.stderr.startswith(
        f"devd: UNAUTHORIZED: the daemon at {address} wants its token first: pass --token-file PATH; "
    )


def test_help_documents_the_exit_codes_and_devd_socket() -> None:
    run = devd("--help")
    assert (run.returncode, cli.EXIT_CODES in run.stdout) == (0, True)
    codes = (cli.EXIT_OK, cli.EXIT_ANSWERED_ERROR, cli.EXIT_LOCAL, cli.EXIT_UNREACHABLE, cli.EXIT_INTERRUPTED)
    listed = [int(line.split()[0]) for line in cli.EXIT_CODES.splitlines() if line[:3].strip().isdigit()]
    assert (listed, "DEVD_SOCKET" in cli.EXIT_CODES) == (list(codes), True)


def test_every_flag_of_every_command_has_help() -> None:
    silent = [
        f"devd {name} {action.option_strings or action.dest}"
        for name, command in subcommands().items()
        for action in command._actions
        if not action.help
    ]
    assert silent == []


def test_each_command_built_alone_is_the_command_the_whole_command_line_has() -> None:
    alone = {
        name: [sub for sub in _parsers(name)[0]._actions if isinstance(sub, argparse._SubParsersAction)][0]
        .choices[name]
        .format_help()
        for name in subcommands()
    }
    assert alone == {name: command.format_help() for name, command in subcommands().items()}


def test_a_word_that_is_no_command_is_refused_naming_every_command() -> None:
    run = devd("sevre")
    named = re.search(r"invalid choice: 'sevre' \(choose from (.*)\)", run.stderr)
    assert (run.returncode, named and named.group(1).count("'") // 2) == (2, len(subcommands()))


def test_an_argument_past_a_commands_own_is_refused_with_the_usage_naming_every_command() -> None:
    run = devd("ls", "bogus")
    refused = cli.parser().format_usage() + "devd: error: unrecognized arguments: bogus\n"
    assert (run.returncode, run.stderr) == (2, refused)


def test_serve_help_shows_each_default() -> None:
    text = " ".join(subcommands()["serve"].format_help().split())
    for flag, shown in [
        ("--call-timeout", "(default: 5.0)"),
        ("--max-call-timeout", "(default: 60.0)"),
        ("--max-sessions", "(default: 1000000)"),
        ("--max-live", "(default: 1000)"),
        ("--max-connections", "(default: 1024)"),
        ("--max-line-bytes", "(default: 16777216)"),
        ("--line-timeout", "(default: 30.0)"),
        ("--send-timeout", "(default: 30.0)"),
        ("--log-level", "(default: info)"),
    ]:
        after = text[text.index(f"{flag} ", text.index("options:")) :]
        end = after.find(" --", 2)
        assert shown in after[: end if end > 0 else None], flag
    assert "(default: None)" not in text


# -- devd serve's flags from the environment -------------------------------------------------------------------------


def serve_values(argv: list[str], environ: dict[str, str]) -> tuple[Any, ...]:
    a = cli.parse_args(["serve", *argv], environ)
    return (a.socket, a.listen, a.max_live, a.live_memory, a.expire_after, a.call_timeout, a.log_level, a.metrics)


def test_serve_flags_take_their_values_from_the_environment() -> None:
    environ = {
        "DEVD_SOCKET": "/run/devd/devd.sock",
        "DEVD_LISTEN": "tcp://127.0.0.1:7411",
        "DEVD_MAX_LIVE": "5000",
        "DEVD_LIVE_MEMORY": "4G",
        "DEVD_EXPIRE_AFTER": "30d",
        "DEVD_CALL_TIMEOUT": "2.5",
        "DEVD_LOG_LEVEL": "warning",
        "DEVD_METRICS": "tcp://127.0.0.1:9464",
    }
    assert serve_values([], environ) == (
        Path("/run/devd/devd.sock"),
        TcpListen("127.0.0.1", 7411),
        5000,
        4 << 30,
        30 * 86400.0,
        2.5,
        "warning",
        TcpListen("127.0.0.1", 9464),
    )


def test_the_command_line_wins_over_the_environment() -> None:
    environ = {"DEVD_MAX_LIVE": "5000", "DEVD_LOG_LEVEL": "debug", "DEVD_SOCKET": "/run/env.sock"}
    args = cli.parse_args(["serve", "--max-live", "7", "--log-level=error", "--socket", "/run/flag.sock"], environ)
    assert (args.max_live, args.log_level, args.socket) == (7, "error", Path("/run/flag.sock"))


def test_an_empty_or_absent_variable_leaves_its_flag_at_its_default() -> None:
    assert serve_values([], {"DEVD_MAX_LIVE": "", "DEVD_SOCKET": ""}) == (
        None,
        None,
        1000,
        None,
        None,
        5.0,
        "info",
        None,
    )


def test_a_bad_value_in_the_environment_is_a_usage_error_naming_the_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said = []
    for argv, environ in [
        ([], {"DEVD_MAX_LIVE": "lots"}),
        (["--max-live", "7"], {"DEVD_MAX_LIVE": "lots"}),  # set, so checked, even though the flag wins
        ([], {"DEVD_LOG_LEVEL": "loud"}),
        ([], {"DEVD_EXPIRE_AFTER": "soon"}),
        ([], {"DEVD_SOCKET": "tcp://127.0.0.1:7411"}),
    ]:
        with pytest.raises(SystemExit) as exit:
            cli.parse_args(["serve", *argv], environ)
        said.append((exit.value.code, capsys.readouterr().err.splitlines()[-1]))
    error = "devd serve: error: environment variable"
    assert said == [
        (2, f"{error} DEVD_MAX_LIVE (--max-live): invalid int value: 'lots'"),
        (2, f"{error} DEVD_MAX_LIVE (--max-live): invalid int value: 'lots'"),
        (
            2,
            f"{error} DEVD_LOG_LEVEL (--log-level): invalid choice: 'loud' "
            "(choose from 'debug', 'info', 'warning', 'error')",
        ),
        (
            2,
            f"{error} DEVD_EXPIRE_AFTER (--expire-after): a duration is a number with s, m, h or d after it (30d, "
            "12h), not 'soon'",
        ),
        (
            2,
            f"{error} DEVD_SOCKET (--socket): --socket takes the path of a Unix socket, not 'tcp://127.0.0.1:7411'; "
            "to serve TCP, pass --listen tcp://HOST:PORT",
        ),
    ]


def test_client_commands_do_not_read_serves_variables() -> None:
    assert cli.parse_args(["ls"], {"DEVD_MAX_LIVE": "lots"}).command == "ls"


def test_a_switch_is_set_by_1_true_or_yes_cleared_by_0_false_or_no_and_refuses_anything_else() -> None:
    command = argparse.ArgumentParser()
    command.add_argument("--follow-moved", action="store_true", help="a switch")
    values = [cli.environment_defaults(command, {"DEVD_FOLLOW_MOVED": v}) for v in ("1", "TRUE", "yes", "0", "No")]
    with pytest.raises(ValueError) as refused:
        cli.environment_defaults(command, {"DEVD_FOLLOW_MOVED": "maybe"})
    assert (values, str(refused.value)) == (
        [{"follow_moved": True}] * 3 + [{"follow_moved": False}] * 2,
        "environment variable DEVD_FOLLOW_MOVED (--follow-moved): 1, true or yes sets it, 0, false or no leaves it "
        "off; not 'maybe'",
    )


def test_every_serve_flag_shows_its_variable_in_its_help() -> None:
    serve = subcommands()["serve"]
    shown = [
        (max(a.option_strings, key=len), re.findall(r" \[env (\w+)\]$", a.help or ""))
        for a in serve._actions
        if a.dest != "help"
    ]
    assert shown == [
        ("--socket", ["DEVD_SOCKET"]),
        ("--listen", ["DEVD_LISTEN"]),
        ("--state-dir", ["DEVD_STATE_DIR"]),
        ("--backup-dir", ["DEVD_BACKUP_DIR"]),
        ("--core", ["DEVD_CORE"]),
        ("--call-timeout", ["DEVD_CALL_TIMEOUT"]),
        ("--max-call-timeout", ["DEVD_MAX_CALL_TIMEOUT"]),
        ("--max-sessions", ["DEVD_MAX_SESSIONS"]),
        ("--max-live", ["DEVD_MAX_LIVE"]),
        ("--live-memory", ["DEVD_LIVE_MEMORY"]),
        ("--session-memory", ["DEVD_SESSION_MEMORY"]),
        ("--store", ["DEVD_STORE"]),
        ("--node", ["DEVD_NODE"]),
        ("--advertise", ["DEVD_ADVERTISE"]),
        ("--lease-ttl", ["DEVD_LEASE_TTL"]),
        ("--snapshot-floor", ["DEVD_SNAPSHOT_FLOOR"]),
        ("--expire-after", ["DEVD_EXPIRE_AFTER"]),
        ("--max-connections", ["DEVD_MAX_CONNECTIONS"]),
        ("--max-line-bytes", ["DEVD_MAX_LINE_BYTES"]),
        ("--line-timeout", ["DEVD_LINE_TIMEOUT"]),
        ("--send-timeout", ["DEVD_SEND_TIMEOUT"]),
        ("--metrics", ["DEVD_METRICS"]),
        ("--otel-endpoint", ["DEVD_OTEL_ENDPOINT"]),
        ("--agents", ["DEVD_AGENTS"]),
        ("--log-format", ["DEVD_LOG_FORMAT"]),
        ("--log-level", ["DEVD_LOG_LEVEL"]),
    ]


def test_a_variable_reaches_the_daemon(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_MAX_LIVE": "1"}) as d, d.client() as c:
        c.new(session="a")
        c.new(session="b")  # past one live session: a hibernates
        states = [(s["session"], s["state"]) for s in c.call("session/list")["sessions"]]
    assert states == [("a", "stored"), ("b", "live")]


def test_devd_socket_is_where_serve_listens_and_where_the_client_commands_look(tmp_path: Path) -> None:
    where = tmp_path / "run" / "devd.sock"
    env = daemon_env(DEVD_SOCKET=str(where))
    argv = [sys.executable, "-m", "devd", "serve", "--state-dir", str(state_dir(tmp_path)), "--log-format", "json"]
    with running(argv, env, tmp_path / "devd.log") as proc:
        wait_connectable(where, proc).close()
        ls = subprocess.run([sys.executable, "-m", "devd", "ls"], env=env, capture_output=True, text=True, timeout=30)
        stopped = stop(proc)
    assert (ls.returncode, ls.stdout, stopped) == (0, "no sessions\n", 0)


def test_transcript_prints_the_conversation_from_a_message_on(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "fix the build"))
        c.step("s", answer(1, "done"))
    run = devd("transcript", "s", "--from", "1", "--json", "--connect", str(daemon.socket))
    assert (run.returncode, run.stdout) == (0, '{"seq":2,"from":1,"messages":[{"Agent":{"text":"done"}}]}\n')


def test_transcript_for_people_is_the_messages_as_indented_json(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "fix the build"))
    run = devd("transcript", "s", "--connect", str(daemon.socket))
    assert (run.returncode, run.stdout) == (0, '[\n  {\n    "User": "fix the build"\n  }\n]\n')


def test_info_shows_the_sessions_entry_and_what_its_turn_waits_for(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "fix the build"))
    run = devd("info", "s", "--connect", str(daemon.socket))
    assert (run.returncode, run.stdout.splitlines()[-1]) == (0, "waiting for: Model (id 1)")


def test_every_plain_command_calls_a_method_of_the_table_with_its_params() -> None:
    from devd.protocol import METHODS

    assert [p.method in METHODS for p in cli.PLAIN] == [True] * len(cli.PLAIN)


def test_a_client_command_loads_none_of_the_daemons_logging_listeners_or_core() -> None:
    """`devd ls` and its kind start as fast as a client can: the daemon's modules are loaded by `devd serve` alone
    (the metrics text format, which `devd status --prometheus` prints, is the one server module a client needs)."""
    code = (
        "import sys, devd.cli; from devd.cli.parser import parse_args; parse_args(['ls'], {}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('structlog', 'wasmtime') "
        "or m.startswith(('devd.server', 'devd.log', 'devd.host', 'devd.storage.sqlite'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "['devd.server', 'devd.server.metrics']\n"


def test_an_event_that_carries_a_second_request_is_refused_and_nothing_runs(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="victim")
        c.new(session="stepper")
    smuggled = '{"Timer":true}}}\n{"jsonrpc":"2.0","id":99,"method":"session/close","params":{"session":"victim"'
    run = devd("step", "stepper", smuggled, "--connect", str(daemon.socket))
    with daemon.client() as c:
        names = [s.session for s in c.list().sessions]
    assert (run.returncode, run.stderr, names) == (
        2,
        "devd: the event is not one JSON value (JSON is malformed: trailing characters (byte 15)); give it as JSON, "
        'such as {"Timer":true}\n',
        ["stepper", "victim"],
    )


def test_an_event_written_over_several_lines_is_stepped(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{\n  "Timer": true\n}', "--json", "--connect", str(daemon.socket))
    assert (run.returncode, run.stdout) == (0, '{"actions":[]}\n')


def test_an_argument_that_is_not_utf8_is_refused_in_a_line(daemon: InProcess) -> None:
    run = devd("new", "--session", os.fsdecode(b"a\xff"), "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (
        2,
        "devd: an argument is not UTF-8 text (the bytes b'\\xff'); give it as UTF-8\n",
    )


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--call-timeout", "0", "0 is not a number of seconds above 0"),
        ("--call-timeout", "-1", "-1 is not a number of seconds above 0"),
        ("--line-timeout", "inf", "inf is not a number of seconds above 0"),
        (
            "--max-line-bytes",
            "10",
            "10 is less than 1024: a line this short cannot hold a request, nor its answer be matched to it",
        ),
        ("--max-live", "0", "0 is less than 1: no session could be held in memory to take a call"),
        ("--max-connections", "0", "0 is less than 1: no client could connect"),
    ],
)
def test_serve_refuses_a_value_that_would_leave_the_daemon_unusable(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(["serve", "--socket", "/run/x.sock", flag, value], {})
    assert (exit.value.code, capsys.readouterr().err.splitlines()[-1]) == (
        2,
        f"devd serve: error: argument {flag}: {said}",
    )


def test_a_start_that_fails_leaves_no_socket_behind(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "devd.sqlite3").write_bytes(b"not a database")
    run = devd("serve", "--socket", str(tmp_path / "d.sock"), "--state-dir", str(state))
    assert (run.returncode, (tmp_path / "d.sock").exists()) == (2, False)


def test_a_core_that_cannot_be_read_is_refused_naming_the_flag_and_what_to_pass(tmp_path: Path) -> None:
    missing = tmp_path / "none.wasm"
    where = ("--socket", str(tmp_path / "d.sock"), "--state-dir", str(tmp_path / "s"))
    run = devd("serve", *where, "--core", str(missing))
    assert (run.returncode, run.stderr.splitlines()[-1]) == (
        2,
        f"devd: cannot start: the core {missing} (--core) cannot be loaded: No such file or directory; pass a wasm "
        "module built from core/ (ABI 2), or leave --core out for the packaged one",
    )
