"""The `devd` command as a user runs it: tables and `key: value` lines for people and `--json` for scripts, errors
in the command's terms, exit codes, what it says when the daemon is not there, flags passed through as given, help
for every flag, and `devd watch` following a session for as long as it lasts."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from devd import __version__, cli
from devd.client import Client, NotRunningError
from devd.errors import HandleError, InternalError, InvalidParamsError, UnauthorizedError
from devd.messages import turn
from tests.daemon import Daemon, free_port


def devd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devd", *args], capture_output=True, text=True, timeout=timeout)


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


def test_an_empty_key_is_sent_and_refused_not_dropped(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{"Timer":true}', "--key", "", "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (1, "devd: INVALID_PARAMS: the key must be 1-256 bytes of UTF-8\n")


def test_a_zero_timeout_is_sent_and_refused_not_dropped(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{"Timer":true}', "--timeout-ms", "0", "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (
        1,
        "devd: INVALID_PARAMS: timeout_ms must be a positive number of milliseconds\n",
    )


def test_watch_follows_a_session_and_exits_0_when_it_closes(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
        watch = subprocess.Popen(
            [sys.executable, "-m", "devd", "watch", "s", "--connect", str(daemon.socket)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        c.step("s", turn(1, "x"))
        time.sleep(0.5)
        c.call("session/close", {"session": "s"})
        out, err = watch.communicate(timeout=30)
    methods = [line.split('"method":"')[1].split('"')[0] for line in out.splitlines()]
    assert (watch.returncode, methods, err) == (0, ["session/actions", "session/unwatched"], "")


def test_the_blocking_client_waits_for_a_notification_past_its_own_timeout(daemon: Daemon) -> None:
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


def test_durations_show_their_two_largest_units() -> None:
    shown = [cli._duration(s) for s in (0.25, 12.5, 245, 11_520, 183_600)]
    assert shown == ["0.2s", "12.5s", "4m 5s", "3h 12m", "2d 3h"]


def test_ls_shows_the_sessions_as_a_table(daemon: Daemon) -> None:
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


def test_ls_pages_with_limit_and_cursor_and_says_how_to_get_the_next_page(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="a")
        c.new(session="b")
    first = devd("ls", "--limit", "1", "--connect", str(daemon.socket))
    last = devd("ls", "--limit", "1", "--cursor", "a", "--connect", str(daemon.socket))
    assert [line.split()[0] for line in first.stdout.splitlines()] == ["NAME", "a"]
    assert first.stderr == "devd: more sessions follow: devd ls --limit 1 --cursor a\n"
    assert ([line.split()[0] for line in last.stdout.splitlines()], last.stderr) == (["NAME", "b"], "")


def test_json_prints_the_daemons_answer_exactly_as_it_came(daemon: Daemon) -> None:
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


def test_status_shows_key_value_lines_and_json_the_counters(daemon: Daemon) -> None:
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


def test_an_unknown_session_is_answered_in_the_commands_terms_with_exit_1(daemon: Daemon) -> None:
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


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_flag_of_every_command_has_help() -> None:
    silent = [
        f"devd {name} {action.option_strings or action.dest}"
        for name, command in subcommands().items()
        for action in command._actions
        if not action.help
    ]
    assert silent == []


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
