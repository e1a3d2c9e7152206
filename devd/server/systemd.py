"""systemd's side channels, with the stdlib only: sd_notify(3) and socket activation (sd_listen_fds(3)).

Both are no-ops when the daemon is not run by systemd (no $NOTIFY_SOCKET, no $LISTEN_FDS for this pid).
"""

from __future__ import annotations

import os
import socket

LISTEN_FDS_START = 3


def notify(message: str) -> bool:
    """Send message to $NOTIFY_SOCKET; False when there is none. Never raises: readiness is advisory."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half of WatchdogSec, in seconds, when systemd asked this process for keep-alive pings."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None


def listen_sockets() -> list[tuple[socket.socket, str]]:
    """Sockets systemd passed to this process, with their names (LISTEN_FDNAMES), in order.

    Sockets passed to another process (LISTEN_PID names another pid) are ignored. The variables are removed so that
    children do not inherit them.
    """
    pid = os.environ.get("LISTEN_PID")
    count = os.environ.get("LISTEN_FDS")
    names = os.environ.get("LISTEN_FDNAMES", "")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    if not pid or not count or pid != str(os.getpid()):
        return []
    labels = names.split(":") if names else []
    found = []
    for i in range(int(count)):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        found.append((sock, labels[i] if i < len(labels) else "unknown"))
    return found
