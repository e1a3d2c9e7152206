"""The wasm host: the only module that imports wasmtime.

`Core` is one compiled module (ABI 2, or 1 which it extends) on one Engine; `Instance` is one instance of it in a
Store of its own, holding one conversation. What this module promises:

- every call into the core runs under a deadline (epoch interruption with a catch-up ticker); a call that passes it
  is stopped where it stands and ends its session (`DeadlineError`, then `HandleError`);
- a trap is `PanicError` and poisons only its own session (`PoisonError` until closed); its Store is closed at once;
- a session runs one call at a time, across threads, and refuses the next (`BusyError`) rather than queue it;
- an answer the host cannot read ends the session (`HandleError`), because the core has already taken the event;
- an event the core cannot lend memory for is `NullError` before the core is asked, and changes nothing.

A step crosses the ABI with two calls (`dev_step`, `dev_free`) on wasmtime's unchecked call path: the input loan and
the `out` slot are lent once per session and reused, and guest memory is read and written with bounds-checked
`memmove`/`string_at`, never through `Func.__call__` (see shared/WASM-HOST.md: 17-42x faster).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from ctypes import POINTER, addressof, c_size_t, c_uint64, c_void_p, string_at
from pathlib import Path

import msgspec
import wasmtime
from wasmtime import _ffi as ffi

from devd import ABI, ABIS, compiled
from devd.config import default
from devd.errors import (
    STATUS,
    STATUS_MESSAGES,
    AbiError,
    BusyError,
    DeadlineError,
    DevdError,
    HandleError,
    InvalidParamsError,
    MalformedError,
    MethodNotFoundError,
    NullError,
    OutOfMemoryError,
    PanicError,
    PoisonError,
)
from devd.messages import Action, Config, Event, decode_actions, encode, event_error

MEMORY_BYTES_DEFAULT: int = default("memory_bytes_per_session")
CALL_TIMEOUT_SECONDS_DEFAULT: float = default("call_timeout_s")
TICK_SECONDS = 0.005
# The deadline of the question asked after a trap (did the core run out of memory?): its own, for the call that trapped
# may have passed its deadline meanwhile, and the question would then be interrupted and the trap called a PANIC.
PROBE_SECONDS = 1.0
OUT_BYTES = 12  # a dev_buf on wasm32: ptr, len, cap as three little-endian u32
_DEV_BUF = struct.Struct("<III")
OUT_SLOT_BYTES = 16  # the out slot, padded so the input buffer after it stays aligned
LOAN_BYTES_MIN = 4096
INT32_MAX = 2**31 - 1

# Private prototypes of the hot C entry points: `argtypes = None` skips ctypes' per-call conversion, and a copy of our
# own leaves wasmtime-py's prototypes untouched. Every argument is passed as a ctypes object. A call into wasm releases
# the GIL (it may run until its deadline, and the epoch ticker needs the GIL to end it); the accessors that only read
# or set a field (memory base and size, the deadline) and the copy into guest memory keep it: releasing it to the
# commit thread or a worker for a call of nanoseconds costs the event loop up to a switch interval to win it back,
# several times a step.
_call_unchecked = ffi.dll["wasmtime_func_call_unchecked"]
_call_unchecked.restype = c_void_p
_call_unchecked.argtypes = None  # type: ignore[assignment]
_held = ctypes.PyDLL(ffi.dll._name)  # the same library, its functions called with the GIL held
_memory_data = _held["wasmtime_memory_data"]
_memory_data.restype = c_void_p
_memory_data.argtypes = None  # type: ignore[assignment]
_memory_size = _held["wasmtime_memory_data_size"]
_memory_size.restype = c_size_t
_memory_size.argtypes = None  # type: ignore[assignment]
_set_deadline = _held["wasmtime_context_set_epoch_deadline"]
_set_deadline.restype = None
_set_deadline.argtypes = None  # type: ignore[assignment]
_increment_epoch = _held["wasmtime_engine_increment_epoch"]  # an atomic add: the ticker's catch-up keeps the GIL
_increment_epoch.restype = None
_increment_epoch.argtypes = None  # type: ignore[assignment]
memmove = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_void_p, c_size_t)(ctypes._memmove_addr)  # type: ignore[attr-defined]

_json_array = msgspec.json.Decoder(list[msgspec.Raw])
# A Summary the session cannot take as it stands: the core answers MALFORMED and changes nothing.
SUMMARY_REFUSED = (
    "the session refuses this Summary as it stands: `upto` must be 1 to the number of messages, the message at `upto` "
    "must not be a call's result (a Tool message: its call would be replaced), and while calls are waited for the "
    "last message (the Agent message that dispatched them) must stay; nothing changed, read session/transcript and "
    "choose another `upto`"
)


def _one_line_array(into: list[bytes]) -> Callable[[bytes], None]:
    def read(data: bytes) -> None:
        if b"\n" in data:
            raise ValueError("the answer spans several lines")
        _json_array.decode(data)
        into.append(data)

    return read


# The ABI's exports and their types: (params, results).
_SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dev_abi": ((), ("i32",)),
    "dev_alloc": (("i32",), ("i32",)),
    "dev_release": (("i32", "i32"), ()),
    "dev_new": (("i32", "i32", "i32"), ("i32",)),
    "dev_restore": (("i32", "i32", "i32"), ("i32",)),
    "dev_step": (("i64", "i32", "i32", "i32"), ("i32",)),
    "dev_snapshot": (("i64", "i32"), ("i32",)),
    "dev_free": (("i32",), ()),
    "dev_pending": (("i64", "i32"), ("i32",)),
    "dev_apply": (("i64", "i32", "i32"), ("i32",)),
    "dev_resume": (("i32", "i32", "i32"), ("i32",)),
    "dev_ignored": (("i64",), ("i64",)),
    "dev_out_of_memory": ((), ("i32",)),
    "dev_transcript": (("i64", "i32", "i32"), ("i32",)),
}
# dev_restore and dev_snapshot may be missing: such a core runs sessions but cannot carry them across instances.
# dev_pending may be missing too: such a core runs sessions but cannot say what it still waits for. Without dev_apply
# a replay steps every event in full (and pays for every Model ask's transcript again); without dev_resume a wake
# checks every message of the snapshot again. Without dev_transcript a session cannot be asked for its transcript.
_REQUIRED = ("dev_abi", "dev_alloc", "dev_release", "dev_new", "dev_step", "dev_free")


def _check_memory_cap(module: wasmtime.Module, memory_bytes: int) -> None:
    """A cap the module's own bound would silently cut: refused at start, so a session never fails below its cap."""
    for export in module.exports:
        if export.name == "memory" and isinstance(export.type, wasmtime.MemoryType):
            most = export.type.limits.max
            if most is not None and memory_bytes > most * 65536:
                raise AbiError(
                    f"a session's memory cap of {memory_bytes >> 20} MiB is more than this core can grow to "
                    f"({most * 65536 >> 20} MiB); choose at most that"
                )


def packaged_module() -> bytes:
    """The core built from core/ and shipped in the package."""
    # Beside this file, not through importlib.resources: that import costs a start about 8 ms, and devd is always
    # installed as files.
    try:
        return (Path(__file__).parent / "core.wasm").read_bytes()
    except FileNotFoundError:
        raise AbiError(
            "devd/core.wasm is missing: the core has not been built; run `make build` (or reinstall devd)"
        ) from None


class _Ticker:
    """Advances an Engine's epoch every TICK_SECONDS while a deadline is pending, catching up when starved of the GIL.

    A plain sleep-and-tick loop fires deadlines late under GIL contention (50 ms became 330 ms); bringing the epoch to
    floor(elapsed / period) on each wake-up keeps it honest. Deadlines are computed from the wall clock minus the
    epoch already reached, so a lagging epoch never makes a deadline fire early. Once the epoch has passed the tick of
    the latest deadline armed, every call running under one has trapped, so the thread sleeps until the next is
    armed: an idle daemon does not wake (it woke 200 times a second). The test is the epoch, not the clock: a thread
    starved past a deadline catches the epoch up first (it slept with the clock past the deadline and the epoch short
    of it, and a spinning call ran for ever). The epoch does not move while it sleeps; arming moves the clock's origin
    up to it instead, since catching up an hour of ticks one atomic add at a time would hold the GIL for most of a
    second.
    """

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._t0 = time.monotonic()
        self._epoch = 0
        self._due = 0  # the epoch tick of the latest deadline armed
        self._arming = threading.Lock()
        self._expired = False  # after expire(): every call traps at once
        self._armed = threading.Event()  # clear only while the thread sleeps, or is about to
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devd-epoch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Each increment keeps the GIL (an atomic add): a catch-up of many ticks after the thread was starved is one
        # hold of the GIL, not one hand-over to the event loop and back per tick.
        engine = self._engine.ptr()
        while not self._stop.is_set():
            # One tick past the latest deadline's: the engine's epoch may lead the count read when it was armed by one.
            if self._epoch > self._due:
                self._armed.clear()
                if self._epoch > self._due:  # checked again after clearing: an arm in between is seen here
                    self._armed.wait()
                continue
            if self._stop.wait(TICK_SECONDS):
                return
            target = int((time.monotonic() - self._t0) / TICK_SECONDS)
            while self._epoch < target:
                _increment_epoch(engine)
                self._epoch += 1

    def ticks_until(self, deadline: float) -> int:
        """Epoch ticks from now until the monotonic time `deadline` (none after `expire`); it ticks until then."""
        if self._expired:
            return 0  # the deadline is the epoch already reached: the call traps at its first check
        with self._arming:  # calls on worker threads arm too: a later due is never overwritten by an earlier one
            if not self._armed.is_set():  # asleep: the epoch stood still, so its origin moves to now
                self._t0 = time.monotonic() - self._epoch * TICK_SECONDS
            epoch = self._epoch
            ticks = max(1, int((deadline - self._t0) / TICK_SECONDS) + 1 - epoch)
            if epoch + ticks > self._due:
                self._due = epoch + ticks
        if not self._armed.is_set():
            self._armed.set()
        return ticks

    def expire(self, seconds: float) -> None:
        """Advance the epoch past every deadline due within `seconds`: each call running now traps (DEADLINE), and
        every later call expires at once. For the end of a shutdown's grace."""
        self._expired = True
        engine = self._engine.ptr()
        for _ in range(int(seconds / TICK_SECONDS) + 2):
            _increment_epoch(engine)
        self._epoch += int(seconds / TICK_SECONDS) + 2

    def stop(self) -> None:
        self._stop.set()
        self._armed.set()
        self._thread.join()


# The Engine's configuration, in one place: it builds the Engine and names it in the compiled-module cache, so a
# module compiled under another configuration is never loaded into this one. Without signal handlers a guard-page
# trap cannot be misrouted to faulthandler (which kills the process when it was enabled after the Engine); explicit
# bounds checks cost 0-10% of a step.
_ENGINE_CONFIG: tuple[tuple[str, bool], ...] = (("epoch_interruption", True), ("signals_based_traps", False))


def _engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    for name, value in _ENGINE_CONFIG:
        setattr(config, name, value)
    return wasmtime.Engine(config)


def _engine_version() -> str:
    """wasmtime-py's version, from its installed metadata's directory name (importlib.metadata costs a start 10-80 ms
    to import); "unknown" when it cannot be found, which the engine digest then still tells apart."""
    package = Path(wasmtime.__file__).parent
    try:
        names = os.listdir(package.parent)
    except OSError:
        return "unknown"
    for name in names:
        if name.startswith("wasmtime-") and name.endswith(".dist-info"):
            return name.removeprefix("wasmtime-").removesuffix(".dist-info")
    return "unknown"


def _engine_digest(version: str) -> bytes:
    """What a compiled module depends on besides its wasm: the engine's configuration, wasmtime's version, the
    native library it was compiled by (its size and time, so a library replaced in place is told apart) and the
    machine."""
    library = os.stat(ffi.dll._name)
    parts = [f"{name}={value}" for name, value in _ENGINE_CONFIG]
    parts += [f"wasmtime={version}", f"library={library.st_size}:{library.st_mtime_ns}"]
    parts.append(f"machine={os.uname().machine}")
    return hashlib.sha256("\n".join(parts).encode()).digest()


def _compile(engine: wasmtime.Engine, wasm: bytes, cache_dir: Path | None) -> wasmtime.Module:
    """The module compiled for `engine`: from the cache in `cache_dir` when it holds a trusted copy for this wasm and
    this engine, else compiled and (with a `cache_dir`) kept there for the next start."""
    if cache_dir is None:
        return _compile_wasm(engine, wasm)
    digest = hashlib.sha256(wasm).digest()
    version = _engine_version()
    engine_digest = _engine_digest(version)
    payload = compiled.load(cache_dir, digest, version, engine_digest)
    if payload is not None:
        try:
            return wasmtime.Module.deserialize(engine, payload)
        except wasmtime.WasmtimeError:
            pass  # wasmtime refused it (another build of wasmtime, say): compiled again and written over below
    module = _compile_wasm(engine, wasm)
    compiled.save(cache_dir, digest, version, engine_digest, bytes(module.serialize()))
    return module


def _compile_wasm(engine: wasmtime.Engine, wasm: bytes) -> wasmtime.Module:
    try:
        return wasmtime.Module(engine, wasm)
    except wasmtime.WasmtimeError as e:
        raise AbiError(f"the module does not compile: {e}") from None


def _check_exports(module: wasmtime.Module) -> None:
    if module.imports:
        names = ", ".join(f"{i.module}.{i.name}" for i in module.imports)
        raise AbiError(f"the core must import nothing, and this module imports {names}")
    for export in module.exports:
        if export.name == "memory" and not isinstance(export.type, wasmtime.MemoryType):
            raise AbiError("the module's memory export is not a memory")
        expected = _SIGNATURES.get(export.name)
        if expected is None:
            continue
        ty = export.type
        if not isinstance(ty, wasmtime.FuncType):
            raise AbiError(f"the module's {export.name} is not a function")
        got = (tuple(str(p) for p in ty.params), tuple(str(r) for r in ty.results))
        if got != expected:
            raise AbiError(f"the module's {export.name} has type {got}, and ABI {ABI} wants {expected}")


def _deadline(timeout: float) -> float:
    return time.monotonic() + timeout


class Core:
    """One compiled module on one Engine. Safe to share between threads; open one per process."""

    def __init__(
        self,
        engine: wasmtime.Engine,
        module: wasmtime.Module,
        ticker: _Ticker,
        memory_bytes: int,
        call_timeout: float,
        abi: int = ABI,
    ) -> None:
        self._engine = engine
        self.abi = abi  # the module's own (devd.ABIS): an ABI-1 module never dispatches a Tool call
        self._module = module
        self._ticker = ticker
        self._pre = wasmtime.Linker(engine).instantiate_pre(module)
        self.memory_bytes = memory_bytes
        self.call_timeout = call_timeout
        self.has_snapshots = {e.name for e in module.exports} >= {"dev_restore", "dev_snapshot"}
        self.has_pending = "dev_pending" in {e.name for e in module.exports}
        self.has_apply = "dev_apply" in {e.name for e in module.exports}
        self.has_resume = "dev_resume" in {e.name for e in module.exports}
        self.has_ignored = "dev_ignored" in {e.name for e in module.exports}
        self.has_out_of_memory = "dev_out_of_memory" in {e.name for e in module.exports}
        self.has_transcript = "dev_transcript" in {e.name for e in module.exports}
        self._sessions: weakref.WeakSet[Instance] = weakref.WeakSet()
        # Export names as C strings, made once: (buffer, length, argument slots).
        self._export_names = {
            name: (ctypes.create_string_buffer(name.encode(), len(name)), len(name), max(len(sig[0]), len(sig[1])))
            for name, sig in {**_SIGNATURES, "memory": ((), ())}.items()
        }
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def open(
        cls,
        wasm: bytes | Path | None = None,
        *,
        timeout: float = CALL_TIMEOUT_SECONDS_DEFAULT,
        memory_bytes: int = MEMORY_BYTES_DEFAULT,
        call_timeout: float = CALL_TIMEOUT_SECONDS_DEFAULT,
        cache_dir: Path | None = None,
    ) -> Core:
        """Compile the module (the packaged core by default), check that it speaks ABI 2 (or 1, which 2 extends), and
        return it.

        `timeout` bounds the module's own `dev_abi`, from when it is asked: a module that never answers raises
        `DeadlineError` when it passes. Compiling is not under it: on a loaded machine it takes seconds, and a
        start must not fail for that. With `cache_dir`, the compiled module is kept there and loaded from there by
        the next open (see `devd.compiled`).
        """
        if wasm is None:
            wasm = packaged_module()
        elif isinstance(wasm, Path):
            wasm = wasm.read_bytes()
        engine = _engine()
        module = _compile(engine, wasm, cache_dir)
        _check_exports(module)
        _check_memory_cap(module, memory_bytes)
        ticker = _Ticker(engine)
        try:
            abi = _probe_abi(engine, module, ticker, _deadline(timeout), memory_bytes)
            names = {e.name for e in module.exports}
            missing = [n for n in ("memory", *_REQUIRED) if n not in names]
            if missing:
                raise AbiError(f"the module does not export {', '.join(missing)}, which ABI {ABI} needs")
            return cls(engine, module, ticker, memory_bytes, call_timeout, abi)
        except BaseException:
            ticker.stop()
            raise

    def with_memory(self, memory_bytes: int) -> Core:
        """This module with another memory cap for the instances it starts (no more than the module can grow to): the
        same engine, module and ticker, nothing compiled again. For a call not held to a session's own cap (the
        transcript a client recovers its conversation from); never close it (the ticker is this Core's)."""
        memories = [e.type for e in self._module.exports if e.name == "memory"]
        most = next((m.limits.max for m in memories if isinstance(m, wasmtime.MemoryType)), None)
        ceiling = (most if most is not None else 65536) * 65536 - 65536
        return Core(self._engine, self._module, self._ticker, min(memory_bytes, ceiling), self.call_timeout, self.abi)

    def new(self, config: Config | bytes | None = None, *, timeout: float | None = None) -> Instance:
        """Start a session in an instance of its own; config as a Struct or as the JSON the core reads."""
        data = config if isinstance(config, bytes) else encode(config or Config())
        return self._start("dev_new", data, timeout)

    def restore(self, state: bytes, *, timeout: float | None = None) -> Instance:
        """Rebuild a session from its snapshot; a damaged snapshot is `MalformedError`."""
        if not self.has_snapshots:
            raise NullError(
                "this core exports no dev_restore, so it cannot restore a snapshot; use a core with all of ABI 2"
            )
        return self._start("dev_restore", state, timeout)

    def resume(self, state: bytes, *, timeout: float | None = None) -> Instance:
        """`restore` for a snapshot this core wrote and the host kept itself (its store): the core checks the frame,
        the checksum and the state's invariants, not every message again, so a wake costs less than the transcript.
        Never for a snapshot from a client. A core without dev_resume restores it in full."""
        if not self.has_resume:
            return self.restore(state, timeout=timeout)
        return self._start("dev_resume", state, timeout)

    def interrupt_all(self, within_s: float) -> None:
        """Stop every call running in this Core's instances whose deadline falls within `within_s` from now: each
        ends as DEADLINE, as if its deadline had passed, and so does every later call. For shutdown only."""
        self._ticker.expire(within_s)

    def close(self) -> None:
        """End every session started from this Core (each answers `HandleError` after) and stop its ticker."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session._end_with_core()
        self._ticker.stop()

    def _start(self, export: str, data: bytes, timeout: float | None) -> Instance:
        deadline = _deadline(self.call_timeout if timeout is None else timeout)
        with self._lock:
            if self.closed:
                raise HandleError("the core is closed and starts no session; open another Core")
            store = wasmtime.Store(self._engine)
        store.set_limits(memory_size=self.memory_bytes)
        session = Instance(self, store)
        session._open(export, data, deadline)
        with self._lock:
            if self.closed:
                session._end_with_core()
            else:
                self._sessions.add(session)
        return session


def _probe_abi(
    engine: wasmtime.Engine, module: wasmtime.Module, ticker: _Ticker, deadline: float, memory_bytes: int
) -> int:
    """Ask a throwaway instance for its ABI version, under the caller's deadline; one of devd.ABIS, or AbiError."""
    if deadline <= time.monotonic():
        raise DeadlineError("opening the core ran out of time before dev_abi was asked")
    store = wasmtime.Store(engine)
    try:
        store.set_limits(memory_size=memory_bytes)
        store.set_epoch_deadline(ticker.ticks_until(deadline))
        try:
            instance = wasmtime.Instance(store, module, [])
            dev_abi = instance.exports(store).get("dev_abi")
            if not isinstance(dev_abi, wasmtime.Func):
                raise AbiError("the module exports no dev_abi function")
            abi = dev_abi(store)
        except wasmtime.Trap as e:
            if e.trap_code == wasmtime.TrapCode.INTERRUPT:
                raise DeadlineError(
                    "the module's dev_abi did not answer before the deadline; it is not a usable core"
                ) from None
            raise AbiError(f"the module trapped when asked its ABI: {e.message}") from None
        if abi not in ABIS:
            raise AbiError(
                f"the module speaks ABI {abi}, and devd speaks ABI {ABI} (or {', '.join(map(str, ABIS[:-1]))}); "
                "build the core from this devd's core/, or leave --core out for the packaged one"
            )
        return int(abi)
    finally:
        store.close()


class _Export:
    """One export on the unchecked call path: its func and how many argument slots it uses."""

    __slots__ = ("func", "ref", "n")

    def __init__(self, func: ffi.wasmtime_func_t, n: int) -> None:
        self.func = func
        self.ref = ctypes.pointer(func)
        self.n = c_size_t(n)


class Instance:
    """One conversation in one instance. Calls are serialised: a second concurrent call answers `BusyError`."""

    def __init__(self, core: Core, store: wasmtime.Store) -> None:
        self._core = core
        self._store: wasmtime.Store | None = store
        self._ctx = store._context()
        self._busy = threading.Lock()
        self._largest = 0  # bytes of the largest event or answer this instance has handled
        self._gone: type[DevdError] | None = None
        self._gone_why = ""
        self._exports: dict[str, _Export] = {}
        # One argument array for every call: a session runs one call at a time, and the widest export takes four.
        self._args = (ffi.wasmtime_val_raw_t * 4)()
        self._memory = ffi.wasmtime_memory_t()
        self._trap = POINTER(ffi.wasm_trap_t)()
        self._trap_at = c_void_p(addressof(self._trap))
        self._handle = 0
        self._out = 0
        self._loan = 0
        self._loan_bytes = 0
        self._loan_shared = False
        self._instance: wasmtime.Instance | None = None

    # -- public API ------------------------------------------------------------------------------------------------

    def step(self, event: Event, *, timeout: float | None = None) -> list[Action]:
        """Feed the core one event and return the actions it answers with, in order."""
        actions: list[Action] = []

        def read(answer: bytes) -> None:
            actions.extend(decode_actions(answer))

        self._step(encode(event), read, timeout)
        return actions

    def step_raw(self, event: bytes, *, timeout: float | None = None) -> bytes:
        """`step` on encoded bytes: the event as JSON in, the core's answer (a JSON array of actions) out.

        The answer is checked to be a JSON array on one line (cheap, and what a client's framing depends on) before
        it is returned; one that is not ends the session. `step` checks every action against the protocol.
        """
        answer: list[bytes] = []
        self._step(event, _one_line_array(answer), timeout)
        return answer[0]

    def apply(self, event: bytes, *, timeout: float | None = None) -> None:
        """`step_raw` for a replay, which already has the answer: the core takes the event and writes no answer, so
        a replay costs what its events cost, not what their answers (a Model ask is the whole transcript) cost."""
        if not self._core.has_apply:
            self.step_raw(event, timeout=timeout)
            return
        deadline = self._enter(timeout)
        try:
            n = len(event)
            if n > INT32_MAX or n > self._core.memory_bytes:
                raise NullError(f"the event is {n} bytes, more than the session's memory")
            self._arm(deadline)
            self._largest = max(self._largest, n)
            self._args[1].i32 = self._lend(event)  # before the handle: lending may call into the core
            self._args[0].i64 = self._handle
            self._args[2].i32 = n
            rc = self._invoke(self._export("dev_apply"))
            if rc:
                self._status(rc, event)
        finally:
            self._busy.release()

    def ignored(self) -> int | None:
        """The action id the last step ignored: a Model answer or a result for an action this session did not
        dispatch, or already had the answer of (the core answers `[]` and changes nothing). None when it ignored
        none, or the core does not say (no dev_ignored)."""
        if not self._core.has_ignored:
            return None
        deadline = self._enter(None)
        try:
            self._arm(deadline)
            self._args[0].i64 = self._handle
            self._invoke(self._export("dev_ignored"))
            found = int(self._args[0].i64)
        finally:
            self._busy.release()
        return None if found < 0 else found

    def snapshot(self, *, timeout: float | None = None) -> bytes:
        """The core's whole state, checksummed, for `Core.restore`."""
        if not self._core.has_snapshots:
            raise NullError("this core exports no dev_snapshot, so its sessions cannot be snapshotted")
        return self._answer_of("dev_snapshot", timeout)

    def pending(self, *, timeout: float | None = None) -> bytes:
        """What the core has dispatched and still waits for: a JSON array of actions, in the bytes `step_raw` gave.

        That is the running turn's Model ask, or its calls still without a result in id order; `[]` when no turn runs.
        """
        if not self._core.has_pending:
            raise MethodNotFoundError(
                "this core does not report pending actions (no dev_pending export); "
                "use a core built from this repo's core/"
            )
        return self._answer_of("dev_pending", timeout)

    def transcript(self, start: int = 0, *, timeout: float | None = None) -> bytes:
        """The conversation from message `start` on, a JSON array of Messages (none past its end): what a session
        whose asks carry only new messages (`Config(asks="delta")`) has sent the model in all."""
        if not self._core.has_transcript:
            raise MethodNotFoundError(
                "this core does not give its transcript (no dev_transcript export); use a core built from this repo's "
                "core/"
            )
        if not 0 <= start < 1 << 31:
            raise InvalidParamsError(f"a transcript starts at a message index from 0 to 2^31-1, not {start}")
        deadline = self._enter(timeout)
        try:
            self._arm(deadline)
            ex = self._export("dev_transcript")
            self._args[0].i64 = self._handle
            self._args[1].i32 = start
            self._args[2].i32 = self._out
            self._status(self._invoke(ex))
            return self._take()
        finally:
            self._busy.release()

    def _answer_of(self, export: str, timeout: float | None) -> bytes:
        """Call an export that takes (handle, out) and answers a dev_buf, and take the answer."""
        deadline = self._enter(timeout)
        try:
            self._arm(deadline)
            ex = self._export(export)
            self._args[0].i64 = self._handle
            self._args[1].i32 = self._out
            self._status(self._invoke(ex))
            return self._take()
        finally:
            self._busy.release()

    def close(self) -> None:
        """Close the instance and free all its memory. Later calls answer `HandleError`; a second close is a no-op."""
        if not self._busy.acquire(blocking=False):
            raise BusyError("the session is inside another call; close it when that call has answered")
        try:
            if self._store is not None:
                self._end(HandleError, "the session was closed; start or restore another")
        finally:
            self._busy.release()

    @property
    def alive(self) -> bool:
        return self._gone is None

    def memory_bytes(self) -> int:
        """The instance's linear memory size now (for tests and status)."""
        if self._store is None:
            return 0
        return int(_memory_size(self._ctx, ctypes.byref(self._memory)))

    # -- the ABI dance ---------------------------------------------------------------------------------------------

    def _open(self, export: str, data: bytes, deadline: float) -> None:
        self._busy.acquire()
        try:
            if deadline <= time.monotonic():
                self._end(HandleError, "the session was never started: its deadline passed first")
                raise DeadlineError("the deadline passed before the session started")
            self._arm(deadline)
            self._bind(export)
            # One loan holds the out slot and the first input buffer: one crossing fewer per session.
            block = self._alloc(OUT_SLOT_BYTES + LOAN_BYTES_MIN)
            self._out, self._loan, self._loan_bytes = block, block + OUT_SLOT_BYTES, LOAN_BYTES_MIN
            self._loan_shared = True
            ptr = self._lend(data)
            ex = self._exports[export]
            self._args[0].i32 = ptr
            self._args[1].i32 = len(data)
            self._args[2].i32 = self._out
            self._status(self._invoke(ex))
            base, size = self._bounds()
            if self._out + 8 > size:
                self._end(HandleError, "the core's out slot lies outside its memory")
                raise HandleError("the core lent its out slot outside its memory; the core is broken")
            self._handle = struct.unpack("<Q", string_at(base + self._out, 8))[0]
        except BaseException:
            if self._store is not None:
                self._end(HandleError, "the session failed to start")
            raise
        finally:
            self._busy.release()

    def _bind(self, export: str) -> None:
        """Instantiate, and find the memory and the exports every session uses; the rest are found on first use."""
        assert self._store is not None
        self._instance = self._core._pre.instantiate(self._store)
        self._memory = ffi.wasmtime_memory_t.from_buffer_copy(self._lookup("memory").of.memory)
        for name in ("dev_alloc", "dev_step", "dev_free", export):
            self._export(name)

    def _export(self, name: str) -> _Export:
        ex = self._exports.get(name)
        if ex is None:
            func = ffi.wasmtime_func_t.from_buffer_copy(self._lookup(name).of.func)
            ex = self._exports[name] = _Export(func, self._core._export_names[name][2])
        return ex

    def _lookup(self, name: str) -> ffi.wasmtime_extern_t:
        if self._instance is None:
            raise HandleError(self._gone_why)
        raw, n, _ = self._core._export_names[name]
        item = ffi.wasmtime_extern_t()
        if not ffi.wasmtime_instance_export_get(
            self._ctx, ctypes.byref(self._instance._instance), raw, n, ctypes.byref(item)
        ):
            raise NullError(f"this core exports no {name}; use a core that speaks all of ABI {ABI}")
        return item

    def _step(self, data: bytes, use: Callable[[bytes], None], timeout: float | None) -> None:
        # The hot path: every line here runs once per step, so it is written flat.
        deadline = self._enter(timeout)
        try:
            n = len(data)
            if n > INT32_MAX or n > self._core.memory_bytes:
                raise NullError(
                    f"the event is {n} bytes and the session's memory is {self._core.memory_bytes} bytes; "
                    "nothing changed, send a smaller event"
                )
            _set_deadline(self._ctx, c_uint64(self._core._ticker.ticks_until(deadline)))
            if n > self._largest:
                self._largest = n
            ptr = self._lend(data)
            args = self._args
            args[0].i64 = self._handle
            args[1].i32 = ptr
            args[2].i32 = n
            args[3].i32 = self._out
            rc = self._invoke(self._exports["dev_step"])
            if rc:
                self._status(rc, data)
            answer = self._take()
            if len(answer) > self._largest:
                self._largest = len(answer)
            try:
                use(answer)
            except Exception as e:
                # The core has taken the event: what it asked for is lost to the host, so the session cannot go on.
                self._end(HandleError, "the session ended when its answer was lost; restore its last snapshot")
                raise HandleError(
                    f"the core took the event and its answer was not taken ({e}); "
                    "the session ended: restore its last snapshot and step the event again"
                ) from e
        finally:
            self._busy.release()

    def _enter(self, timeout: float | None) -> float:
        """Hold the session for one call and return the call's deadline; refuse if busy or gone."""
        if not self._busy.acquire(blocking=False):
            raise BusyError("the session is inside another call; retry when that call has answered")
        if self._gone is None and self._core.closed:
            self._end(HandleError, "the core this session ran in was closed; restore it in another Core")
        if self._gone is not None:
            gone, why = self._gone, self._gone_why
            self._busy.release()
            raise gone(why)
        deadline = _deadline(self._core.call_timeout if timeout is None else timeout)
        if deadline <= time.monotonic():
            self._end(HandleError, "the session ended when a call's deadline passed; recover or restore it")
            self._busy.release()
            raise DeadlineError("the call's deadline had already passed; the session ended, restore its last snapshot")
        return deadline

    def _arm(self, deadline: float) -> None:
        _set_deadline(self._ctx, c_uint64(self._core._ticker.ticks_until(deadline)))

    def _invoke(self, ex: _Export) -> int:
        """One call on the unchecked path; a trap or an error ends the session here."""
        err = _call_unchecked(self._ctx, ex.ref, self._args, ex.n, self._trap_at)
        if err:
            error = wasmtime.WasmtimeError._from_ptr(ctypes.cast(err, POINTER(ffi.wasmtime_error_t)))
            raise self._lose(str(error), interrupted=False)
        if self._trap:
            trap = wasmtime.Trap._from_ptr(self._trap)
            self._trap = POINTER(ffi.wasm_trap_t)()
            self._trap_at = c_void_p(addressof(self._trap))
            interrupted = trap.trap_code == wasmtime.TrapCode.INTERRUPT
            message = trap.message
            del trap
            raise self._lose(message, interrupted=interrupted)
        return int(self._args[0].i32)

    def _lose(self, message: str, *, interrupted: bool) -> DevdError:
        """Close the instance after a trap and say what every later call answers."""
        if interrupted:
            self._end(HandleError, "the session ended when a call ran past its deadline; recover or restore it")
            return DeadlineError(
                "the call ran past its deadline and was stopped; the session ended, restore its last snapshot"
            )
        out_of_memory = self._out_of_memory()
        self._end(PoisonError, "a previous call on this session trapped; close it, then restore or recover it")
        if out_of_memory:
            return OutOfMemoryError(
                "the call trapped inside the core (it ran out of its memory cap); the session is poisoned, recover it"
            )
        why = message.strip().splitlines()[-1].strip()
        return PanicError(f"the call trapped inside the core ({why}); the session is poisoned, recover it")

    def _out_of_memory(self) -> bool:
        """Whether the trap just met was the core running out of its memory cap: the core says so (dev_out_of_memory),
        or, from a core that cannot, the trap happened near the cap, allowing for a refused growth about as large as
        the largest message the instance handled (an event copied in, or an ask carrying the whole transcript)."""
        if self._core.has_out_of_memory:
            try:
                self._arm(time.monotonic() + PROBE_SECONDS)
                self._args[0].i32 = 0
                return bool(self._invoke(self._export("dev_out_of_memory")))
            except DevdError:
                return False
        return self.memory_bytes() + 2 * self._largest + (1 << 20) >= self._core.memory_bytes

    def _status(self, rc: int, event: bytes | None = None) -> None:
        if rc == 0:
            return
        if rc == -2 and event is not None and (why := event_error(event)) is not None:
            # The core says only that it cannot read the event; the host's types say where and why.
            raise MalformedError(
                f"the event is not a message of protocol 1: {why}; nothing changed, fix it and send it again"
            )
        if rc == -2 and event is not None and event.lstrip().startswith(b'{"Summary"'):
            raise MalformedError(SUMMARY_REFUSED)
        kind = STATUS[-rc] if -len(STATUS) < rc < 0 else None
        if kind is None:
            self._end(HandleError, "the core answered a status the ABI does not have")
            raise HandleError(f"the core answered status {rc}, which ABI {ABI} does not have; the session ended")
        if kind in (PoisonError, PanicError, HandleError):
            self._end(PoisonError if kind is not HandleError else HandleError, STATUS_MESSAGES[kind])
        raise kind(STATUS_MESSAGES[kind])

    def _bounds(self) -> tuple[int, int]:
        # Memory may grow or move during any call: read base and size afresh every time.
        ref = ctypes.byref(self._memory)
        return int(_memory_data(self._ctx, ref) or 0), int(_memory_size(self._ctx, ref))

    def _take(self) -> bytes:
        """Copy out the dev_buf the last call wrote to `out`, then hand it back with dev_free."""
        base, size = self._bounds()
        ptr, n, cap = _DEV_BUF.unpack(string_at(base + self._out, OUT_BYTES))
        if n and (ptr == 0 or n > cap or ptr + n > size):
            self._end(HandleError, "the core answered outside its memory")
            raise HandleError(f"the core answered {n} bytes at {ptr:#x}, outside its memory; the session ended")
        answer = string_at(base + ptr, n) if n else b""
        self._args[0].i32 = self._out
        self._invoke(self._exports["dev_free"])
        return answer

    def _alloc(self, n: int) -> int:
        if n > INT32_MAX:
            raise NullError(f"{n} bytes cannot be lent: the core's lengths are i32")
        ex = self._exports["dev_alloc"]
        self._args[0].i32 = n
        ptr = self._invoke(ex) & 0xFFFFFFFF
        if ptr == 0:
            raise NullError(f"the core lent nothing for {n} bytes; send a smaller event")
        return ptr

    def _lend(self, data: bytes) -> int:
        """Copy data into the session's input loan, growing it first when too small; 0 for no data."""
        if not data:
            return 0
        if len(data) > self._loan_bytes:
            self._grow_loan(len(data))
        base, size = self._bounds()
        if self._loan + len(data) > size:
            self._end(HandleError, "the core lent its input buffer outside its memory")
            raise HandleError("the core lent memory outside itself; the session ended")
        memmove(base + self._loan, data, len(data))
        return self._loan

    def _grow_loan(self, n: int) -> None:
        if self._loan and not self._loan_shared:
            ex = self._export("dev_release")
            self._args[0].i32 = self._loan
            self._args[1].i32 = self._loan_bytes
            self._invoke(ex)
            self._loan, self._loan_bytes = 0, 0
        want = max(LOAN_BYTES_MIN, 1 << (n - 1).bit_length()) if n <= 1 << 20 else n
        self._loan = self._alloc(want)
        self._loan_bytes, self._loan_shared = want, False

    def _end(self, gone: type[DevdError], why: str) -> None:
        """Close the Store (freeing the instance and its memory) and fix what every later call answers."""
        self._gone, self._gone_why = gone, why
        store, self._store = self._store, None
        self._exports = {}
        self._instance = None
        if store is not None:
            store.close()

    def _end_with_core(self) -> None:
        with self._busy:
            if self._gone is None:
                self._end(HandleError, "the core this session ran in was closed; restore it in another Core")
