"""The daemon's settings: one frozen value, every limit named with its unit, and where state and sockets live."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from devd.rpc import LINE_BYTES_MAX_DEFAULT


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    socket_path: Path | None
    tcp: tuple[str, int] | None = None
    core_path: Path | None = None
    call_timeout_s: float = 5.0
    sessions_max: int = 10_000
    connections_max: int = 1024
    line_bytes_max: int = LINE_BYTES_MAX_DEFAULT
    memory_bytes_per_session: int = 64 << 20
    log_format: str | None = None  # json | console; None picks by whether stderr is a terminal
    log_level: str = "info"
    outbox_bytes_soft: int = 1 << 20  # a watcher behind by more than this is dropped
    outbox_bytes_hard: int = 32 << 20  # a client that reads nothing stops being read from
    send_timeout_s: float = 30.0  # a client that takes no bytes for this long is disconnected
    auth_timeout_s: float = 5.0
    line_timeout_s: float = 30.0  # a request line must arrive whole within this (slowloris); idle is fine
    auth_line_bytes_max: int = 4096
    shutdown_grace_s: float = 10.0


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


def parse_tcp(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` (HOST may be [v6]) as (host, port)."""
    if not url.startswith("tcp://"):
        raise ValueError(f"--listen takes tcp://HOST:PORT, not {url!r}")
    host, sep, port = url[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen takes tcp://HOST:PORT, not {url!r}")
    return host.strip("[]"), int(port)
