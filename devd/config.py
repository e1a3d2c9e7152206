"""The daemon's settings: the one source of every default and limit, each named with its unit.

argparse, `Core`, the registry, the store and the server all receive their values from a `Settings`; none of
them keeps a default of its own. Also here: where configuration, state and sockets live by default. Addresses are
values of `devd.addresses` (`TcpListen`, parsed once from the flag).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from devd.addresses import TcpListen


class Settings(msgspec.Struct, frozen=True):
    state_dir: Path
    socket_path: Path | None
    tcp: TcpListen | None = None
    core_path: Path | None = None
    backup_dir: Path | None = None  # where `daemon/backup` writes; None: STATE_DIR/backups
    # calls
    call_timeout_s: float = 5.0  # a call's deadline unless the client asks for another
    max_call_timeout_s: float = 60.0  # the longest deadline a client may ask for; longer ones are cut to it
    inline_budget_s: float = 0.002  # a call runs inline this long, then moves to a worker thread
    call_threads_max: int = 32  # worker threads for calls moved off the loop (commits have a thread of their own)
    quick_threads_max: int = 8  # and for calls that missed the inline budget they were expected to fit (a quick lane)
    memory_bytes_per_session: int = 64 << 20
    # sessions and history
    sessions_max: int = 1_000_000  # sessions kept, live or stored
    max_live: int = 1000  # sessions with an instance in memory; past it, the least recently used idle one hibernates
    live_memory_bytes: int | None = None  # the instances' memory together; past it, idle ones hibernate (None: no cap;
    # `devd serve` gives half the machine's memory when --live-memory is not set: default_live_memory)
    expire_after_s: float | None = None  # sessions unused this long are deleted; None keeps them for ever
    keys_kept_per_session: int = 1000
    steps_kept_per_session: int = 1000  # unkeyed history kept behind the latest snapshot, for watchers' `since`
    prune_every_steps: int = 256
    snapshot_floor_bytes: int = 64 << 10  # journal since the last snapshot below which none is taken (cheap to replay)
    # connections
    connections_max: int = 1024  # for each of Unix and TCP
    unauthenticated_connections_max: int = 64  # TCP connections that have not presented the token yet
    requests_in_flight_max: int = 64  # per connection; past it, the connection is not read until one answers
    line_bytes_max: int = 16 << 20
    auth_line_bytes_max: int = 4096
    auth_timeout_s: float = 5.0
    line_timeout_s: float = 30.0  # a request line must arrive whole within this (slowloris); idle is fine
    send_timeout_s: float = 30.0  # a client that takes no bytes for this long is disconnected
    outbox_bytes_soft: int = 1 << 20  # a watcher behind by more than this is dropped
    outboxes_bytes_max: int = 256 << 20  # every connection's unsent bytes together: past it, watchers are dropped
    shutdown_grace_s: float = 10.0
    # metrics over HTTP (`--metrics`): off unless an address is given
    metrics: TcpListen | None = None
    metrics_head_bytes_max: int = 8 << 10  # a scrape's request line and headers; past it, 431
    metrics_timeout_s: float = 5.0  # a scrape's whole connection, from accept to close
    metrics_connections_max: int = 16  # scrapes at once; past it, a new connection is closed at once
    metrics_interval_s: float = 1.0  # the exposition is rendered at most this often; scrapes meanwhile share it
    # trace export (`--otel-endpoint`): OTLP/HTTP to this collector, off unless given
    otel_endpoint: str | None = None
    # logging
    log_format: str | None = None  # json | console; None picks by whether stderr is a terminal
    log_level: str = "info"


def backup_dir(settings: Settings) -> Path:
    """Where `daemon/backup` writes its copies: the operator's `--backup-dir`, else STATE_DIR/backups."""
    return settings.backup_dir or settings.state_dir / "backups"


def default_live_memory() -> int:
    """The instances' memory together when `--live-memory` is not given: half of this machine's memory. A session's
    instance holds up to three times what it was sent (a 4 MiB prompt: the input it was lent, the message it keeps,
    and the ask it answered, 12.8 MiB; resumed from its snapshot, 8.6 MiB), so `--max-live` times the session cap is
    far past any machine; past this, idle sessions hibernate."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def default(name: str) -> Any:
    """The default of the setting `name`: argparse shows it and `Core` takes it, Settings owns it."""
    names, defaults = Settings.__struct_fields__, Settings.__struct_defaults__
    return defaults[names.index(name) - (len(names) - len(defaults))]


def configuration_dirs(environ: Mapping[str, str]) -> list[Path]:
    """Where the daemon's configuration is: systemd's configuration directories (ConfigurationDirectory=devd:
    /etc/devd for the system unit, ~/.config/devd for the user unit), else `$XDG_CONFIG_HOME/devd` (a relative value
    is ignored, as the XDG spec says). The agents file is read from the first, and the units read the API keys from
    an environment file there: its commands must never see it (`devd.server.daemon.private_paths`)."""
    if d := environ.get("CONFIGURATION_DIRECTORY"):
        return [Path(part) for part in d.split(":") if part]
    base = environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):
        home = environ.get("HOME") or str(Path.home())
        base = os.path.join(home, ".config")
    return [Path(base) / "devd"]


def default_state_dir() -> Path:
    if d := os.environ.get("STATE_DIRECTORY"):
        return Path(d.split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "devd"


def default_socket_path() -> Path:
    if d := os.environ.get("RUNTIME_DIRECTORY"):
        return Path(d.split(":")[0]) / "devd.sock"
    if d := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(d) / "devd" / "devd.sock"
    return Path(f"/tmp/devd-{os.getuid()}") / "devd.sock"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `12h` or `7d` as seconds."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"a duration is a number with s, m, h or d after it (30d, 12h), not {text!r}") from None
    if seconds <= 0:
        raise ValueError(f"a duration must be more than zero, not {text!r}")
    return seconds


_SIZES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """`1048576`, `512M`, `4G` (or `4GiB`, `4GB`: powers of two either way) as bytes."""
    number = text.upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in _SIZES else ""
    try:
        size = int(float(number[: len(number) - len(unit)]) * _SIZES[unit])
    except ValueError:
        raise ValueError(f"a size is a number of bytes, with K, M, G or T after it (512M, 4G), not {text!r}") from None
    if size <= 0:
        raise ValueError(f"a size must be more than zero, not {text!r}")
    return size
