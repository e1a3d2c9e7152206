"""The `devd` command: `serve` runs the daemon in the foreground, `doctor` checks an installation, `schema` prints
the protocol's types, and the other subcommands are clients of the daemon.

What it promises: a client command shows the daemon's answer for people (a table for `devd ls`, `key: value` lines
for `devd status`), or with `--json` exactly the JSON the daemon answered, for scripts. An error the daemon answers
is said in the command's terms (the command for a method it names, the flag for a token it wants). The exit status
says what happened (`EXIT_CODES`, shown by `devd --help`): 0 done, 1 the daemon answered an error, 2 a usage or
local problem, 3 the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from devd.cli.common import (
    EXIT_ANSWERED_ERROR,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_UNREACHABLE,
    LocalError,
    OutputClosed,
    _address,
    _duration,
    _token,
    in_cli_terms,
)
from devd.cli.operator import (
    _backup,
    _doctor,
    _inspect,
    _mcp,
    _status,
    action_summary,
    inspection,
    status_summary,
)
from devd.cli.parser import environment_defaults, flag_variable, parse_args, parser
from devd.cli.sessions import (
    PLAIN,
    _answer,
    _budget,
    _decision,
    _info,
    _ls,
    _new,
    _restore,
    _resume,
    _run_plain,
    _step,
    _tree,
    _watch,
    sessions_table,
)
from devd.errors import DevdError

if TYPE_CHECKING:
    from devd.client import Client

__all__ = [
    "EXIT_ANSWERED_ERROR",
    "EXIT_CODES",
    "EXIT_INTERRUPTED",
    "EXIT_LOCAL",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "LocalError",
    "PLAIN",
    "_address",
    "_duration",
    "action_summary",
    "environment_defaults",
    "flag_variable",
    "in_cli_terms",
    "inspection",
    "parse_args",
    "parser",
    "sessions_table",
    "status_summary",
    "main",
]


COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "backup": _backup,
    "status": _status,
    "mcp": _mcp,
    "ls": _ls,
    "new": _new,
    "step": _step,
    "restore": _restore,
    "inspect": _inspect,
    "watch": _watch,
    **{plain.command: _run_plain(plain) for plain in PLAIN},
    "approve": _decision("allow"),
    "deny": _decision("deny"),
    "answer": _answer,
    "info": _info,
    "resume": _resume,
    "budget": _budget,
    "tree": _tree,
}


def _run_client(args: argparse.Namespace) -> int:
    from devd.client import Client

    def run() -> int:
        with Client.connect(_address(args), token=_token(args), peers=args.peer) as client:
            return COMMANDS[args.command](client, args)

    return _reported(args, run)


def _reported(args: argparse.Namespace, run: Callable[[], int]) -> int:
    """run()'s exit status, or the one its error means (EXIT_CODES), the error said in the command's terms."""
    from devd.client import NotRunningError

    try:
        return run()
    except LocalError as e:
        print(f"devd: {e}", file=sys.stderr)
        return EXIT_LOCAL
    except UnicodeEncodeError as e:  # an argument of bytes that are not UTF-8, which the protocol cannot carry
        bad = e.object[e.start : e.end].encode("utf-8", "surrogateescape")
        print(f"devd: an argument is not UTF-8 text (the bytes {bad!r}); give it as UTF-8", file=sys.stderr)
        return EXIT_LOCAL
    except OutputClosed:
        # Whatever is still buffered for stdout has nowhere to go: let the interpreter's last flush find nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except DevdError as e:
        print(f"devd: {e.kind}: {in_cli_terms(e, args)}", file=sys.stderr)
        return EXIT_ANSWERED_ERROR
    except NotRunningError as e:
        print(f"devd: {e.strerror}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (OSError, ConnectionError) as e:
        print(f"devd: cannot reach the daemon at {_address(args)}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, os.environ)
    if args.command == "serve":
        # Here, not at the top: the daemon's logging, listeners and systemd glue are no client command's business,
        # and each `devd ls` would load them (structlog alone is about 60 ms of a command's start).
        from devd.cli.serve import _serve

        return _serve(args)
    if args.command == "schema":
        from devd.schema import openrpc_json, schema_json, typescript

        if args.typescript:
            sys.stdout.write(typescript())
        else:
            sys.stdout.buffer.write((openrpc_json() if args.openrpc else schema_json()) + b"\n")
        return 0
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "acp":
        from devd.acp.main import main as acp_main

        try:  # the address and token as every client command finds them; the rest is acp's own
            token = _token(args)
        except LocalError as e:
            print(f"devd acp: {e}", file=sys.stderr)
            return EXIT_LOCAL
        return acp_main(args, _address(args), token)
    if args.command in ("run", "attach", "chat"):
        return _run_agent(args)
    return _run_client(args)


def _run_agent(args: argparse.Namespace) -> int:
    """`devd chat`, `devd run` and `devd attach` (devd.cli.chat), with the errors and exit status of the other client
    commands."""
    from devd.cli import chat

    return _reported(args, lambda: chat.main(args, _address(args), _token(args)))
