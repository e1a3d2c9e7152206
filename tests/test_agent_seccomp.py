"""The seccomp filter of every command under bubblewrap (devd.agent.seccomp): no user namespace of the command's own
making, under a daemon run as root too (where bubblewrap's --disable-userns cannot be used); ordinary commands
unchanged. The program is also run here, by a small interpreter of classic BPF, on each architecture's numbers,
including those (i386, x32, aarch64, 32-bit ARM) this machine cannot make."""

from __future__ import annotations

import os
import platform
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from devd.agent import seccomp
from devd.agent.profiles import Profile
from devd.agent.sandbox import Sandbox, choose
from devd.agent.tools import ENV_PATH, Result, run_command

ALLOW, ENOSYS, EPERM, KILL = 0x7FFF0000, 0x00050026, 0x00050001, 0x80000000
X86_64, I386, AARCH64, ARM = 0xC000003E, 0x40000003, 0xC00000B7, 0x40000028
NEWUSER, NEWNS = 0x10000000, 0x00020000
NOBODY = 65534
X32 = 0x40000000


def run_filter(program: bytes, arch: int, nr: int, flags: int) -> int:
    """What the kernel would do with the call (its seccomp_data: nr, arch, arguments), by the program's own
    instructions: the loads, AND, JEQ, JSET and RET of classic BPF, the only ones devd's filter uses."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, flags, 0, 0, 0, 0, 0)
    code: list[tuple[int, int, int, int]] = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, a = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        pc += 1
        if op == 0x20:
            a = int(struct.unpack_from("=I", data, k)[0])
        elif op == 0x54:
            a &= k
        elif op == 0x15:
            pc += jt if a == k else jf
        elif op == 0x45:
            pc += jt if a & k else jf
        elif op == 0x06:
            return k
        else:
            raise AssertionError(f"an instruction the filter should not hold: {op:#x}")


CALLS = [
    # (machine, arch, number, flags): clone3, clone and unshare with and without CLONE_NEWUSER, and another call.
    ("x86_64", X86_64, 435, 0, ENOSYS),
    ("x86_64", X86_64, 56, NEWUSER | 17, EPERM),
    ("x86_64", X86_64, 56, 17, ALLOW),
    ("x86_64", X86_64, 272, NEWUSER, EPERM),
    ("x86_64", X86_64, 272, NEWNS, ALLOW),
    ("x86_64", X86_64, 0, NEWUSER, ALLOW),  # read(), whatever its first argument
    ("x86_64", X86_64, X32 | 272, NEWUSER, EPERM),
    ("x86_64", X86_64, X32 | 435, 0, ENOSYS),
    ("x86_64", I386, 310, NEWUSER, EPERM),
    ("x86_64", I386, 120, NEWUSER, EPERM),
    ("x86_64", I386, 435, 0, ENOSYS),
    ("x86_64", I386, 272, NEWUSER, ALLOW),  # i386's 272 is fadvise64_64, not unshare
    ("x86_64", AARCH64, 97, NEWUSER, KILL),  # an architecture this host has not
    ("aarch64", AARCH64, 97, NEWUSER, EPERM),
    ("aarch64", AARCH64, 220, NEWUSER, EPERM),
    ("aarch64", AARCH64, 220, 17, ALLOW),
    ("aarch64", AARCH64, 435, 0, ENOSYS),
    ("aarch64", ARM, 337, NEWUSER, EPERM),
    ("aarch64", ARM, 120, NEWUSER, EPERM),
    ("aarch64", ARM, 435, 0, ENOSYS),
    ("aarch64", X86_64, 272, NEWUSER, KILL),
]


@pytest.mark.parametrize(("machine", "arch", "nr", "flags", "expected"), CALLS)
def test_the_filter_refuses_new_user_namespaces_on_each_architecture(
    machine: str, arch: int, nr: int, flags: int, expected: int
) -> None:
    program = seccomp.program(machine)
    assert program is not None
    assert hex(run_filter(program, arch, nr, flags)) == hex(expected)


def test_there_is_no_filter_for_an_architecture_devd_has_no_numbers_for() -> None:
    assert seccomp.program("riscv64") is None


needs_filter = pytest.mark.skipif(seccomp.program() is None, reason=f"no filter for {platform.machine()}")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ws").mkdir()
    return tmp_path / "ws"


def sandbox() -> Sandbox:
    chosen = choose(Profile(name="p", base_url="http://h/v1", model="m", workspace_roots=("/",)))
    assert isinstance(chosen, Sandbox), chosen
    return chosen


async def sandboxed(ws: Path, script: str, **fields: Any) -> Result:
    base: dict[str, Any] = {"name": "p", "base_url": "http://h/v1", "model": "m", "workspace_roots": (str(ws),)}
    return await run_command(["sh", "-c", script], workspace=ws, profile=Profile(**(base | fields)), sandbox=sandbox())


@needs_filter
async def test_unshare_of_a_user_namespace_fails_in_a_sandboxed_command(ws: Path) -> None:
    result = await sandboxed(ws, "unshare -U true; echo $?; unshare -Ur true 2>/dev/null; echo $?")
    assert result == Result("unshare: unshare failed: Operation not permitted\n1\n1\n")


# The calls themselves, from Python (3.11 has no os.unshare): unshare, clone (a child that exits at once, should the
# filter let it through) and clone3, each with its errno.
CALLS_FROM_PYTHON = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    r = libc.syscall(*args)
    if r == 0 and args[0] == CLONE:
        os._exit(0)
    return os.strerror(ctypes.get_errno()) if r < 0 else f"returned {r}"
UNSHARE, CLONE, CLONE3 = {"x86_64": (272, 56, 435), "aarch64": (97, 220, 435)}[os.uname().machine]
print("unshare:", call(UNSHARE, 0x10000000))
print("clone:", call(CLONE, 0x10000000 | 17, 0, 0, 0, 0))
print("clone3:", call(CLONE3, 0, 0))
"""


@needs_filter
async def test_unshare_clone_and_clone3_of_a_user_namespace_fail_from_python(ws: Path) -> None:
    (ws / "calls.py").write_text(CALLS_FROM_PYTHON)
    result = await sandboxed(ws, "python3 calls.py")
    assert result == Result(
        "unshare: Operation not permitted\nclone: Operation not permitted\nclone3: Function not implemented\n"
    )


@needs_filter
async def test_threads_processes_and_git_work_under_the_filter(ws: Path) -> None:
    """glibc's posix_spawn and pthread_create try clone3 first and fall back to clone on ENOSYS."""
    threads = (
        "import subprocess, threading; t = [threading.Thread(target=subprocess.run, args=(['true'],)) for _ in "
        "range(8)]; [x.start() for x in t]; [x.join() for x in t]; print('threads ran')"
    )
    script = f'python3 -c "{threads}" && git init -q && echo a > a && git add a && git status --porcelain=v1'
    assert await sandboxed(ws, script) == Result("threads ran\nA  a\n")


@needs_filter
def test_the_filter_alone_keeps_a_command_of_a_daemon_not_run_as_root_from_a_user_namespace() -> None:
    """Without bubblewrap's --disable-userns (before 0.8, or where it cannot work), the filter still refuses. As root,
    the daemon is played by nobody, in a workspace outside /tmp anyone may write."""
    root = os.geteuid() == 0
    box = Sandbox(bwrap=sandbox().bwrap, seccomp=seccomp.program())
    as_daemon = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if root else []
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="devd-test-") as d:
        os.chmod(d, 0o777)
        fd = seccomp.descriptor(seccomp.program() or b"")
        try:
            script = ["sh", "-c", "unshare -U true 2>&1; echo $?"]
            command = [*as_daemon, *box.wrap(script, Path(d), False, {"PATH": ENV_PATH}, seccomp_fd=fd)]
            done = subprocess.run(command, cwd=d, pass_fds=(fd,), capture_output=True, text=True, timeout=60)
        finally:
            os.close(fd)
    assert (done.stdout, done.stderr) == ("unshare: unshare failed: Operation not permitted\n1\n", "")
