"""The runner's one door to the tools: read, write, run and browse for a session, confined to its workspace.

INTERIM: `devd.agent.tools` and `devd.agent.sandbox` (being written beside this) are the homes of this work; until they
land, this module carries a minimal version of it so that the runtime runs end to end, and once they do it only
delegates to them. What it promises either way: a path is resolved inside the workspace, symlinks included (one that
leaves it is refused, and nothing outside is read or written); a write is atomic; a command runs in the workspace
with a scrubbed environment, stdin closed, the profile's timeout and output cap, and under bubblewrap (read-only file
system but the workspace and a private /tmp, a new pid namespace, no network unless allowed); when the command is
cancelled or times out its whole process group is killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from devd.agent import http
from devd.agent.profiles import Profile

READ_BYTES_MAX = 1 << 20


class Result(msgspec.Struct, frozen=True):
    """A tool's outcome: the text the model sees, and whether the call failed."""

    text: str
    failed: bool = False


@dataclass(frozen=True)
class Sandbox:
    """How commands of a profile run: under `bwrap` (its path), unconfined (`None`, for sandbox = "none"), or not at
    all (`refused` says why)."""

    bwrap: str | None
    refused: str | None = None

    @property
    def available(self) -> bool:
        return self.refused is None


def choose(profile: Profile) -> Sandbox:
    """The sandbox for the profile: `auto` and `bwrap` want bubblewrap, and without a working one refuse commands."""
    if profile.sandbox == "none":
        return Sandbox(None)
    found = shutil.which("bwrap")
    if found is None:
        return Sandbox(None, _no_bwrap("bwrap is not installed"))
    probe = subprocess.run(
        [found, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "--unshare-net", "true"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    if probe.returncode != 0:
        return Sandbox(None, _no_bwrap(f"bubblewrap cannot start here ({probe.stderr.strip()[:200]})"))
    return Sandbox(found)


def _no_bwrap(why: str) -> str:
    return (
        f'refused: {why}; install the `bubblewrap` package, or set sandbox = "none" in the agent\'s profile to run '
        "commands unconfined"
    )


def resolve(workspace: str, path: str) -> Path | str:
    """The real path of `path` inside the workspace, or why it is refused."""
    if os.path.isabs(path):
        return f"refused: {path} is an absolute path; give a path relative to the workspace"
    root = os.path.realpath(workspace)
    real = os.path.realpath(os.path.join(root, path))
    if real != root and not real.startswith(root + os.sep):
        return f"refused: {path} is not inside the workspace (it leads to {real})"
    return Path(real)


async def read_file(workspace: str, path: str) -> Result:
    where = resolve(workspace, path)
    if isinstance(where, str):
        return Result(where, True)
    try:
        data = await anyio.Path(where).read_bytes()
    except OSError as e:
        return Result(f"cannot read {path}: {e.strerror or e}", True)
    return Result(data[:READ_BYTES_MAX].decode("utf-8", "replace"))


async def write_file(workspace: str, path: str, text: str) -> Result:
    where = resolve(workspace, path)
    if isinstance(where, str):
        return Result(where, True)
    return await anyio.to_thread.run_sync(_write, where, path, text)


def _write(where: Path, path: str, text: str) -> Result:
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=where.parent, prefix=f".{where.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, where)
        except BaseException:
            os.unlink(partial)
            raise
    except OSError as e:
        return Result(f"cannot write {path}: {e.strerror or e}", True)
    return Result(f"wrote {len(text.encode())} bytes to {path}")


def _argv(profile: Profile, sandbox: Sandbox, workspace: str, argv: list[str]) -> list[str]:
    if sandbox.bwrap is None:
        return argv
    # The private /tmp first, the workspace after: a workspace under /tmp must stay visible through it.
    wrapped = [sandbox.bwrap, "--ro-bind", "/", "/", "--tmpfs", "/tmp", "--bind", workspace, workspace]
    wrapped += ["--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--die-with-parent", "--chdir", workspace]
    if not profile.network:
        wrapped.append("--unshare-net")
    return [*wrapped, "--", *argv]


def _environment(workspace: str) -> dict[str, str]:
    """What a command sees of the environment: nothing of the daemon's (its secrets included) but a usable PATH."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workspace, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}


async def run_command(profile: Profile, sandbox: Sandbox, workspace: str, argv: list[str]) -> Result:
    if sandbox.refused is not None:
        return Result(sandbox.refused, True)
    cap = profile.output_bytes_max
    try:
        process = await anyio.open_process(
            _argv(profile, sandbox, workspace, argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workspace,
            env=_environment(workspace),
            start_new_session=True,
        )
    except OSError as e:
        return Result(f"cannot run {argv[0]}: {e.strerror or e}", True)
    out = bytearray()
    total = 0
    timed_out = False
    try:
        with anyio.move_on_after(profile.exec_timeout_s) as scope:
            assert process.stdout is not None
            async for chunk in process.stdout:
                total += len(chunk)
                out += chunk[: max(0, cap - len(out))]
            await process.wait()
        timed_out = scope.cancelled_caught
    finally:
        if process.returncode is None:
            _kill_group(process)
            with anyio.CancelScope(shield=True):
                await process.wait()
    text = out.decode("utf-8", "replace")
    if total > cap:
        text += f"\n[output cut: {total - cap} of {total} bytes not shown]"
    if timed_out:
        return Result(f"{text}\n[killed after {profile.exec_timeout_s:g} s, the profile's exec_timeout_s]", True)
    code = process.returncode
    if code != 0:
        return Result(f"{text}\n[exit status {code}]" if text else f"[exit status {code}]", True)
    return Result(text)


def _kill_group(process: anyio.abc.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def browse(client: http.Client, url: str, profile: Profile) -> Result:
    try:
        async with http.get(client, url) as response:
            data, cut = await response.read(profile.output_bytes_max)
    except http.TransportError as e:
        return Result(f"cannot fetch {url}: {e.why}", True)
    text = data.decode("utf-8", "replace")
    return Result(text + ("\n[cut at the output cap]" if cut else ""), response.status >= 400)
