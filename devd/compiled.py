"""The compiled-module cache: the core's native code, kept beside the state so a start need not compile it again.

A cache file is `<dir>/core-<sha256 of the wasm>-<wasmtime version>.cwasm`: a header naming the module's digest, a
digest of the engine's configuration and a digest of the payload, then the payload (wasmtime's `Module.serialize`).
What it promises:

- a payload is handed out only if the header names this module and this engine, and the payload's own digest
  matches: deserializing is loading native code, and wasmtime checks no integrity of it (shared/WASM-HOST.md §4);
- a cache is read only from a directory that is this user's and writable by no one else, through no symlink;
- a file is written whole or not at all (a temporary file renamed into place), so a crash leaves the old one or
  the new one; a file that is corrupt, truncated or for another engine is ignored and written again, never trusted.

No byte of this module touches wasmtime: the host (`devd.host`) compiles, serializes and deserializes.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

_MAGIC = b"devd-cwasm 1\n"
_DIGEST = 32
_HEADER = len(_MAGIC) + 3 * _DIGEST


def file_name(wasm_digest: bytes, engine_version: str) -> str:
    """The cache file's name for a module (by its sha256) on an engine (by its version)."""
    return f"core-{wasm_digest.hex()}-{engine_version}.cwasm"


def load(directory: Path, wasm_digest: bytes, engine_version: str, engine_digest: bytes) -> bytes | None:
    """The cached payload for this module on this engine, or None when there is none to trust."""
    if not _trusted(directory, create=False):
        return None
    try:
        fd = os.open(directory / file_name(wasm_digest, engine_version), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError:
        return None
    finally:
        os.close(fd)
    return _payload(data, wasm_digest, engine_digest)


def save(directory: Path, wasm_digest: bytes, engine_version: str, engine_digest: bytes, payload: bytes) -> bool:
    """Keep `payload` for this module on this engine; False (and nothing kept) if the directory cannot be trusted or
    written. A cache is an optimisation: failing to keep one never fails a start."""
    if not _trusted(directory, create=True):
        return False
    path = directory / file_name(wasm_digest, engine_version)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    header = _MAGIC + wasm_digest + engine_digest + hashlib.sha256(payload).digest()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, header)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def _payload(data: bytes, wasm_digest: bytes, engine_digest: bytes) -> bytes | None:
    if len(data) <= _HEADER or not data.startswith(_MAGIC):
        return None
    at = len(_MAGIC)
    named_wasm, named_engine, named_payload = (data[at + i * _DIGEST : at + (i + 1) * _DIGEST] for i in range(3))
    payload = data[_HEADER:]
    if named_wasm != wasm_digest or named_engine != engine_digest:
        return None
    if hashlib.sha256(payload).digest() != named_payload:
        return None
    return payload


def _trusted(directory: Path, *, create: bool) -> bool:
    """The directory is ours alone (made 0700 if `create` and missing): anyone else who could write in it could
    hand us native code to run."""
    if create:
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            return False
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022
