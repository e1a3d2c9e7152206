"""Where a daemon is reached: a Unix socket's path or a TCP host and port, as values that clients and the daemon
share (the daemon binds them, in `devd.server.listeners`; a client connects to them).

An address is parsed once, from a flag or a client's argument, and used as such everywhere after. Each is written
one way (`str()`: `unix:PATH`, `tcp://HOST:PORT`), says whether it is loopback, and carries its peer rule: a Unix peer
is told by its uid, a TCP peer must present the token (`needs_token`). This module does no I/O but `peer_uid`, and
imports nothing of the daemon, so a client loads none of it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path
from typing import ClassVar

import msgspec


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def is_loopback(host: str) -> bool:
    """Whether host names this machine alone (a name other than localhost cannot be told, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class UnixListen(msgspec.Struct, frozen=True):
    """A Unix socket's path. Its peers are told by uid (this user's or root's), so they present no token."""

    path: Path
    needs_token: ClassVar[bool] = False
    loopback: ClassVar[bool] = True
    kind: ClassVar[str] = "unix"  # connections are counted by kind (devd.server.hub.Hub.refusal)

    def __str__(self) -> str:
        return f"unix:{self.path}"

    def canonical(self) -> UnixListen:
        """The same socket, written one way (an absolute, normalized path), for telling whether two are one."""
        return UnixListen(Path(os.path.abspath(self.path)))


class TcpListen(msgspec.Struct, frozen=True):
    """A TCP host and port. Its peers must present the token before anything else is read."""

    host: str
    port: int
    needs_token: ClassVar[bool] = True
    kind: ClassVar[str] = "tcp"

    @classmethod
    def parse(cls, url: str) -> TcpListen:
        """`tcp://HOST:PORT` (HOST may be [v6]); ValueError, in --listen's words, for anything else."""
        if not url.startswith("tcp://"):
            raise ValueError(f"--listen takes tcp://HOST:PORT, not {url!r}")
        host, sep, port = url[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"--listen takes tcp://HOST:PORT, not {url!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if ":" in self.host else f"tcp://{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def canonical(self) -> TcpListen:
        return TcpListen(self.host.lower(), self.port)


def address(text: str) -> UnixListen | TcpListen:
    """A client's address: `tcp://HOST:PORT`, or a Unix socket's path, plain or as `unix:PATH` (as a fleet
    advertises it). ValueError for a tcp:// address that is not HOST:PORT."""
    if text.startswith("tcp://"):
        return TcpListen.parse(text)
    return UnixListen(Path(text.removeprefix("unix:")))
