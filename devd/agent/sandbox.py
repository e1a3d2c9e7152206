"""The sandbox for Exec and Git: bubblewrap, and whether it can start on this machine; and the containment of a
command under `sandbox = "none"`.

Under `wrap`, a command sees the whole file system read-only, its workspace writable, a private `/tmp` of at most
`tmp_bytes_max`, an empty `/run` of that size too (the host's holds the sockets of the session bus and of systemd's user
manager in /run/user/UID, whose `systemd-run --user` would run anything outside the sandbox, and the system bus's; with
`network = true`, the resolver's files in it are kept), fresh `/dev` and `/proc` (with `/proc/sys` and
`/proc/sysrq-trigger` read-only: bubblewrap's fresh /proc leaves every sysctl writable), new pid, ipc and uts namespaces
(it cannot see or signal anything outside), no network unless the profile says `network = true` (a new network namespace
has only its own loopback), no capabilities even when the daemon runs as root (`--cap-drop ALL`: none to undo the rest
with), and no terminal to push input into (`--new-session`). It dies with its parent (`--die-with-parent`), so killing
bwrap ends the command and everything it started. Reads are not restricted, as in Codex's Linux sandbox. `.git` stays
writable because Git is one of the tools.

Nested user namespaces: in a user namespace of its own a command holds every capability over what it makes there
(mounts, network namespaces), never over the host's files, but with the kernel code that opens to it. No command
under bubblewrap can make one: bubblewrap loads `devd.agent.seccomp`'s filter before the command's first program
(`--seccomp`), for a daemon run as root or not (unshare and clone with CLONE_NEWUSER fail with EPERM, clone3 with
ENOSYS), and a daemon not run as root also has bubblewrap close them (0.8's `--disable-userns`, where it works:
`closes_userns`). On an architecture other than x86_64 and aarch64 there is no filter, and a root daemon's commands
can make one.

A command never runs as root. Under a daemon run as root, bubblewrap is started as root (it needs no user namespace
then, so it starts wherever it did before) and keeps only CAP_SETUID and CAP_SETGID for util-linux's `setpriv`, the
first program inside, which drops to the unprivileged user of `devd.agent.runas` (no supplementary groups, no
capability, no_new_privs) before the command is run: nothing the model chose runs as uid 0, even for an instant.
A daemon that is not root is unchanged: its commands run as itself.

Limits, per command, from the profile. Where the daemon can give a command cgroups of its own (a root daemon on
cgroup v1: `devd.agent.cgroups`), it runs in them from its first instruction: `memory_bytes_max` bounds all the
memory its processes are charged for together (shared memory, memfds and files in its tmpfs mounts included; past
it the kernel's OOM killer ends its largest process, and the model is told), and `processes_max` all its processes
and threads (`pids.max`: a fork past it fails). Elsewhere the per-process limits are all there is (util-linux's
`prlimit`, the last program before the command, sets them): `processes_max` is RLIMIT_NPROC, which counts the
processes and threads of the command's user in its user namespace: under a daemon not run as root, bubblewrap's own,
so the count is the command's alone; under a root daemon without a pids cgroup, every process of its user on the
host (a workspace owner's desktop session, other commands running as `run_as`), as bubblewrap's seccomp filter
refuses the user namespace of its own the command would count in (`_drop`); only under `sandbox = "none"` does a root
daemon's command still get one (where user namespaces are turned on).
`memory_bytes_max` is also RLIMIT_DATA, always, each process's data (heap and private writable mappings), so that a
single allocation past it fails as an allocation (MemoryError, not a kill): set by prlimit, or, where the command has
cgroups, by the shell that puts it in them, root's still (`ulimit -d`, whole KiB), which spares an exec of prlimit
and leaves the command a limit it cannot raise all the same (soft and hard alike); unlike RLIMIT_AS it lets runtimes
reserve address space they do not use (V8, the JVM, wasm engines). Alone it is not a bound on a command's memory: it
is per process (up to `processes_max` of them), and shared memory is not counted at all (an independent attack held
6 GiB under a 64 MiB limit). `tmp_bytes_max` is the size of each private tmpfs: /tmp, /run, and /dev/shm (which
bubblewrap's fresh /dev leaves an unsized directory of that tmpfs, root's: POSIX shared memory, shm_open, lives
there, and a non-root daemon's commands could fill it up to half the host's memory).

Under `contain` (`sandbox = "none"`), a command is not confined: it sees and may write what its user may. It is
contained: it runs in a pid namespace of its own (util-linux's `unshare --pid --fork --kill-child`; as root, else in
a user namespace mapping the daemon's user to itself), so when the command ends, or is killed, or the daemon dies
(`setpriv --pdeathsig KILL` on unshare, and on the namespace's first process), every process it started dies with
it, even one that left its process group and session (`setsid`). Not quite for a daemon that is not root: its
unshare enters the user namespace itself, which makes the kernel forget unshare's death signal, so a command of such
a daemon killed by SIGKILL lives on until it ends (a daemon stopped ends its commands first; systemd's stop of the
unit kills what is left in its cgroup). It runs as the same unprivileged user as above, with the same limits (but
no private /tmp), and it cannot read the daemon's environment (its API keys) through /proc, as a daemon with agents
makes itself non-dumpable when it starts (`devd serve`). A shell is the namespace's first process and the command
its child, so signals act on it as usual. Where that pid namespace cannot be made, `sandbox = "none"` is refused,
saying so.

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

from devd.agent import seccomp
from devd.agent.cgroups import Group
from devd.agent.profiles import Profile
from devd.agent.runas import Account

PROBE_TIMEOUT_S = 10.0
_SEARCH = "/usr/bin:/bin:/usr/local/bin"
# Whom the probes drop to, under a root daemon: the user every system has (which user a command runs as is decided
# per call; whether setpriv can drop to one is what is probed).
_PROBE_ACCOUNT = Account(65534, 65534)


class Limits(msgspec.Struct, frozen=True):
    """A command's resource limits, from the profile (see the module's docstring)."""

    processes: int
    memory_bytes: int
    tmp_bytes: int


def limits(profile: Profile) -> Limits:
    return Limits(profile.processes_max, profile.memory_bytes_max, profile.tmp_bytes_max)


class Sandbox(msgspec.Struct, frozen=True):
    """bubblewrap, found at `bwrap`, known to start here; `hidden`, the daemon's own paths; `userns_closed`, whether
    bubblewrap keeps commands from making user namespaces of their own (see `wrap`); `seccomp`, the filter its
    commands run with (`devd.agent.seccomp`; None on an architecture devd has none for)."""

    bwrap: str
    hidden: tuple[str, ...] = ()
    userns_closed: bool = False
    seccomp: bytes | None = None

    def wrap(
        self,
        argv: Sequence[str],
        workspace: Path,
        network: bool,
        env: Mapping[str, str] | None = None,
        *,
        workspace_fd: int | None = None,
        account: Account | None = None,
        limits: Limits | None = None,
        user_namespace: bool = False,
        veil: Path | None = None,
        seccomp_fd: int | None = None,
        group: Group | None = None,
    ) -> list[str]:
        return wrap(
            argv,
            workspace,
            network,
            env,
            bwrap=self.bwrap,
            hidden=present(self.hidden),
            workspace_fd=workspace_fd,
            account=account,
            limits=limits,
            user_namespace=user_namespace,
            veil=veil,
            close_userns=self.userns_closed,
            seccomp_fd=seccomp_fd,
            group=group,
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
    account: Account | None = None,
    limits: Limits | None = None,
    user_namespace: bool = False,
    veil: Path | None = None,
    close_userns: bool = False,
    seccomp_fd: int | None = None,
    group: Group | None = None,
) -> list[str]:
    """The bwrap command line that runs argv confined to workspace. With `env`, the command gets exactly that
    environment (`--clearenv`, then a `--setenv` per variable). Each of `hidden` (a path, and whether it is a
    directory) is covered: a directory by an empty tmpfs, anything else by /dev/null. They are the daemon's own (its
    socket, its state directory with the token and the database): a command that reached the socket could approve
    its own actions and drive any session, as the daemon's user. With `workspace_fd` (a descriptor of the workspace,
    checked, passed to bwrap), that directory is what is bound: bwrap would follow a link at the path. With
    `account`, the command runs as that user (bwrap run as root: see the module's docstring), in a user namespace of
    its own with `user_namespace`; with `limits`, within them. `veil` is a directory above the workspace that the
    command's user cannot search (`runas.veil`): it is covered by an empty tmpfs holding the way to the workspace, so
    the workspace is reached by its path (HOME, Git, absolute paths), and nothing the user could see is hidden. With
    `close_userns` (a daemon not run as root: bubblewrap's own user namespace), the command cannot make a user
    namespace (`--disable-userns`), in which it would hold every capability over what it then makes (mounts, network
    namespaces: the kernel's attack surface that unprivileged user namespaces open). With `seccomp_fd` (a descriptor
    holding `devd.agent.seccomp`'s program, passed to bwrap), no command can make one, whoever runs the daemon. With
    `group`, bwrap is started in the command's cgroups (see `devd.agent.cgroups`)."""
    ws = str(workspace)
    # Order matters: the read-only root first, then what is mounted over it; /tmp and /run before the workspace, so a
    # workspace under either is bound on top of the fresh one rather than hidden by it; the hidden paths last, so
    # that a socket or a state directory inside the workspace is covered too.
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *_PROC_READ_ONLY]
    # /tmp and /dev/shm are everyone's, as on the host: the command may run as a user other than the one that made
    # them. bubblewrap's /dev/shm is a directory of its fresh /dev, root's and unsized: a tmpfs of its own bounds it.
    size = ["--size", str(limits.tmp_bytes)] if limits else []
    args += ["--perms", "1777", *size, "--tmpfs", "/dev/shm", "--perms", "1777", *size, "--tmpfs", "/tmp"]
    args += _fresh_run(network, limits)
    base = next((Path(d) for d in _FRESH if workspace.is_relative_to(d)), veil)
    if base == veil and veil is not None:
        args += ["--perms", "0755", "--tmpfs", str(veil)]
    for parent in _made_between(base, workspace):  # bwrap would make them 0700, root's: a command could not pass
        args += ["--perms", "0755", "--dir", parent]
    args += ["--bind", ws, ws] if workspace_fd is None else ["--bind-fd", str(workspace_fd), ws]
    for path, directory in hidden:
        args += ["--tmpfs", path] if directory else ["--ro-bind", "/dev/null", path]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if not network:
        args.append("--unshare-net")
    if close_userns:
        args += ["--unshare-user", "--disable-userns"]
    # No capabilities inside, from the bounding set up: a daemon run as root would otherwise hand its command
    # CAP_SYS_ADMIN, with which it remounts / writable, unmounts the private /tmp and /proc, and enters the host's
    # network namespace. Without root it changes nothing (an unprivileged sandbox has none to drop).
    args += ["--cap-drop", "ALL"]
    if account is not None:  # for setpriv alone, which gives them up with root before it runs the command
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--die-with-parent", "--new-session", "--chdir", ws]
    if env is not None:
        args.append("--clearenv")
        for name, value in env.items():
            args += ["--setenv", name, value]
    inside = [*_drop(account, user_namespace), *_limit(limits, group), *argv]
    return [*_enter(group, limits), *args, "--", *inside]


# bubblewrap makes /proc/irq and /proc/bus read-only itself, but not /proc/sys (it asks whether the directory is
# writable, which it never is, while the files in it are): as root a command wrote kernel.core_pattern there.
_PROC_READ_ONLY = ("--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger")


# Replaced by fresh directories inside: /tmp (private, sized), and /run, which holds the sockets of whatever runs on
# the host (the session bus and systemd's user manager in /run/user/UID, whose `systemd-run --user` runs anything
# outside the sandbox; the system bus; Docker's), reachable by path whoever the command runs as.
_FRESH = ("/tmp", "/run")
# What a command that may reach the network needs of /run: the resolver's files (systemd-resolved's stub
# resolv.conf, and the varlink socket glibc's nss-resolve asks; gone, it falls back to DNS).
_RESOLVER = "/run/systemd/resolve"


def _fresh_run(network: bool, limits: Limits | None) -> list[str]:
    """An empty /run (and /var/run, where it is a directory rather than a link to /run), with, given `network`, the
    resolver's files of it: /etc/resolv.conf is a link into /run on many systems. Sized as /tmp is: under a daemon
    not run as root the command's user owns it, and an unsized tmpfs takes up to half the host's memory."""
    size = ["--size", str(limits.tmp_bytes)] if limits else []
    args = ["--perms", "0755", *size, "--tmpfs", "/run"]
    if not os.path.islink("/var/run") and os.path.isdir("/var/run"):
        args += ["--perms", "0755", *size, "--tmpfs", "/var/run"]
    if network:
        args += ["--ro-bind-try", _RESOLVER, _RESOLVER]
        resolv = os.path.realpath("/etc/resolv.conf")
        if resolv.startswith("/run/") and not resolv.startswith(_RESOLVER + "/"):
            args += ["--ro-bind-try", resolv, resolv]  # NetworkManager's or resolvconf's
    return args


def _made_between(base: Path | None, workspace: Path) -> list[str]:
    """The directories between a fresh tmpfs at `base` (/tmp, /run, or a veil) and the workspace below it,
    which bubblewrap makes there."""
    if base is None or workspace == base or not workspace.is_relative_to(base):
        return []
    parts = workspace.relative_to(base).parts[:-1]
    return [str(Path(base, *parts[: i + 1])) for i in range(len(parts))]


def _drop(account: Account | None, user_namespace: bool, *, die_with_parent: bool = False) -> list[str]:
    """setpriv's command line that runs the rest as `account`: no supplementary group, no capability (inheritable
    ones included), no_new_privs (a set-user-ID program cannot bring root back). With `user_namespace`, the rest then
    runs in a user namespace of its own, mapping the user to itself (it holds no capability there either, once it
    execs): RLIMIT_NPROC then counts the command's processes alone, not every process of that user on the host (a
    desktop user's thousand threads, or the commands of other sessions running as run_as). With `die_with_parent`,
    the rest is killed (SIGKILL) when its parent dies: the kernel forgets a death signal when a process's credentials
    change, so it is set after the drop: by the same setpriv, which sets it after the credentials (util-linux's order,
    for its `--pdeathsig keep`), or, after a user namespace (another change), by a setpriv of its own."""
    if account is None:
        return []
    drop = [
        program("setpriv"),
        f"--reuid={account.uid}",
        f"--regid={account.gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--no-new-privs",
        *(["--pdeathsig=KILL"] if die_with_parent and not user_namespace else []),
        "--",
    ]
    if user_namespace:
        drop += [program("unshare"), "--user", "--map-current-user", "--"]
        if die_with_parent:
            drop += _die_with_parent()
    return drop


def _die_with_parent() -> list[str]:
    """setpriv's command line that runs the rest with SIGKILL as its death signal (sent when its parent dies)."""
    return [program("setpriv"), "--pdeathsig=KILL", "--"]


def _limit(limits: Limits | None, group: Group | None) -> list[str]:
    """prlimit's command line: RLIMIT_DATA where there are no cgroups (their shell sets it: `_enter`), RLIMIT_NPROC
    where no pids cgroup counts the command's processes (under a root daemon RLIMIT_NPROC would count its user's other
    processes too: see the module's docstring); nothing when neither is left to set."""
    if limits is None:
        return []
    counted = group is not None and group.counts_processes
    nproc = [] if counted else [f"--nproc={limits.processes}"]
    data = [] if group is not None else [f"--data={limits.memory_bytes}"]
    if not nproc and not data:
        return []
    return [program("prlimit"), *nproc, *data, "--"]


def _enter(group: Group | None, limits: Limits | None) -> list[str]:
    """The shell that puts the command in its cgroups (`Group.prefix`), and sets its RLIMIT_DATA there, root's
    still: a limit it inherits past the drop, which it cannot raise (soft and hard alike)."""
    if group is None:
        return []
    return group.prefix(None if limits is None else limits.memory_bytes)


def own_user_namespace(sandbox: Sandbox | None, group: Group | None) -> bool:
    """Whether a root daemon's command may run in a user namespace of its own (`_drop`), which it gets only so that
    RLIMIT_NPROC counts its processes alone: not where a pids cgroup counts them, nor under a seccomp filter, which
    refuses it as it refuses the command's own. Where user namespaces are turned on at all (`user_namespaces`)."""
    counted = group is not None and group.counts_processes
    filtered = sandbox is not None and sandbox.seccomp is not None
    return not counted and not filtered and user_namespaces()


def contain(
    argv: Sequence[str],
    *,
    account: Account | None = None,
    limits: Limits | None = None,
    user_namespace: bool = False,
    group: Group | None = None,
) -> list[str]:
    """The command line that runs argv unconfined (`sandbox = "none"`) but contained, as `account` (in a user namespace
    of its own with `user_namespace`: see `_drop`) within `limits` and its cgroups `group` (see the module's
    docstring)."""
    unshare = [program("unshare"), "--pid", "--kill-child"]
    if os.geteuid() != 0:
        unshare.append("--map-current-user")  # a pid namespace needs CAP_SYS_ADMIN: that of a user namespace
    # A shell as the namespace's init, waiting for the command: as init itself, the command would ignore every
    # signal it has no handler for (SIGPIPE, SIGTERM), as the kernel spares an init. argv is the shell's arguments,
    # never its script; `exit` after it keeps the shell from exec'ing it in its place; the PWD it sets is unset, so
    # the environment is still only the one given.
    init = ["/bin/sh", "-c", 'unset PWD; "$@"; exit $?', "sh"]
    # The kernel forgets a process's death signal when its credentials change: the drop to `account` and a user
    # namespace forget the one --kill-child gave the namespace's first process, so it is given again after them.
    return [
        *_enter(group, limits),
        *_die_with_parent(),
        *unshare,
        "--",
        *_drop(account, user_namespace, die_with_parent=True),
        *_limit(limits, group),
        *init,
        *argv,
    ]


_HELPERS = ("setpriv", "prlimit", "unshare")  # util-linux's


@functools.cache
def program(name: str) -> str:
    """Where one of util-linux's programs is (its name, to fail saying so, where it is not)."""
    return shutil.which(name, path=_SEARCH) or name


def present(paths: Sequence[str]) -> list[tuple[str, bool]]:
    """Those of paths that exist now, outside /tmp and /run (the sandbox's are its own already), each with whether it
    is a directory: bubblewrap cannot cover what is not there, on a read-only root. A path reached through a link is
    covered where it leads (systemd's DynamicUser= makes the state directory /var/lib/devd a link to
    /var/lib/private/devd): bubblewrap follows a link it mounts over, and the link's target holds what is private."""
    found = []
    for path in map(os.path.realpath, paths):
        if any(path == d or path.startswith(d + "/") for d in _FRESH) or not os.path.lexists(path):
            continue
        found.append((path, os.path.isdir(path)))
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
    if (missing := _missing()) is not None:
        return missing
    filtered = seccomp.program()
    with tempfile.TemporaryDirectory(prefix="devd-probe-") as ws:
        account = _probe_account()  # as a command is run: the drop, its filter, its user namespace where it has one
        alone = account is not None and filtered is None and user_namespaces()
        fd = seccomp.descriptor(filtered) if filtered is not None else None
        try:
            command = wrap(
                ["true"],
                Path(ws),
                False,
                {"PATH": _SEARCH},
                bwrap=bwrap,
                account=account,
                user_namespace=alone,
                seccomp_fd=fd,
            )
            return _tried(command, ws, "bubblewrap", () if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)


@functools.cache
def closes_userns(bwrap: str) -> bool:
    """Whether bubblewrap can keep a command from making user namespaces here: a daemon not run as root, a bubblewrap
    of 0.8 or later, not set-user-ID. A root daemon's bubblewrap cannot: its --disable-userns needs a user namespace
    of bubblewrap's own, which as root maps the command to uid 0 of the host; there the seccomp filter alone keeps
    commands from making one (see the module's docstring). Tried once per process."""
    if os.geteuid() == 0:
        return False
    with tempfile.TemporaryDirectory(prefix="devd-probe-") as ws:
        command = wrap(["true"], Path(ws), False, {"PATH": _SEARCH}, bwrap=bwrap, close_userns=True)
        return _tried(command, ws, "bubblewrap without user namespaces") is None


@functools.cache
def probe_containment() -> str | None:
    """None when `contain` runs `true` here, else why not; tried once per process, like `probe`."""
    if (missing := _missing()) is not None:
        return missing
    with tempfile.TemporaryDirectory(prefix="devd-probe-") as ws:
        account = _probe_account()
        alone = account is not None and user_namespaces()
        return _tried(contain(["true"], account=account, user_namespace=alone), ws, "a pid namespace")


@functools.cache
def user_namespaces() -> bool:
    """Whether an unprivileged user can make a user namespace here (they may be turned off): then a root daemon's
    commands may get one each where nothing else counts their processes apart (`own_user_namespace`). Tried once."""
    if _missing() is not None:
        return False
    command = [*_drop(_PROBE_ACCOUNT, True), "true"]
    with tempfile.TemporaryDirectory(prefix="devd-probe-") as cwd:
        return _tried(command, cwd, "a user namespace") is None


def _missing() -> str | None:
    absent = [name for name in _HELPERS if not os.path.isabs(program(name))]
    if absent:
        return f"util-linux's {' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed"
    return None


def _probe_account() -> Account | None:
    return _PROBE_ACCOUNT if os.geteuid() == 0 else None


def _tried(command: list[str], cwd: str, what: str, pass_fds: Sequence[int] = ()) -> str | None:
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            pass_fds=pass_fds,
            env={"PATH": _SEARCH},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{what} cannot be made here ({e})"
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"{what} cannot be made here ({said[-1] if said else f'exit status {done.returncode}'})"
    return None


def choose(profile: Profile, *, bwrap: str | None = None, hidden: Sequence[str] = ()) -> Sandbox | None | Refusal:
    """How the profile's Exec and Git run: under a Sandbox, unconfined but contained (None: `sandbox = "none"`), or
    not at all. `bwrap` is the program to use (default: bwrap on the PATH); `hidden`, the daemon's own paths, which
    its commands must not see (see `wrap`)."""
    if profile.sandbox == "none":
        why = probe_containment()
        if why is None:
            return None
        return Refusal(
            f'commands cannot run: [agent.{profile.name}] sets sandbox = "none", which runs a command in a pid '
            f"namespace of its own so that nothing it starts outlives it, and {why}; install util-linux, or use "
            f'bubblewrap (sandbox = "auto")'
        )
    bwrap = bwrap or find_bwrap()
    why = probe(bwrap)
    if why is None and bwrap is not None:
        return Sandbox(
            bwrap=bwrap,
            hidden=tuple(str(p) for p in hidden),
            userns_closed=closes_userns(bwrap),
            seccomp=seccomp.program(),
        )
    setting = f'[agent.{profile.name}] sets sandbox = "{profile.sandbox}"'
    return Refusal(
        f"commands cannot run: {why}, and {setting}; install the bubblewrap package (Debian: apt-get install "
        f'bubblewrap), or set sandbox = "none" in [agent.{profile.name}] to run commands unconfined'
    )
