"""What every `devd` command shares: exit statuses, errors said in the command's terms, the address and token of the
daemon, and output."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from devd.addresses import UnixListen, address
from devd.config import (
    default_socket_path,
    default_state_dir,
)
from devd.errors import DevdError
from devd.render import METHOD_COMMANDS as METHOD_COMMANDS  # the commands for the methods, with the words for people
from devd.render import in_devd_terms as in_devd_terms
from devd.render import inline, json_safe

if TYPE_CHECKING:
    pass


EXIT_OK = 0

EXIT_ANSWERED_ERROR = 1  # the daemon answered an error (also: `devd watch` dropped, a `devd doctor` check failed)

EXIT_LOCAL = 2  # argparse's own status for a bad flag, so local problems share it: a token file, a refused start

EXIT_UNREACHABLE = 3  # no daemon at the address, or the connection to it was lost

EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT

EXIT_CODES = """\
exit status:
  0    done
  1    the daemon answered an error, printed as `devd: KIND: what to do`; `devd watch`: the daemon dropped the
       watch because this client fell behind (watch again with --since); `devd doctor`: a check failed
  2    a usage or local problem: a bad flag (or DEVD_* variable of `devd serve`), a token file that cannot be
       read; `devd serve`: it cannot start, or its store failed
  3    the daemon cannot be reached: none listens at the address (start one with `devd serve`, or
       `systemctl --user start devd.socket`), or the connection was lost
  130  interrupted (Ctrl-C)

environment:
  DEVD_SOCKET  where the client commands find the daemon when --connect is not given, and where `devd serve`
               listens when --socket is not; unset, both use $RUNTIME_DIRECTORY/devd.sock, else
               $XDG_RUNTIME_DIR/devd/devd.sock, else /tmp/devd-UID/devd.sock
  DEVD_*       each flag of `devd serve` (DEVD_MAX_LIVE for --max-live: see `devd serve --help`); the command line
               wins

docs/operations.md covers running devd under systemd, its logs, metrics, `devd doctor` and upgrades."""


class LocalError(Exception):
    """Something on this side stops the command before the daemon is asked (a token file that cannot be read)."""


class OutputClosed(Exception):
    """Whoever reads our output stopped reading (`devd ls | head`): nothing more to say, and nothing went wrong."""


def _address(args: argparse.Namespace) -> str:
    return args.connect or os.environ.get("DEVD_SOCKET") or str(default_socket_path())


def _token_hint() -> str:
    return (
        "the daemon writes its token to STATE_DIR/token when it listens on TCP "
        f"({default_state_dir() / 'token'} for a daemon of yours with the default state directory, "
        "/var/lib/devd/token under systemd's devd.service)"
    )


def _token(args: argparse.Namespace) -> str | None:
    """The token for TCP: --token, else what --token-file holds. LocalError when that file cannot be read."""
    if args.token is not None:
        return str(args.token)
    if not args.token_file:
        return None
    try:
        return Path(args.token_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise LocalError(f"cannot read the token file {args.token_file}: {why}; {_token_hint()}") from None


def _emit(data: bytes) -> None:
    """Write to stdout now (a watch's lines must not wait in a buffer); OutputClosed when the reader has gone."""
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise OutputClosed from None


def _pretty(raw: bytes) -> bytes:
    """JSON for people: indented, and nothing in a model's strings acts on their terminal (devd.render)."""
    return json_safe(msgspec.json.format(raw, indent=2)) + b"\n"


def _params(**members: Any) -> dict[str, Any]:
    """The members that were given: a flag left out is left to the daemon's default, never sent as null."""
    return {name: value for name, value in members.items() if value is not None}


def in_cli_terms(error: DevdError, args: argparse.Namespace) -> str:
    """The daemon's message as a user of the command reads it: the commands for the methods it names, the flags for
    the token it wants, and where the daemon's log is when it failed; a control or bidi character it quotes (a
    model's words, a reason) escaped (devd.render)."""
    if error.kind == "UNAUTHORIZED":
        return _unauthorized(args)
    session = getattr(args, "session", None) or "SESSION"

    message = in_devd_terms(inline(str(error)), session)
    if error.kind == "INTERNAL":
        message += " (the daemon's log: `journalctl -u devd`, with --user for a daemon of yours, or its stderr)"
    return message


def _unauthorized(args: argparse.Namespace) -> str:
    if args.token is None and not args.token_file:
        return f"the daemon at {_address(args)} wants its token first: pass --token-file PATH; {_token_hint()}"
    given = f"the token in {args.token_file}" if args.token is None else "the token given"
    return f"the daemon at {_address(args)} refused {given}: it is not this daemon's token; {_token_hint()}"


def table(headers: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> str:
    """Columns two spaces apart, padded to their widest cell; the columns in `right` (numbers) aligned right."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded).rstrip()

    return "".join(line(row) + "\n" for row in [headers, *rows])


def _when(rfc3339: str) -> str:
    """An RFC 3339 time of the daemon's (UTC, to the millisecond) to the second: 2026-11-30T12:07:18Z."""
    return rfc3339[:19] + "Z" if len(rfc3339) >= 19 else rfc3339


def _pairs(pairs: list[tuple[str, str]]) -> str:
    """`key: value` lines, the values lined up."""
    width = max(len(key) for key, _ in pairs) + 1
    return "".join(f"{key + ':':<{width}} {value}\n" for key, value in pairs)


def _duration(seconds: float) -> str:
    """12.5s, 4m 5s, 3h 12m, 2d 3h: the two largest units."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    left = int(seconds)
    days, left = divmod(left, 86400)
    hours, left = divmod(left, 3600)
    minutes, secs = divmod(left, 60)
    units = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    while units[0][0] == 0:
        units.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in units[:2])


POSTGRES_SCHEMES = ("postgresql://", "postgres://")  # a --store URL of these names a fleet's database
T = TypeVar("T")


def _flag_value(parse: Callable[[str], T]) -> Callable[[str], T]:
    """parse as an argparse type: its ValueError's message becomes the usage error (argparse's own says only
    "invalid value")."""

    def value(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    value.__name__ = parse.__name__
    return value


def _socket_path(text: str) -> Path:
    """The socket `devd serve` listens on: a path, or a path as a client names it (`unix:PATH`). A TCP address is
    refused rather than made a file name: DEVD_SOCKET may hold one for the client commands, but serving TCP is
    --listen's."""
    try:
        where = address(text) if text not in ("", "unix:") else None
    except ValueError:  # a tcp:// address, and not even a good one
        where = None
    if not isinstance(where, UnixListen):
        raise argparse.ArgumentTypeError(
            f"--socket takes the path of a Unix socket, not {text!r}; to serve TCP, pass --listen tcp://HOST:PORT"
        )
    return where.path
