"""The compiled-module cache (`devd.compiled`, used by `Core.open`) and the open's deadline, with the real core."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from devd import compiled
from devd.errors import DeadlineError
from devd.host import Core, _engine_digest, _engine_version, packaged_module
from tests import modules
from tests.daemon import keep_cache, seed_cache


def _cache_file(cache: Path) -> Path:
    name = compiled.file_name(hashlib.sha256(packaged_module()).digest(), _engine_version())
    return cache / name


def _open_and_close(cache: Path) -> None:
    Core.open(cache_dir=cache).close()


def test_an_open_keeps_the_compiled_module_named_by_the_wasm_digest_and_the_wasmtime_version(tmp_path: Path) -> None:
    _open_and_close(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == [_cache_file(tmp_path / "cache").name]


def test_an_open_from_the_cache_does_not_write_it_again(tmp_path: Path) -> None:
    _open_and_close(tmp_path / "cache")
    before = _cache_file(tmp_path / "cache").stat().st_mtime_ns
    _open_and_close(tmp_path / "cache")
    assert _cache_file(tmp_path / "cache").stat().st_mtime_ns == before


def test_a_cache_with_one_byte_flipped_is_ignored_and_written_again(tmp_path: Path) -> None:
    _open_and_close(tmp_path / "cache")
    path = _cache_file(tmp_path / "cache")
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    path.write_bytes(bytes(flipped))
    _open_and_close(tmp_path / "cache")
    assert path.read_bytes() == good


def test_a_cache_made_for_another_engine_configuration_is_ignored_and_written_again(tmp_path: Path) -> None:
    _open_and_close(tmp_path / "cache")
    path = _cache_file(tmp_path / "cache")
    good = path.read_bytes()
    payload = good[len(b"devd-cwasm 1\n") + 96 :]
    wasm_digest = hashlib.sha256(packaged_module()).digest()
    other = hashlib.sha256(b"another engine").digest()
    compiled.save(tmp_path / "cache", wasm_digest, _engine_version(), other, payload)
    _open_and_close(tmp_path / "cache")
    assert path.read_bytes() == good


def test_a_truncated_cache_is_ignored_and_written_again(tmp_path: Path) -> None:
    _open_and_close(tmp_path / "cache")
    path = _cache_file(tmp_path / "cache")
    good = path.read_bytes()
    path.write_bytes(good[:1000])
    _open_and_close(tmp_path / "cache")
    assert path.read_bytes() == good


def test_a_cache_in_a_directory_others_may_write_is_never_read(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _open_and_close(cache)
    cache.chmod(0o777)
    digest = hashlib.sha256(packaged_module()).digest()
    assert compiled.load(cache, digest, _engine_version(), _engine_digest(_engine_version())) is None


def test_the_open_deadline_bounds_dev_abi_and_not_compiling() -> None:
    wasm = modules.slow_to_compile()
    started = time.monotonic()
    core = Core.open(wasm, timeout=0.2)  # compiling alone takes longer than this; dev_abi answers at once
    core.close()
    assert time.monotonic() - started > 0.2


def test_a_module_that_never_answers_dev_abi_is_still_stopped_with_a_cache(tmp_path: Path) -> None:
    with pytest.raises(DeadlineError):
        Core.open(bytes(modules.SPIN_ABI), timeout=0.1, cache_dir=tmp_path / "cache")


def test_the_compiled_core_the_test_daemons_are_seeded_with_is_one_this_engine_loads(tmp_path: Path) -> None:
    """tests/daemon.py shares one compiled core among a run's daemons. The copy was kept by file name alone, so one
    another virtualenv's engine kept (a CI clone's) was handed to every daemon here, refused, and compiled again."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(mode=0o700)
    second.mkdir(mode=0o700)
    _open_and_close(first / "cache")
    keep_cache(first)
    seed_cache(second)
    version = _engine_version()
    wasm_digest = hashlib.sha256(packaged_module()).digest()
    assert compiled.load(second / "cache", wasm_digest, version, _engine_digest(version)) is not None
