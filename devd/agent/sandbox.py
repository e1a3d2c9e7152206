"""The sandbox for Exec and Git: bubblewrap, and whether it can start on this machine.

Under `wrap`, a command sees the whole file system read-only, its workspace writable, a private `/tmp`, fresh
`/dev` and `/proc`, new pid, ipc and uts namespaces (it cannot see or signal anything outside), no network unless
the profile says `network = true` (a new network namespace has only its own loopback), no capabilities even when the
daemon runs as root (`--cap-drop ALL`: none to undo the rest with), and no terminal to push input into
(`--new-session`). It dies with its parent (`--die-with-parent`), so killing bwrap ends the command and
everything it started. Reads are not restricted, as in Codex's Linux sandbox. `.git` stays writable because Git is
one of the tools.

`choose` never falls back to running a command unconfined: a profile that wants bubblewrap where it cannot start
gets a `Refusal` that says why and what to do.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from devd.agent.profiles import Profile

PROBE_TIMEOUT_S = 10.0
_SEARCH = "/usr/bin:/bin:/usr/local/bin"


class Sandbox(msgspec.Struct, frozen=True):
    """bubblewrap, found at `bwrap`, known to start here; `hidden`, the daemon's own paths (see `wrap`)."""

    bwrap: str
    hidden: tuple[str, ...] = ()

    def wrap(
        self,
        argv: Sequence[str],
        workspace: Path,
        network: bool,
        env: Mapping[str, str] | None = None,
        *,
        workspace_fd: int | None = None,
    ) -> list[str]:
        return wrap(
            argv, workspace, network, env, bwrap=self.bwrap, hidden=present(self.hidden), workspace_fd=workspace_fd
        )


class Refusal(msgspec.Struct, frozen=True):
    """Exec and Git cannot run for this profile; `why` says why and what to do (it is what the model is told)."""

    why: str


def wrap(
    argv: Sequence[str],
    workspace: Path,
    network: bool,
    env: Mapping[str, str] | None = None,
    *,
    bwrap: str = "bwrap",
    hidden: Sequence[tuple[str, bool]] = (),
    workspace_fd: int | None = None,
) -> list[str]:
    """The bwrap command line that runs argv confined to workspace. With `env`, the command gets exactly that
    environment (`--clearenv`, then a `--setenv` per variable). Each of `hidden` (a path, and whether it is a
    directory) is covered: a directory by an empty tmpfs, anything else by /dev/null. They are the daemon's own (its
    socket, its state directory with the token and the database): a command that reached the socket could approve
    its own actions and drive any session, as the daemon's user. With `workspace_fd` (a descriptor of the workspace,
    checked, passed to bwrap), that directory is what is bound: bwrap would follow a link at the path."""
    ws = str(workspace)
    # Order matters: the read-only root first, then what is mounted over it; /tmp before the workspace, so a
    # workspace under /tmp is bound on top of the private /tmp rather than hidden by it; the hidden paths last, so
    # that a socket or a state directory inside the workspace is covered too.
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    args += ["--bind", ws, ws] if workspace_fd is None else ["--bind-fd", str(workspace_fd), ws]
    for path, directory in hidden:
        args += ["--tmpfs", path] if directory else ["--ro-bind", "/dev/null", path]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if not network:
        args.append("--unshare-net")
    # No capabilities inside, from the bounding set up: a daemon run as root would otherwise hand its command
    # CAP_SYS_ADMIN, with which it remounts / writable, unmounts the private /tmp and /proc, and enters the host's
    # network namespace. Without root it changes nothing (an unprivileged sandbox has none to drop).
    args += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--chdir", ws]
    if env is not None:
        args.append("--clearenv")
        for name, value in env.items():
            args += ["--setenv", name, value]
    return [*args, "--", *argv]


def present(paths: Sequence[str]) -> list[tuple[str, bool]]:
    """Those of paths that exist now, outside /tmp (the sandbox's /tmp is its own already), each with whether it is a
    directory: bubblewrap cannot cover what is not there, on a read-only root."""
    found = []
    for path in paths:
        if path == "/tmp" or path.startswith("/tmp/") or not os.path.lexists(path):
            continue
        found.append((path, os.path.isdir(path) and not os.path.islink(path)))
    return found


def find_bwrap() -> str | None:
    return shutil.which("bwrap", path=f"{os.environ.get('PATH', '')}:{_SEARCH}")


@functools.cache
def probe(bwrap: str | None = None) -> str | None:
    """None when bubblewrap (`bwrap`, else the one on the PATH) runs `true` here as `wrap` would run a command, else
    why not. Tried once per process (it takes a few milliseconds; call it off the event loop)."""
    bwrap = bwrap or find_bwrap()
    if bwrap is None:
        return "bubblewrap is not installed (no bwrap on the PATH)"
    if not os.access(bwrap, os.X_OK):
        return f"bubblewrap is not installed (no {bwrap})"
    with tempfile.TemporaryDirectory(prefix="devd-probe-") as ws:
        try:
            done = subprocess.run(
                wrap(["true"], Path(ws), False, {"PATH": _SEARCH}, bwrap=bwrap),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=PROBE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap cannot start here ({e})"
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"bubblewrap cannot start here ({said[-1] if said else f'exit status {done.returncode}'})"
    return None


def choose(profile: Profile, *, bwrap: str | None = None, hidden: Sequence[str] = ()) -> Sandbox | None | Refusal:
    """How the profile's Exec and Git run: under a Sandbox, unconfined (None: `sandbox = "none"`), or not at all.
    `bwrap` is the program to use (default: bwrap on the PATH); `hidden`, the daemon's own paths, which its commands
    must not see (see `wrap`)."""
    if profile.sandbox == "none":
        return None
    bwrap = bwrap or find_bwrap()
    why = probe(bwrap)
    if why is None and bwrap is not None:
        return Sandbox(bwrap=bwrap, hidden=tuple(str(p) for p in hidden))
    setting = f'[agent.{profile.name}] sets sandbox = "{profile.sandbox}"'
    return Refusal(
        f"commands cannot run: {why}, and {setting}; install the bubblewrap package (Debian: apt-get install "
        f'bubblewrap), or set sandbox = "none" in [agent.{profile.name}] to run commands unconfined'
    )
