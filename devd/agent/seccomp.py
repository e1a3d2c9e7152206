"""The seccomp filter every command under bubblewrap runs with: no user namespace of its own making.

In a user namespace of its own a command holds every capability over what it makes there (mounts, network
namespaces, ...): never over the host's files, but with the kernel code that opens to it, a wide attack surface
(most of the kernel's privilege escalations of recent years start there). A daemon not run as root closes it with
bubblewrap's `--disable-userns`; a root daemon's bubblewrap cannot (see `devd.agent.sandbox`). This filter closes it
for both, as Flatpak's and Docker's default profiles do: `unshare` and `clone` with CLONE_NEWUSER fail with EPERM, and
`clone3` fails with ENOSYS (its flags are in memory a filter cannot read), which makes glibc, Rust's and Go's
runtimes fall back to `clone`, where the flags are an argument. Nothing else is filtered.

The program is classic BPF, built here (no libseccomp), for the architectures devd runs on: x86_64 (with its i386
and x32 system calls, which a 64-bit kernel also serves) and aarch64 (with its 32-bit ARM ones). On another
architecture there is no filter (`program` answers None) and a root daemon's commands keep that surface. A call of an
architecture the filter does not know (none can be made on these hosts) kills the process: a filter that let it
through could be passed by the numbers of another table.

bubblewrap reads the program from a descriptor (`--seccomp FD`) and loads it, with no_new_privs, just before it runs
the command's first program; every process the command starts inherits it.
"""

from __future__ import annotations

import functools
import os
import platform
import struct

# seccomp_data (include/uapi/linux/seccomp.h): the call's number, its architecture, then the arguments (64-bit
# each; on these little-endian architectures the low half, where the clone flags are, comes first).
_NR, _ARCH, _ARG0 = 0, 4, 16
# Classic BPF opcodes (include/uapi/linux/filter.h).
_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
_INSTRUCTION = struct.Struct("=HBBI")  # struct sock_filter: code, jt, jf, k

CLONE_NEWUSER = 0x10000000
_X32 = 0x40000000  # x32's calls are x86_64's numbers with this bit


class _Table:
    """One architecture's numbers: its AUDIT_ARCH_ value and its clone, unshare and clone3."""

    def __init__(self, arch: int, clone: int, unshare: int, clone3: int, mask: int = 0) -> None:
        self.arch, self.clone, self.unshare, self.clone3, self.mask = arch, clone, unshare, clone3, mask


# From each architecture's syscall table (arch/x86/entry/syscalls, include/uapi/asm-generic/unistd.h,
# arch/arm/tools/syscall.tbl) and include/uapi/linux/audit.h.
_TABLES = {
    "x86_64": (_Table(0xC000003E, 56, 272, 435, mask=_X32), _Table(0x40000003, 120, 310, 435)),
    "aarch64": (_Table(0xC00000B7, 220, 97, 435), _Table(0x40000028, 120, 337, 435)),
}
_MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}


@functools.cache
def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one's, as `uname -m` says) as bubblewrap reads it (struct sock_filter
    after struct sock_filter), or None where devd has none (see the module's docstring)."""
    name = (machine or platform.machine()).lower()
    tables = _TABLES.get(_MACHINES.get(name, name))
    if tables is None:
        return None
    return b"".join(_INSTRUCTION.pack(*instruction) for instruction in _assemble(tables))


Instruction = tuple[int, int, int, int]


def _assemble(tables: tuple[_Table, ...]) -> list[Instruction]:
    """The program: dispatch on the architecture, then each architecture's block (`_block`)."""
    blocks = [_block(table) for table in tables]
    dispatch: list[Instruction] = [(_LD_ABS, 0, 0, _ARCH)]
    # Each test jumps to its block when equal: past the tests left, the final return, and the blocks before it.
    before = 0
    for i, table in enumerate(tables):
        tests_left = len(tables) - i - 1
        dispatch.append((_JEQ, tests_left + 1 + before, 0, table.arch))
        before += len(blocks[i])
    dispatch.append((_RET, 0, 0, _KILL_PROCESS))
    return dispatch + [instruction for block in blocks for instruction in block]


def _block(table: _Table) -> list[Instruction]:
    """One architecture's part: clone3 fails with ENOSYS; clone and unshare with CLONE_NEWUSER in their first
    argument (the flags) fail with EPERM; everything else is allowed."""
    load = [(_LD_ABS, 0, 0, _NR)] + ([(_AND, 0, 0, ~table.mask & 0xFFFFFFFF)] if table.mask else [])
    return [
        *load,
        (_JEQ, 3, 0, table.clone3),  # to the ENOSYS return
        (_JEQ, 3, 0, table.clone),  # to the flags' test
        (_JEQ, 2, 0, table.unshare),  # to the flags' test
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _ERRNO | 38),  # ENOSYS
        (_LD_ABS, 0, 0, _ARG0),
        (_JSET, 0, 1, CLONE_NEWUSER),
        (_RET, 0, 0, _ERRNO | 1),  # EPERM
        (_RET, 0, 0, _ALLOW),
    ]


def descriptor(filter_program: bytes) -> int:
    """A descriptor bubblewrap reads the program from (`--seccomp FD`): the read end of a pipe that holds it, the
    write end closed. A command's own: bubblewrap reads it to the end. The caller passes it and closes it."""
    read, write = os.pipe()
    try:
        os.write(write, filter_program)  # a few hundred bytes: far below a pipe's buffer, so it never blocks
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read
