"""The command line: every subcommand's flags, and for `devd serve` each flag's environment variable."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from devd import __version__
from devd.addresses import TcpListen
from devd.cli.common import EXIT_CODES, POSTGRES_SCHEMES, _flag_value, _socket_path
from devd.cli.sessions import PLAIN, _plain_arguments
from devd.config import (
    default,
    default_socket_path,
    default_state_dir,
    parse_duration,
    parse_size,
)


def _flags(command: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in command._actions if action.option_strings and action.dest != "help"]


def flag_variable(action: argparse.Action) -> str:
    """The environment variable a flag of `devd serve` is read from: --max-live from DEVD_MAX_LIVE."""
    return "DEVD_" + max(action.option_strings, key=len).removeprefix("--").replace("-", "_").upper()


def _otel_endpoint(text: str) -> str:
    if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", text):
        raise argparse.ArgumentTypeError(
            f"--otel-endpoint takes a collector's OTLP/HTTP base URL (e.g. http://127.0.0.1:4318), not {text!r}"
        )
    return text


def _metrics_address(text: str) -> TcpListen:
    try:
        return TcpListen.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--metrics takes tcp://HOST:PORT (e.g. tcp://127.0.0.1:9464), not {text!r}"
        ) from None


def _store_url(text: str) -> str:
    if text.startswith(POSTGRES_SCHEMES) or (text.startswith("sqlite:") and len(text) > len("sqlite:")):
        return text
    raise argparse.ArgumentTypeError(f"--store takes postgresql://USER@HOST/DB (a fleet) or sqlite:PATH, not {text!r}")


_SWITCH = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _at_least(minimum: int, why: str) -> Callable[[str], int]:
    """An int flag refused below `minimum` (`why`: what a smaller one would do to the daemon)."""

    def parse(text: str) -> int:
        n = int(text)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} is less than {minimum}: {why}")
        return n

    parse.__name__ = "int"  # argparse names a value it cannot parse by its type's name: "invalid int value"
    return parse


def _seconds(text: str) -> float:
    """A duration flag in seconds: a number above 0 (at 0 or below, every call would be past its deadline)."""
    s = float(text)
    if not 0 < s < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return s


_seconds.__name__ = "float"


def _from_environment(action: argparse.Action, variable: str, text: str) -> Any:
    """text as the flag's value, checked as argparse checks one given on the command line; ValueError, naming the
    variable, when the flag would refuse it."""
    said = f"environment variable {variable} ({max(action.option_strings, key=len)})"
    if action.nargs == 0:  # a switch, which takes no value on the command line
        if text.lower() not in _SWITCH:
            raise ValueError(f"{said}: 1, true or yes sets it, 0, false or no leaves it off; not {text!r}")
        return _SWITCH[text.lower()]
    convert = action.type if callable(action.type) else str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{said}: {e}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{said}: invalid {getattr(convert, '__name__', 'value')} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise ValueError(f"{said}: invalid choice: {text!r} (choose from {choices})")
    return value


def environment_defaults(command: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """The values command's flags take from the environment, by dest: each from its variable (`flag_variable`) when
    that is set and not empty (an empty one is unset, as an empty DEVD_SOCKET always was for the client commands, so
    systemd's `Environment=DEVD_X=` clears one). ValueError, naming the variable, for a value the flag would refuse."""
    values = {}
    for action in _flags(command):
        variable = flag_variable(action)
        if text := environ.get(variable):
            values[action.dest] = _from_environment(action, variable, text)
    return values


def parse_args(argv: list[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
    """The command line. For `devd serve`, each flag left out takes its value from its variable in environ, when set:
    the command line wins. A variable that is set must hold a value its flag takes, even when the flag is given too
    (a typo in a systemd drop-in is reported at once, not left for the day the flag is dropped); otherwise this
    exits 2, as for a bad flag, naming the variable."""
    words = sys.argv[1:] if argv is None else argv
    top, serve = _parsers(words[0] if words and not words[0].startswith("-") else None)
    args = top.parse_args(words)
    if args.command != "serve":
        return args
    assert serve is not None
    try:
        serve.set_defaults(**environment_defaults(serve, environ))
    except ValueError as e:
        serve.error(str(e))
    return top.parse_args(words)  # again, now that the environment's values are the defaults


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written, and every flag's default after its help, except where there is none to
    show (None, or a switch's False): those flags say in their help what leaving them out does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _escaped(text: object) -> str:
    return str(text).replace("%", "%%")  # argparse %-formats help


def _connection_flags(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--connect",
        metavar="ADDRESS",
        help="the daemon's socket path, or tcp://HOST:PORT (default: $DEVD_SOCKET, else where `devd serve` listens "
        f"by default; here {_escaped(os.environ.get('DEVD_SOCKET') or default_socket_path())})",
    )
    c.add_argument("--token", help="the daemon's TCP token (--token-file keeps it out of `ps`)")
    c.add_argument(
        "--token-file", metavar="PATH", help="read the TCP token from this file: the daemon's STATE_DIR/token"
    )
    c.add_argument(
        "--peer",
        metavar="ADDRESS",
        action="append",
        default=[],
        help="another daemon of the fleet this command may follow MOVED to, and give the token (repeatable); "
        "without it MOVED is followed only to Unix sockets of this machine (docs/fleet.md)",
    )


def parser() -> argparse.ArgumentParser:
    """The `devd` command line (for `devd serve`'s environment variables, see `parse_args`)."""
    return _parsers()[0]


def _parsers(only: str | None = None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The `devd` command line, and its `serve` subcommand's, whose flags also read the environment (None when it
    is not built). With `only` a command's name, that subcommand alone is built: argparse builds every subcommand's
    flags in about 26 ms here, most of what a short command takes before it does anything (and a tenth of the
    daemon's start). Another word gets the whole command line, so its error names the commands there are."""
    p = (argparse.ArgumentParser if only is None else _Lone)(
        prog="devd",
        description="A session daemon for agent tools. `devd serve` runs it; the other commands talk to it.",
        epilog=EXIT_CODES,
        formatter_class=_Help,
    )
    p.add_argument("--version", action="version", version=f"devd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)  # not _Lone

    def wanted(name: str) -> bool:
        return only is None or name == only

    serve = _add_serve(sub) if wanted("serve") else None
    if wanted("schema"):
        _add_schema(sub)
    _add_clients(sub, wanted)
    if wanted("run"):
        _add_run(sub)
    if wanted("chat"):
        _add_chat(sub)
    if wanted("attach"):
        _add_attach(sub)
    if wanted("acp"):
        _add_acp(sub)
    if wanted("doctor"):
        _add_doctor(sub)
    if only is not None and only not in sub.choices:
        return _parsers()
    return p, serve


class _Lone(argparse.ArgumentParser):
    """The top level built with one subcommand: what it refuses (an argument past the command's) is said by the whole
    command line, whose usage names every command, not that one alone."""

    def error(self, message: str) -> NoReturn:
        _parsers()[0].error(message)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground until SIGTERM or SIGINT (exit 0; 2 when it cannot start). "
        "Each flag may be set in the environment instead, as its [env VARIABLE] says (--max-live as DEVD_MAX_LIVE; "
        "1, true or yes for a switch); the command line wins.",
        formatter_class=_Help,
    )
    serve.add_argument(
        "--socket",
        metavar="PATH",
        type=_socket_path,
        help="the Unix socket to listen on (default: $DEVD_SOCKET, which is also where the client commands look for "
        "the daemon, else $RUNTIME_DIRECTORY/devd.sock, else $XDG_RUNTIME_DIR/devd/devd.sock, else "
        f"/tmp/devd-UID/devd.sock; here {_escaped(os.environ.get('DEVD_SOCKET') or default_socket_path())}); "
        "ignored when systemd passes the daemon its sockets",
    )
    serve.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        type=_flag_value(TcpListen.parse),
        help="also listen on TCP, where a connection must first present the token from STATE_DIR/token "
        "(default: the Unix socket only)",
    )
    serve.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where the sessions, the token and the lock are kept (default: $STATE_DIRECTORY, else "
        f"$XDG_STATE_HOME/devd; here {_escaped(default_state_dir())})",
    )
    serve.add_argument(
        "--backup-dir",
        metavar="DIR",
        help="where daemon/backup (devd backup NAME) writes its copies, each by a plain file name; made 0700, and "
        "refused like the state directory when it is another user's or others may write it "
        "(default: STATE_DIR/backups)",
    )
    serve.add_argument(
        "--core", metavar="PATH", help="load this wasm module (ABI 2) instead of the packaged core (default: packaged)"
    )
    serve.add_argument(
        "--call-timeout",
        type=_seconds,
        metavar="S",
        default=default("call_timeout_s"),
        help="default deadline of a call, in seconds",
    )
    serve.add_argument(
        "--max-call-timeout",
        type=_seconds,
        metavar="S",
        default=default("max_call_timeout_s"),
        help="the longest deadline a client may ask for, in seconds (longer ones are cut to it)",
    )
    serve.add_argument(
        "--max-sessions",
        type=_at_least(1, "the daemon could keep no session"),
        metavar="N",
        default=default("sessions_max"),
        help="sessions kept, live or stored",
    )
    serve.add_argument(
        "--max-live",
        type=_at_least(1, "no session could be held in memory to take a call"),
        metavar="N",
        default=default("max_live"),
        help="sessions held in memory; past it the least recently used idle one hibernates (to disk)",
    )
    serve.add_argument(
        "--live-memory",
        metavar="SIZE",
        type=_flag_value(parse_size),
        help="the sessions in memory together may use this much (e.g. 4G); past it the least recently used idle "
        "ones hibernate. Default: half of this machine's memory (each session's own cap is --session-memory)",
    )
    serve.add_argument(
        "--session-memory",
        metavar="SIZE",
        type=_flag_value(parse_size),
        default=default("memory_bytes_per_session"),
        help="the most memory one session's instance may use (e.g. 128M); a step that would need more is refused "
        "(NULL) and the session goes on",
    )
    serve.add_argument(
        "--store",
        metavar="URL",
        type=_store_url,
        help="where sessions are kept: sqlite:PATH, or postgresql://USER@HOST/DB to share them with other daemons "
        "(a fleet: see docs/fleet.md). Default: sqlite:STATE_DIR/devd.sqlite3",
    )
    serve.add_argument(
        "--node",
        metavar="NAME",
        help="this daemon's name in a fleet (default: HOSTNAME-PID); it must be unique among the daemons",
    )
    serve.add_argument(
        "--advertise",
        metavar="ADDRESS",
        help="where other daemons of a fleet send this one's clients: unix:PATH or tcp://HOST:PORT "
        "(default: its first listener)",
    )
    serve.add_argument(
        "--lease-ttl",
        type=_seconds,
        metavar="SECONDS",
        default=10.0,
        help="a fleet daemon that cannot renew its lease for this long stops writing, and its sessions may be "
        "taken over by others",
    )
    serve.add_argument(
        "--snapshot-floor",
        type=_at_least(0, "a size of journal cannot be negative"),
        metavar="BYTES",
        default=default("snapshot_floor_bytes"),
        help="journal bytes since a session's last snapshot below which no new one is taken (a replay of that "
        "much is cheap); past it, one is taken at the end of a turn once the journal outgrows a quarter of the last "
        "snapshot",
    )
    serve.add_argument(
        "--expire-after",
        metavar="DURATION",
        type=_flag_value(parse_duration),
        help="delete sessions no call has used for this long (e.g. 30d, 12h); default: keep them",
    )
    serve.add_argument(
        "--max-connections",
        type=_at_least(1, "no client could connect"),
        metavar="N",
        default=default("connections_max"),
        help="connections open at once, for each of the Unix socket and TCP; past it, a new one is refused (FULL)",
    )
    serve.add_argument(
        "--max-line-bytes",
        type=_at_least(1024, "a line this short cannot hold a request, nor its answer be matched to it"),
        metavar="BYTES",
        default=default("line_bytes_max"),
        help="the longest request line, in bytes; a longer one is discarded and answered TOO_LARGE",
    )
    serve.add_argument(
        "--line-timeout",
        type=_seconds,
        metavar="S",
        default=default("line_timeout_s"),
        help="seconds a request line may take to arrive",
    )
    serve.add_argument(
        "--send-timeout",
        type=_seconds,
        metavar="S",
        default=default("send_timeout_s"),
        help="seconds a client may take no bytes while the daemon has some for it, before it is disconnected",
    )
    serve.add_argument(
        "--metrics",
        metavar="tcp://HOST:PORT",
        type=_metrics_address,
        help="also answer HTTP GET /metrics there, in the Prometheus text format (as `devd status --prometheus`); "
        "use a loopback address unless others should read the counters (default: off)",
    )
    serve.add_argument(
        "--otel-endpoint",
        metavar="URL",
        type=_otel_endpoint,
        help="also export the trace of the sessions the daemon drives as OpenTelemetry spans (GenAI conventions, no "
        "message content) over OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 (default: off)",
    )
    serve.add_argument(
        "--agents",
        metavar="FILE",
        help="the agent profiles ([agent.NAME] tables, see the README's agent runtime section) of the sessions the "
        "daemon drives itself (default: $CONFIGURATION_DIRECTORY/agents.toml under systemd, else "
        "$XDG_CONFIG_HOME/devd/agents.toml, when there is one; else none)",
    )
    serve.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="json: one object a line, for journald and containers; console: for people (default: console when "
        "stderr is a terminal, else json)",
    )
    serve.add_argument(
        "--log-level",
        default=default("log_level"),
        choices=["debug", "info", "warning", "error"],
        help="the least severe events logged: info adds the daemon's and sessions' lifecycle to the warnings and "
        "errors that need attention (docs/operations.md lists the events)",
    )
    for action in _flags(serve):
        action.help = f"{action.help} [env {flag_variable(action)}]"
    return serve


def _add_schema(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    schema = sub.add_parser("schema", help="print the JSON Schema of every message of the protocol")
    form = schema.add_mutually_exclusive_group()
    form.add_argument(
        "--openrpc", action="store_true", help="print an OpenRPC 1.3 document instead: methods, params and results"
    )
    form.add_argument(
        "--typescript", action="store_true", help="print the protocol's types as a TypeScript module instead"
    )


def _add_clients(sub: argparse._SubParsersAction[argparse.ArgumentParser], wanted: Callable[[str], bool]) -> None:
    """The commands that are one client call or a few (those `wanted` says; the others are not built)."""

    def client(name: str, help: str, json: str = "", *, session: bool = False) -> argparse.ArgumentParser | None:
        if not wanted(name):
            return None
        c = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=_Help)
        _connection_flags(c)
        c.add_argument(
            "--json",
            action="store_true",
            help=json or "print the daemon's answer exactly as it sent it, on one line (for scripts)",
        )
        if session:
            c.add_argument("session", help="the session's name")
        return c

    if status := client("status", "show the daemon's counters: sessions, steps, commits, errors, memory"):
        status.add_argument("--prometheus", action="store_true", help="in the Prometheus text format (--json wins)")
    client("mcp", "list the MCP servers the daemon holds: state, process, sessions, tools, restarts, last error")
    if ls := client("ls", "list the sessions by name: a table of their state, last step, watchers and times"):
        ls.add_argument(
            "--limit", type=int, metavar="N", help="at most this many sessions, 1-100000 (default: all of them)"
        )
        ls.add_argument("--cursor", metavar="NAME", help="start after this name (the page before says which)")
    if new := client("new", "start a session and print its name"):
        new.add_argument("--model", help="the model the session's Model actions name (default: none is named)")
        new.add_argument("--session", help="name it (default: chosen by the daemon)")
    if step := client(
        "step", "step a session with an event (JSON) and print the actions answered (JSON)", session=True
    ):
        step.add_argument("event", help='the event, e.g. \'{"Turn":{"id":1,"prompt":"fix the build"}}\'')
        step.add_argument(
            "--key", help="idempotency key: the step sent again with it is answered from the journal, never run twice"
        )
        step.add_argument(
            "--timeout-ms", type=int, help="this step's deadline in milliseconds (default: the daemon's --call-timeout)"
        )
    if watch := client(
        "watch",
        "print every step of a session as it happens, as JSON lines, until the session is closed",
        json="accepted for uniformity: watch always prints the protocol's notifications as JSON lines",
        session=True,
    ):
        watch.add_argument("--since", type=int, help="start after this step, 0 for all of them (default: from now on)")
    if restore := client("restore", "start a session from a snapshot and print its name"):
        restore.add_argument("snapshot", help="the snapshot (base64), or - to read it from stdin")
        restore.add_argument("--session", help="name it (default: chosen by the daemon)")
    client(
        "inspect",
        "show one session at a glance: its state, step, watchers and times, and the actions a running turn "
        "waits for (asking them loads a stored session)",
        json='print {"session": its entry as `devd ls --json` has it, "pending": the actions, as `devd pending '
        "--json` has them, or null for an ended or poisoned session} on one line",
        session=True,
    )
    for plain in PLAIN:
        if command := client(plain.command, plain.help):
            _plain_arguments(command, plain)
    asks = "answer an MCP server's question (`session/input`) in a session the daemon drives"
    if answer := client("answer", asks, session=True):
        answer.add_argument("action", type=int, help="the action whose server asks (its session/input says)")
        answer.add_argument("request", type=int, help="the question's number (its session/input says)")
        answer.add_argument(
            "words",
            nargs="*",
            help="the answer: a JSON object, or field=value words (a value that reads as JSON, true or 3, is taken "
            "as that; else as text)",
        )
        answer.add_argument("--decline", action="store_true", help="decline the question instead")
    for verb, does in (("approve", "allow"), ("deny", "deny")):
        if decide := client(
            verb, f"{does} an action of a session the daemon drives that waits for approval", session=True
        ):
            decide.add_argument("action", type=int, help="the action's id (`devd pending SESSION` shows it)")
            decide.add_argument(
                "--remember",
                action="store_const",
                const="exact",
                default=False,
                help=f"{does} later calls of exactly the same argv (Exec, Git) or path (Write) in this session too",
            )
            decide.add_argument(
                "--remember-prefix",
                dest="remember",
                action="store_const",
                const="prefix",
                help=f'{does} later calls of the same argv followed by more words, none starting with "-", too',
            )
    client(
        "resume",
        "try a stalled session's action again (after `devd budget` when a spend ceiling stalled it)",
        json="print the daemon's answer ({}) instead",
        session=True,
    )
    if budget := client(
        "budget",
        "set a session's spend ceiling in tokens; a stall it caused carries on with `devd resume`",
        json="print the daemon's answer ({}) instead",
        session=True,
    ):
        budget.add_argument("tokens", type=_budget_tokens, help="the ceiling in tokens (e.g. 200000), or none")
    client(
        "tree",
        "show a session and its delegated runs (child sessions), each under its parent: agent, state, tokens and "
        "calls (its children's included)",
        json="print the tree as JSON: {session, agent, state, why, input_tokens, output_tokens, calls, children}",
        session=True,
    )
    if backup := client("backup", "have the daemon write a consistent copy of every session to a new file"):
        backup.add_argument(
            "name",
            help="the file name of the copy, in the daemon's backup directory (devd serve --backup-dir; default "
            "STATE_DIR/backups); it must not exist there",
        )


def _budget_tokens(text: str) -> int | None:
    from devd.cli.sessions import budget_tokens

    try:
        return budget_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # The agent runtime's: a turn the daemon drives, shown as it happens (devd.agent.cli).
    run = sub.add_parser(
        "run",
        help="have the daemon carry out a turn of an agent and show it as it happens",
        description="Start a session of an agent (or continue --session) with PROMPT and show the turn as the daemon "
        "carries it out: the model's text as it streams, each call and its result, the outcome; at a terminal, "
        "approvals are asked inline. Exit 0 when the turn is done, 1 when it ended otherwise, 130 after Ctrl-C "
        "(which cancels the turn). Without PROMPT, as `devd chat`.",
        formatter_class=_Help,
    )
    _session_flags(run)
    run.add_argument("prompt", nargs="?", help="what to ask the agent (none: an interactive session, as devd chat)")


def _session_flags(c: argparse.ArgumentParser) -> None:
    _connection_flags(c)
    c.add_argument("--agent", help="the agent profile (default: the daemon's only one, when it has one)")
    c.add_argument("--workspace", metavar="DIR", help="the session's workspace (default: the current directory)")
    c.add_argument("--session", help="continue this session (made, of --agent in --workspace, if there is none)")


def _add_chat(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chat = sub.add_parser(
        "chat",
        help="talk to an agent in the terminal: a session the daemon drives, prompt after prompt",
        description="An interactive session of an agent in the terminal (a new one, or --session): a line is a "
        "prompt (a `\\` before Enter, or Esc then Enter, starts a new line; Up and Down go through the history), a "
        "line starting with / a command (/help lists them). The model's text streams in place, calls and results "
        "under their own headers, approvals are asked inline (y, n, or a: always), a status line says what the turn "
        "does. Ctrl-C cancels the running turn; a second Ctrl-C or Ctrl-D leaves with exit 0 (the session stays: "
        "`devd chat --session NAME` comes back to it).",
        formatter_class=_Help,
    )
    _session_flags(chat)


def _add_attach(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    attach = sub.add_parser(
        "attach",
        help="show the turn of a session the daemon drives as it happens, until it ends",
        description="Show what the daemon does for a session (someone else prompted) as it happens, until its "
        "running turn ends (exit 0) or Ctrl-C (130; the turn goes on).",
        formatter_class=_Help,
    )
    _connection_flags(attach)
    attach.add_argument("session", help="the session's name")


def _add_acp(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from devd.acp.main import add_arguments as acp_arguments

    acp = sub.add_parser(
        "acp",
        help="be an Agent Client Protocol agent on stdin/stdout for an editor, backed by the daemon (docs/editors.md)",
        description="Be an Agent Client Protocol (v1) agent on stdin/stdout, as an editor spawns one (Zed, Neovim's "
        "CodeCompanion, Emacs' agent-shell: docs/editors.md), whose sessions are the running daemon's. Exit 0 when "
        "the editor closes our input, 3 when no daemon answers at the start.",
        formatter_class=_Help,
    )
    _connection_flags(acp)
    acp_arguments(acp)


def _add_doctor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check the daemon, its state directory, database and core",
        description="Check the daemon, its state directory, database and core, one line per check: ok, FAIL and "
        "what to do, or skip and why. Exit 0 when no check fails, else 1. The database's integrity is checked only "
        "while no daemon holds the state directory (a running daemon keeps the file open exclusively).",
        formatter_class=_Help,
    )
    _connection_flags(doctor)
    doctor.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the daemon's state directory (default: as `devd serve` chooses it; "
        f"here {_escaped(default_state_dir())})",
    )
    doctor.add_argument("--core", metavar="PATH", help="the core `devd serve --core` loads (default: the packaged one)")
    doctor.add_argument(
        "--store",
        metavar="URL",
        type=_store_url,
        help="the store `devd serve --store` is given: sqlite:PATH, or a fleet's postgresql://USER@HOST/DB "
        "(default: sqlite:STATE_DIR/devd.sqlite3)",
    )
