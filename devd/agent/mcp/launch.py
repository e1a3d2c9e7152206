"""How a stdio MCP server's process is made: under the profile's sandbox as its commands are (`devd.agent.sandbox`):
its workspace writable and its working directory, the network only when the server's `network` says so, as the
unprivileged user a command of that workspace runs as (never uid 0), in a pid namespace that dies with the daemon
(bubblewrap's `--die-with-parent`, or `sandbox = "none"`'s containment), under the commands' system call filter, with
the environment a command gets plus the server's own variables, whose values are read from the daemon's environment
now, by the names the profile gives (`env`), and passed in the process's environment, never on a command line another
user could read. Like a command, a server gets cgroups of its own where the daemon makes them (`devd.agent.cgroups`:
`memory_bytes_max` and `processes_max` bound the server as a whole), for its process's life: removed once it stopped
(`Process.connect`), and by the next daemon's sweep after a SIGKILL.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

import anyio

from devd.agent import cgroups, runas, seccomp, tools
from devd.agent import sandbox as sandboxes
from devd.agent.mcp.connection import Unavailable
from devd.agent.mcp.stdio import Process
from devd.agent.profiles import McpServer, Profile


def server_env(server: McpServer, agent: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The server's own variables (a stdio server's `env`, an HTTP server's `headers`), their values read from the
    daemon's environment (Unavailable naming the variable, never a value, when one is not set)."""
    env: dict[str, str] = {}
    for what, pairs in (("variable", server.env), ("header", server.headers)):
        for variable, holder in pairs:
            value = environ.get(holder)
            if value is None:
                where = f"agent {agent!r}'s MCP server {server.name}" if agent else f"MCP server {server.name}"
                raise Unavailable(
                    f"{where} cannot start: its {what} {variable} is to be read from the daemon's variable {holder}, "
                    "which is not set; set it where the daemon starts and restart the daemon"
                )
            env[variable] = value
    return env


async def stdio_process(
    argv: Sequence[str],
    variables: Mapping[str, str],
    *,
    name: str,
    network: bool,
    profile: Profile,
    workspace: tools.Workspace,
    sandbox: sandboxes.Sandbox | sandboxes.Refusal | None,
    line_bytes_max: int,
) -> Process:
    """The server's process, ready to start (`Process.connect`); Unavailable, saying why, when it cannot run."""
    if isinstance(sandbox, sandboxes.Refusal):
        raise Unavailable(f"the MCP server {name} cannot start: {sandbox.why}")
    if "/" not in argv[0] and shutil.which(argv[0], path=tools.ENV_PATH) is None:
        raise Unavailable(
            f"the MCP server {name} cannot start: {argv[0]}: command not found (PATH is {tools.ENV_PATH})"
        )
    try:
        root = workspace.open()
    except tools.Refused as e:
        raise Unavailable(f"the MCP server {name} cannot start: {e.why}") from None
    owned = [root]
    group: cgroups.Group | None = None
    try:
        where = cgroups.place()
        try:
            if not isinstance(where, str):
                group = cgroups.make(where, profile.memory_bytes_max, profile.processes_max)
        except OSError as e:
            raise Unavailable(
                f"the MCP server {name} cannot start: its cgroup cannot be made ({e.strerror or e}); if it persists, "
                "the daemon's cgroup (its `agent.cgroups` log line names it) is full or no longer writable"
            ) from None
        try:
            who, alone, veil = await anyio.to_thread.run_sync(
                tools.confinement, profile, root, workspace.path, sandbox, group
            )
        except runas.Unusable as e:
            raise Unavailable(f"the MCP server {name} cannot start: {e.why}") from None
        env = tools.command_env(workspace.path, guest=who is not None and who.uid != os.fstat(root).st_uid)
        env |= variables
        bounds = sandboxes.limits(profile)
        if sandbox is None:
            command = sandboxes.contain(argv, account=who, limits=bounds, user_namespace=alone, group=group)
        else:
            # The commands' system call filter too (bwrap reads it from this descriptor).
            filter_fd = None if sandbox.seccomp is None else seccomp.descriptor(sandbox.seccomp)
            if filter_fd is not None:
                owned.append(filter_fd)
            command = sandbox.wrap(
                argv, workspace.path, network, workspace_fd=root, account=who, limits=bounds, user_namespace=alone,
                veil=veil, seccomp_fd=filter_fd, group=group,
            )  # fmt: skip
    except BaseException:
        for fd in owned:
            os.close(fd)
        if group is not None:
            await anyio.to_thread.run_sync(group.remove)
        raise
    return Process(
        command, env, cwd=f"/proc/self/fd/{root}", owned_fds=owned, line_bytes_max=line_bytes_max, group=group
    )
