"""`python -m benchmarks.bench long`: how one session's cost grows with its length, through the real daemon.

A session that lives for thousands of turns is what an agent tool makes of a working day. Whatever the daemon does
per step in proportion to the session's length (the transcript every `Model` ask carries, the journal keeping whole
actions, a snapshot rewritten whole) shows here as a curve, where the other benchmarks, whose sessions stay short,
cannot see it. One client, one session, `devd serve` as a subprocess on a state directory of its own:

- the default mode repeats the seed's full turn (a prompt, an answer with an `Exec` and a `Read`, their two results
  of about `--output-bytes` each, a text answer) and, per window of turns, reports the steps' latency as the client
  sees it (from sending the request to reading its answer), the bytes the daemon wrote to disk per step, the state
  directory, the session's snapshot and the daemon's RSS; then it restarts the daemon (SIGTERM) and times the first
  steps of the session woken from disk;
- `--big-turn N` runs one turn whose model asks for one more `Exec` N times, each result `--output-bytes` long, and
  reports per `--big-every` calls. A step the daemon refuses (a `DEADLINE`, say) is counted by kind, the session is
  recovered and the step sent again, until `--max-errors`: the mode then stops and says where;
- `--summary-every N` (the default mode) ends every Nth turn with a `Summary` event replacing the whole conversation
  so far (core ABI 2): the asks, the snapshot and the instance's memory then stay flat however many turns there are.

Every id an event carries is one the daemon answered (the ask's, the calls'), never a guess. The daemon runs from a
frozen copy of the package (the working tree, or `--git-rev`), so that edits made meanwhile cannot change it between
the two lives; the figures are for that code, and the report says which it was.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.bench import _proc_status, _server_argv, _soak_freeze, _tree_bytes, _wait_socket, _write_stdout
from devd import errors
from devd.client import Client
from devd.messages import Call, Config, Event, Exec, Output, Read, Summarize, answer, encode, turn
from devd.protocol import SessionParams, SnapshotResult, StepParams

TURNS = 2000
WINDOW_TURNS = 250
OUTPUT_BYTES = 1024
STEPS_PER_TURN = 5
AFTER_RESTART_STEPS = 10  # timed after the first step of the woken session
BIG_EVERY_CALLS = 100
MAX_ERRORS = 3
CLIENT_TIMEOUT_S = 300.0  # a step is bounded by the daemon's deadline (60 s at most) plus its commit: far under this
STOP_TIMEOUT_S = 60.0  # a SIGTERM'd daemon lets calls in flight finish (10 s), commits and exits
# The disk bound (store issue): the state directory at most DISK_BOUND times (the latest snapshot + the journal kept)
# plus DISK_WAL_BYTES for the write-ahead log, at every turn. The journal kept is counted as the events of the last
# KEPT_STEPS steps (the daemon's steps_kept_per_session): what it promises to keep, so never more than it keeps.
DISK_BOUND = 3.0
DISK_WAL_BYTES = 8 << 20
KEPT_STEPS = 1000
DISK_SNAPSHOT_EVERY_TURNS = 10  # the snapshot's length is asked this often (in between, the last one asked counts)


class _Action(msgspec.Struct, frozen=True):
    """An action as far as the client needs it: its id, and its op left raw under the op's one member name."""

    id: int
    op: dict[str, msgspec.Raw]

    @property
    def kind(self) -> str:
        return next(iter(self.op))


class _Actions(msgspec.Struct, frozen=True):
    actions: list[_Action]


_actions = msgspec.json.Decoder(_Actions)


class _StepFailed(Exception):
    """A step answered with an error (its kind as the daemon named it), or not answered at all."""

    def __init__(self, kind: str, message: str, fatal: bool = False) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.fatal = fatal  # the connection or the daemon is gone: no retry can help


class _Stopped(Exception):
    """The mode stops: too many errors, or one nothing can recover from; what happened is in the error log."""


# -- the daemon ----------------------------------------------------------------------------------------------------


class _Daemon:
    """`devd serve` on one state directory, from a frozen copy of the package, started and stopped by this bench."""

    def __init__(self, root: Path, git_rev: str | None, daemon_args: list[str]) -> None:
        self.root = root
        self.code = root / "code"
        self.provenance = _soak_freeze(self.code, git_rev)
        self.socket = root / "run" / "devd.sock"
        self.state = root / "state"
        self.argv = _server_argv("devd", self.socket, self.state) + daemon_args
        self.env = {**os.environ, "PYTHONPATH": str(self.code)}
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> float:
        """Start a life of the daemon; the seconds until it answers. Its socket accepts connections before that (it
        is bound first, then the core is compiled and the sessions listed), so a step timed from when it merely
        listens would count the rest of the start."""
        self.socket.parent.mkdir(mode=0o700, exist_ok=True)
        started = time.perf_counter()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.code, env=self.env)
        try:
            _wait_socket(self.socket, self.proc)
            with self.client() as client:
                client.initialize()
        except (RuntimeError, TimeoutError, OSError, errors.DevdError) as e:
            raise RuntimeError(f"the daemon did not start: {e}; its log ends: {self.log_tail()}") from None
        return time.perf_counter() - started

    def stop(self) -> dict[str, Any]:
        """SIGTERM, as a service manager stops it; its exit code and how long it took."""
        assert self.proc is not None
        started = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return {"exit": code, "stop_s": round(time.perf_counter() - started, 3)}

    def kill(self) -> None:
        """Whatever happened, the daemon does not outlive the bench."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> Client:
        return Client.connect(self.socket, timeout=CLIENT_TIMEOUT_S)

    def io(self) -> tuple[int, int]:
        """(bytes the daemon caused to be written to disk, bytes it passed to write()), from /proc/PID/io."""
        fields = dict(line.split(": ") for line in Path(f"/proc/{self.pid}/io").read_text().splitlines())
        return int(fields["write_bytes"]), int(fields["wchar"])

    def rss_mib(self) -> float:
        return round(_proc_status(self.pid)["VmRSS"] / 1024, 1)

    def state_mib(self) -> float:
        return round(_tree_bytes(self.state) / (1 << 20), 2)

    def log_tail(self) -> str:
        try:
            return self.log.read_bytes()[-1500:].decode(errors="replace").strip()
        except FileNotFoundError:
            return ""


# -- one session, stepped and timed ----------------------------------------------------------------------------------


def _config(asks: str) -> Config | None:
    """The session's config: none for the default (whole-transcript asks), else the asks named."""
    return None if asks == "full" else Config(asks="delta")


def _output(rng: random.Random, size: int) -> str:
    """`size` characters of text that compression cannot shrink much: random bytes in base64, in lines like a log's."""
    flat = base64.b64encode(rng.randbytes(size)).decode()
    return "\n".join(flat[i : i + 75] for i in range(0, size, 75))[:size]


class _Stepper:
    """One connection to one session. A step is timed from sending its request to reading its answer's line; its
    actions are decoded after the clock stops. An error answer is logged, the session recovered and the step sent
    again, until `max_errors`."""

    def __init__(self, client: Client, session: str, max_errors: int) -> None:
        self.client = client
        self.session = session
        self.max_errors = max_errors
        self.latencies: list[float] = []  # seconds, the successful steps since the last `take_latencies`
        self.steps = 0
        self.sent_bytes = 0  # the events' bytes, over the whole run
        self.recent: deque[int] = deque(maxlen=KEPT_STEPS)  # the last KEPT_STEPS events' lengths
        self.errors: Counter[str] = Counter()
        self.error_log: list[dict[str, Any]] = []

    def take_latencies(self) -> list[float]:
        taken, self.latencies = self.latencies, []
        return taken

    def step(self, event: bytes, where: str) -> list[_Action]:
        """The step's actions; raises _Stopped once errors are past their bound or cannot be recovered from."""
        while True:
            started = time.perf_counter()
            try:
                raw = self._send(event)
            except _StepFailed as e:
                self._failed(e, where, time.perf_counter() - started)
                continue
            self.latencies.append(time.perf_counter() - started)
            self.steps += 1
            self.sent_bytes += len(event)
            self.recent.append(len(event))
            return _actions.decode(raw).actions

    def _send(self, event: bytes) -> bytes:
        try:
            return self.client.call_raw("session/step", StepParams(self.session, msgspec.Raw(event)))
        except errors.DevdError as e:
            raise _StepFailed(e.kind, str(e)) from None
        except (OSError, ConnectionError) as e:  # the daemon died, or did not answer within CLIENT_TIMEOUT_S
            raise _StepFailed("CONNECTION", f"{type(e).__name__}: {e}", fatal=True) from None

    def _failed(self, e: _StepFailed, where: str, elapsed_s: float) -> None:
        self.errors[e.kind] += 1
        entry: dict[str, Any] = {"at": where, "kind": e.kind, "ms": round(elapsed_s * 1000, 1), "message": e.message}
        self.error_log.append(entry)
        if e.fatal or sum(self.errors.values()) >= self.max_errors:
            raise _Stopped(str(e))
        started = time.perf_counter()
        try:
            self.client.call("session/recover", SessionParams(self.session))
        except errors.DevdError as r:
            self.errors[f"recover {r.kind}"] += 1
            entry["recover"] = f"{r.kind}: {r}"
            raise _Stopped(f"session/recover answered {r.kind}") from None
        except (OSError, ConnectionError) as r:
            entry["recover"] = f"CONNECTION: {r}"
            raise _Stopped(f"session/recover failed: {r}") from None
        entry["recover"] = f"ok in {(time.perf_counter() - started) * 1000:.1f} ms; the step is sent again"

    def snapshot_bytes(self) -> tuple[int, float]:
        """The session's snapshot, decoded from base64: its length, and the ms the call took (outside the steps)."""
        started = time.perf_counter()
        result: SnapshotResult = self.client.request("session/snapshot", SessionParams(self.session))
        elapsed = time.perf_counter() - started
        return len(base64.b64decode(result.snapshot)), round(elapsed * 1000, 3)


def _only(actions: list[_Action], kind: str, where: str) -> int:
    """The id of the one action of `kind` the core answered; an answer without it stops the run (the core changed)."""
    ids = [a.id for a in actions if a.kind == kind]
    if len(ids) != 1:
        got = ", ".join(a.kind for a in actions) or "no action"
        raise _Stopped(f"UNEXPECTED: {where}: expected one {kind} action, got {got}")
    return ids[0]


@dataclasses.dataclass
class _Conversation:
    """The seed's full turn, again and again, each event built from the ids the daemon answered for the last one."""

    stepper: _Stepper
    output_bytes: int
    rng: random.Random
    turn: int = 0
    position: int = STEPS_PER_TURN  # the next step's place in its turn (0-4); 5: the turn is over
    ask: int = 0  # the pending Model ask's id
    exec_id: int = 0
    read_id: int = 0
    summary_every: int = 0  # a Summary of everything after every this many turns (0: never)
    messages: int = 0  # the session's transcript, counted: 5 messages a turn, 1 after a summary

    def step(self) -> None:
        """One step: the next event of the turn (or of the next turn), sent, and the ids of its answer kept."""
        if self.position == STEPS_PER_TURN:
            self.turn, self.position = self.turn + 1, 0
        where = f"turn {self.turn}, step {self.position + 1}"
        actions = self.stepper.step(self._event(), where)
        self._answered(actions, where)
        self.position += 1
        if self.position == STEPS_PER_TURN:
            self.messages += 5  # the prompt, the calls, their two results, the answer
            if self.summary_every and self.turn % self.summary_every == 0:
                summary = Event(Summary=Summarize(upto=self.messages, text=f"turns 1 to {self.turn}: fixed the build"))
                if self.stepper.step(encode(summary), f"turn {self.turn}, its summary"):
                    raise _Stopped(f"UNEXPECTED: turn {self.turn}'s summary was answered with actions")
                self.messages = 1

    def _event(self) -> bytes:
        n, size = self.turn, self.output_bytes
        if self.position == 0:
            return encode(turn(n, f"fix the build, take {n}"))
        if self.position == 1:
            calls = [Call(Exec=Exec(argv=["cargo", "build"])), Call(Read=Read(path=f"src/mod{n}.rs"))]
            return encode(answer(self.ask, "Let me look.", calls))
        if self.position == 2:
            return encode(Event(Exec=Output(id=self.exec_id, text=_output(self.rng, size), failed=True)))
        if self.position == 3:
            return encode(Event(File=Output(id=self.read_id, text=_output(self.rng, size))))
        return encode(answer(self.ask, f"`x{n}` was never declared."))

    def _answered(self, actions: list[_Action], where: str) -> None:
        if self.position in (0, 3):
            self.ask = _only(actions, "Model", where)
        elif self.position == 1:
            self.exec_id, self.read_id = _only(actions, "Exec", where), _only(actions, "Read", where)
        elif self.position == 2 and actions:
            raise _Stopped(f"UNEXPECTED: {where}: expected no action, got {len(actions)}")
        elif self.position == 4:
            _only(actions, "Done", where)


# -- figures -----------------------------------------------------------------------------------------------------


def _latency_ms(latencies: list[float]) -> dict[str, float | None]:
    """p50, p99, max and mean in ms, as the other benchmarks take them (the value at that rank)."""
    if not latencies:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    ordered = sorted(latencies)
    return {
        "p50_ms": round(ordered[len(ordered) // 2] * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 2)


def _offloaded(client: Client) -> int:
    """Calls that passed the daemon's inline budget and ran on a worker thread, since it started."""
    return int(client.call("daemon/status")["offloaded"])


@dataclasses.dataclass
class _DiskWatch:
    """The state directory against the disk bound, after every turn: the largest ratio of its bytes to (the latest
    snapshot + the journal kept) over the run, and the largest of the same less the WAL's allowance (the bound holds
    while that is at most DISK_BOUND)."""

    daemon: _Daemon
    stepper: _Stepper
    snapshot: int = 0
    turns: int = 0
    ratio_max: float = 0.0
    less_wal_max: float = 0.0
    at_turn: int = 0
    state_bytes_max: int = 0

    def sample(self) -> None:
        if self.turns % DISK_SNAPSHOT_EVERY_TURNS == 0:
            self.snapshot = self.stepper.snapshot_bytes()[0]
        self.turns += 1
        state = _tree_bytes(self.daemon.state)
        kept = self.snapshot + sum(self.stepper.recent)
        if not kept:
            return
        self.state_bytes_max = max(self.state_bytes_max, state)
        less_wal = (state - DISK_WAL_BYTES) / kept
        if less_wal > self.less_wal_max:
            self.less_wal_max, self.at_turn = less_wal, self.turns
        self.ratio_max = max(self.ratio_max, state / kept)

    def result(self) -> dict[str, Any]:
        return {
            "state_dir_over_kept_max": round(self.ratio_max, 2),
            "state_dir_less_wal_over_kept_max": round(self.less_wal_max, 2),
            "at_turn": self.at_turn,
            "state_mib_max": round(self.state_bytes_max / (1 << 20), 2),
            "bound": DISK_BOUND,
            "within_bound": self.less_wal_max <= DISK_BOUND,
        }


@dataclasses.dataclass
class _Window:
    """The daemon's counters when a window opened; `close` makes its row."""

    daemon: _Daemon
    stepper: _Stepper
    first: str
    io: tuple[int, int] = (0, 0)
    steps: int = 0
    errors: int = 0
    offloaded: int = 0

    def __post_init__(self) -> None:
        self.io, self.steps, self.errors = self.daemon.io(), self.stepper.steps, len(self.stepper.error_log)
        self.offloaded = _offloaded(self.stepper.client)

    def close(self, label: str, snapshot: bool) -> dict[str, Any]:
        """The row: latencies of the window's steps, then, outside them, what the daemon wrote and holds."""
        latencies = self.stepper.take_latencies()
        disk, written = self.daemon.io()
        steps = self.stepper.steps - self.steps
        row: dict[str, Any] = {label: self.first, "steps": steps, **_latency_ms(latencies)}
        row["disk_bytes_per_step"] = round((disk - self.io[0]) / steps) if steps else None
        row["write_bytes_per_step"] = round((written - self.io[1]) / steps) if steps else None
        row["state_mib"] = self.daemon.state_mib()
        row["rss_mib"] = self.daemon.rss_mib()
        row["offloaded"] = _offloaded(self.stepper.client) - self.offloaded
        row["errors"] = len(self.stepper.error_log) - self.errors  # their attempts are not among the latencies
        if snapshot:
            row["snapshot_bytes"], row["snapshot_ms"] = self.stepper.snapshot_bytes()
            row["sent_bytes"] = self.stepper.sent_bytes
        return row


# -- the two modes ---------------------------------------------------------------------------------------------------


def bench_long(
    turns: int = TURNS,
    window: int = WINDOW_TURNS,
    output_bytes: int = OUTPUT_BYTES,
    daemon_args: list[str] | None = None,
    git_rev: str | None = None,
    max_errors: int = MAX_ERRORS,
    progress: bool = False,
    asks: str = "full",
    summary_every: int = 0,
) -> dict[str, Any]:
    """`turns` seed turns on one session (its config's `asks`: the whole transcript in each Model ask, or only what is
    new), a row per `window` turns, then a restart and the woken session's first steps. An error answer is counted,
    the session recovered and the step sent again; at `max_errors` the run stops cleanly, with what was measured until
    then (and no restart)."""
    root = Path(tempfile.mkdtemp(prefix="devd-long-"))
    root.chmod(0o700)
    daemon = _Daemon(root, git_rev, list(daemon_args or []))
    result: dict[str, Any] = {"mode": "long", "turns": turns, "window": window, "output_bytes": output_bytes}
    result["asks"], result["summary_every"] = asks, summary_every
    result.update({"daemon_args": list(daemon_args or []), "code": daemon.provenance, "windows": [], "restart": None})
    try:
        daemon.start()
        with daemon.client() as client:
            stepper = _Stepper(client, client.new(_config(asks), session="long"), max_errors)
            talk = _Conversation(stepper, output_bytes, random.Random(1), summary_every=summary_every)
            disk = _DiskWatch(daemon, stepper)
            result["stopped"] = _run_windows(daemon, talk, turns, window, result["windows"], progress, disk)
            result["disk"] = disk.result()
        if result["stopped"] is None:
            result["restart"] = _restart(daemon, talk)
        result["errors"], result["error_log"] = dict(stepper.errors), stepper.error_log
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    result["ratios"] = _long_ratios(result["windows"])
    return result


def _run_windows(
    daemon: _Daemon,
    talk: _Conversation,
    turns: int,
    window: int,
    rows: list[dict[str, Any]],
    progress: bool,
    disk: _DiskWatch | None = None,
) -> str | None:
    """Append a row per window of turns; None, or why the run stopped early (its partial window is still a row).
    With `disk`, the state directory is measured against the disk bound after every turn (outside the steps)."""
    for first in range(1, turns + 1, window):
        last = min(first + window - 1, turns)
        opened = _Window(daemon, talk.stepper, f"{first}-{last}")
        stopped = None
        try:
            while talk.turn < last or talk.position < STEPS_PER_TURN:
                talk.step()
                if disk is not None and talk.position == STEPS_PER_TURN:
                    disk.sample()
        except _Stopped as e:
            stopped = str(e)
        if daemon.proc is not None and daemon.proc.poll() is not None:
            return stopped or f"the daemon exited with {daemon.proc.returncode}: {daemon.log_tail()}"
        rows.append(opened.close("turns", snapshot=True))
        if progress:
            _progress(rows[-1])
        if stopped is not None:
            return stopped
    return None


def _restart(daemon: _Daemon, talk: _Conversation) -> dict[str, Any]:
    """SIGTERM, a new life on the same state directory, then the next turn's first step and the 10 after it."""
    stopped = daemon.stop()
    ready_s = daemon.start()
    row: dict[str, Any] = {**stopped, "ready_s": round(ready_s, 3), "turn": talk.turn + 1}
    with daemon.client() as client:
        talk.stepper.client = client
        talk.stepper.take_latencies()
        try:
            talk.step()
            row["first_step_ms"] = round(talk.stepper.take_latencies()[0] * 1000, 3)
            for _ in range(AFTER_RESTART_STEPS):
                talk.step()
        except _Stopped as e:
            row["stopped"] = str(e)
        after = talk.stepper.take_latencies()
        row["next_steps_ms"] = [round(s * 1000, 3) for s in after]
        row.update({f"next_{k}": v for k, v in _latency_ms(after).items()})
        row["rss_mib"] = daemon.rss_mib()
    return row


def _long_ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    if not rows:
        return {}
    first, last = rows[0], rows[-1]
    held = (last.get("snapshot_bytes") or 0) + last.get("sent_bytes", 0)
    return {
        "p50_last_over_first": _ratio(last["p50_ms"], first["p50_ms"]),
        "disk_bytes_per_step_last_over_first": _ratio(last["disk_bytes_per_step"], first["disk_bytes_per_step"]),
        "state_dir_over_snapshot_plus_events": _ratio(last["state_mib"] * (1 << 20), held),
    }


def bench_big_turn(
    calls: int,
    output_bytes: int,
    every: int = BIG_EVERY_CALLS,
    daemon_args: list[str] | None = None,
    git_rev: str | None = None,
    max_errors: int = MAX_ERRORS,
    progress: bool = False,
    asks: str = "full",
) -> dict[str, Any]:
    """One turn of `calls` Exec calls of `output_bytes` each, then the final answer; a row per `every` calls (each
    call is two steps: the model's answer asking for it, and its result)."""
    root = Path(tempfile.mkdtemp(prefix="devd-big-"))
    root.chmod(0o700)
    daemon = _Daemon(root, git_rev, list(daemon_args or []))
    result: dict[str, Any] = {"mode": "big-turn", "calls": calls, "every": every, "output_bytes": output_bytes}
    result["asks"] = asks
    result.update({"daemon_args": list(daemon_args or []), "code": daemon.provenance, "rows": []})
    try:
        daemon.start()
        with daemon.client() as client:
            stepper = _Stepper(client, client.new(_config(asks), session="big"), max_errors)
            result["stopped"] = _run_big_turn(daemon, stepper, calls, output_bytes, every, result, progress)
            result["errors"], result["error_log"] = dict(stepper.errors), stepper.error_log
            result["snapshot_bytes"] = None if result["stopped"] else _snapshot_at_end(stepper, result)
            result["sent_bytes"] = stepper.sent_bytes
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    return result


def _snapshot_at_end(stepper: _Stepper, result: dict[str, Any]) -> int | None:
    """The length of the session's snapshot once the turn is done; None, and why in result, when it is refused (a
    session too large to snapshot within its memory is answered NULL, and the run's figures still stand)."""
    try:
        return stepper.snapshot_bytes()[0]
    except errors.DevdError as e:
        result["snapshot_error"] = f"{e.kind}: {e}"
        return None


def _run_big_turn(
    daemon: _Daemon, stepper: _Stepper, calls: int, size: int, every: int, result: dict[str, Any], progress: bool
) -> str | None:
    """The turn, a row per `every` calls into result["rows"]; None, or why it stopped (its partial row is kept)."""
    rng = random.Random(1)
    rows: list[dict[str, Any]] = result["rows"]
    try:
        ask = _only(stepper.step(encode(turn(1, "make the tests pass")), "the turn"), "Model", "the turn")
        result["turn_step_ms"] = round(stepper.take_latencies()[0] * 1000, 3)
        for first in range(1, calls + 1, every):
            last = min(first + every - 1, calls)
            opened = _Window(daemon, stepper, f"{first}-{last}")
            try:
                for n in range(first, last + 1):
                    ask = _big_call(stepper, rng, ask, n, size)
            finally:
                if daemon.proc is not None and daemon.proc.poll() is None:
                    rows.append(opened.close("calls", snapshot=False))
                    if progress:
                        _progress(rows[-1])
        done = stepper.step(encode(answer(ask, "All green.")), "the final answer")
        _only(done, "Done", "the final answer")
        result["final_step_ms"] = round(stepper.take_latencies()[0] * 1000, 3)
    except _Stopped as e:
        return str(e)
    return None


def _big_call(stepper: _Stepper, rng: random.Random, ask: int, n: int, size: int) -> int:
    """Call n: the model asks for one more Exec, its result comes back; the id of the next Model ask."""
    call = [Call(Exec=Exec(argv=["make", "test", f"-j{n}"]))]
    exec_id = _only(stepper.step(encode(answer(ask, None, call)), f"call {n}, ask"), "Exec", f"call {n}")
    result = encode(Event(Exec=Output(id=exec_id, text=_output(rng, size), failed=True)))
    return _only(stepper.step(result, f"call {n}, result"), "Model", f"call {n}")


# -- the report ------------------------------------------------------------------------------------------------------


def _progress(row: dict[str, Any]) -> None:
    """A row's gist on stderr as soon as it is measured: a long run shows its curve while it runs."""
    span = f"turns {row['turns']}" if "turns" in row else f"calls {row['calls']}"
    print(f"long: {span}: p50 {row['p50_ms']} ms, max {row['max_ms']} ms", file=sys.stderr, flush=True)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> list[str]:
    """Rows as right-aligned columns, each as wide as its longest cell."""
    cells = [[title for _, title in columns]] + [[_cell(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]


_LONG_COLUMNS = [
    ("turns", "turns"),
    ("steps", "steps"),
    ("p50_ms", "p50 ms"),
    ("p99_ms", "p99 ms"),
    ("max_ms", "max ms"),
    ("mean_ms", "mean ms"),
    ("disk_bytes_per_step", "disk B/step"),
    ("write_bytes_per_step", "write() B/step"),
    ("state_mib", "state MiB"),
    ("snapshot_bytes", "snapshot B"),
    ("snapshot_ms", "snapshot ms"),
    ("rss_mib", "RSS MiB"),
    ("offloaded", "offloaded"),
    ("errors", "errors"),
]
_BIG_COLUMNS = [("calls", "calls"), *[c for c in _LONG_COLUMNS[1:] if not c[0].startswith("snapshot")]]


def _errors_report(r: dict[str, Any]) -> list[str]:
    out = []
    if r.get("stopped"):
        out.append(f"stopped early: {r['stopped']}")
    counts = r.get("errors") or {}
    out.append("errors: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "none"))
    for e in r.get("error_log") or []:
        recover = f"; recover: {e['recover']}" if "recover" in e else ""
        out.append(f"  {e['at']}: {e['kind']} after {e['ms']} ms: {e['message'][:200]}{recover}")
    return out


def report_long(r: dict[str, Any]) -> str:
    """The windows as a table, the restart, the ratios and the errors."""
    out = [
        f"long: {r['turns']} turns of {STEPS_PER_TURN} steps, a row per {r['window']} turns, tool outputs of "
        f"{r['output_bytes']} bytes, asks {r['asks']}, a summary every {r.get('summary_every') or 'no'} turns, "
        f"daemon args {r['daemon_args'] or 'none'}",
        f"code: {r['code']}",
        "latency: client-side, request sent to answer read; disk B: /proc write_bytes; snapshot and RSS at the "
        "window's end, outside the steps",
        "",
        *_table(r["windows"], _LONG_COLUMNS),
        "",
    ]
    x = r["restart"]
    if x is None:
        out.append("restart: not measured (the run stopped early)")
    else:
        out.append(
            f"restart: SIGTERM exit {x['exit']} after {x['stop_s']} s; answering after {x['ready_s']} s; turn "
            f"{x['turn']}: first step {_cell(x.get('first_step_ms'))} ms; next {len(x['next_steps_ms'])} steps p50 "
            f"{_cell(x['next_p50_ms'])} ms, max {_cell(x['next_max_ms'])} ms; RSS {x['rss_mib']} MiB"
        )
        out.append(f"  next steps ms: {', '.join(_cell(v) for v in x['next_steps_ms'])}")
        if x.get("stopped"):
            out.append(f"  stopped: {x['stopped']}")
    ratios = r["ratios"]
    out.append("")
    out.append("ratios:")
    out.append(f"  p50, last window / first:          {_cell(ratios.get('p50_last_over_first'))}")
    out.append(f"  disk B/step, last window / first:  {_cell(ratios.get('disk_bytes_per_step_last_over_first'))}")
    out.append(f"  state dir / (snapshot + events sent): {_cell(ratios.get('state_dir_over_snapshot_plus_events'))}")
    if d := r.get("disk"):
        out.append(
            f"disk, after every turn: state dir / (latest snapshot + journal kept) max {d['state_dir_over_kept_max']}; "
            f"less {DISK_WAL_BYTES >> 20} MiB for the WAL, max {d['state_dir_less_wal_over_kept_max']} at turn "
            f"{d['at_turn']} (bound {d['bound']}: {'within' if d['within_bound'] else 'PAST IT'}); state dir max "
            f"{d['state_mib_max']} MiB"
        )
    out += _errors_report(r)
    return "\n".join(out)


def report_big_turn(r: dict[str, Any]) -> str:
    """The calls as a table, the turn's first and last steps, and the errors."""
    out = [
        f"big turn: 1 turn of {r['calls']} Exec calls (2 steps each) of {r['output_bytes']} bytes, a row per "
        f"{r['every']} calls, asks {r['asks']}, daemon args {r['daemon_args'] or 'none'}",
        f"code: {r['code']}",
        "",
        *_table(r["rows"], _BIG_COLUMNS),
        "",
        f"the turn's first step: {_cell(r.get('turn_step_ms'))} ms; the final answer: {_cell(r.get('final_step_ms'))}"
        f" ms; snapshot at the end: {_cell(r.get('snapshot_bytes'))} B; events sent: {_cell(r.get('sent_bytes'))} B",
        *([f"the snapshot at the end was refused: {r['snapshot_error']}"] if "snapshot_error" in r else []),
    ]
    out += _errors_report(r)
    return "\n".join(out)


# -- waking long sessions ---------------------------------------------------------------------------------------------


def bench_wake(
    sessions: int = 20,
    turns: int = 100,
    rounds: int = 3,
    output_bytes: int = OUTPUT_BYTES,
    git_rev: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """`sessions` sessions of `turns` seed turns each under `--max-live 1`, so that every step on one hibernates the
    one before; then `rounds` rounds of a step (the next turn's prompt, whose answer is the Model ask of the whole
    transcript) on each in turn, every one of them a wake: rebuilt from its snapshot and journal, then stepped."""
    root = Path(tempfile.mkdtemp(prefix="devd-wake-"))
    root.chmod(0o700)
    daemon = _Daemon(root, git_rev, ["--max-live", "1"])
    result: dict[str, Any] = {"mode": "wake", "sessions": sessions, "turns": turns, "rounds": rounds}
    result["code"] = daemon.provenance
    try:
        daemon.start()
        with daemon.client() as client:
            talks = []
            for n in range(sessions):
                stepper = _Stepper(client, client.new(session=f"s{n}"), MAX_ERRORS)
                talk = _Conversation(stepper, output_bytes, random.Random(n))
                while talk.turn < turns or talk.position < STEPS_PER_TURN:
                    talk.step()
                talks.append(talk)
                if progress:
                    print(f"wake: session {n + 1} of {sessions} has {turns} turns", file=sys.stderr, flush=True)
            rebuilt = client.status().rebuilt
            wakes: list[float] = []
            for _ in range(rounds):
                for talk in talks:
                    talk.stepper.take_latencies()
                    talk.step()  # a new turn's prompt: the first step since the session hibernated
                    wakes.extend(talk.stepper.take_latencies())
                    while talk.position < STEPS_PER_TURN:
                        talk.step()  # the rest of the turn, so the next round starts a turn again
            result["rebuilt"] = client.status().rebuilt - rebuilt
            result["snapshot_bytes"] = talks[0].stepper.snapshot_bytes()[0]
        result["wake_ms"] = _latency_ms(wakes)
        result["wakes"] = len(wakes)
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    return result


def report_wake(r: dict[str, Any]) -> str:
    ms = r["wake_ms"]
    return "\n".join(
        [
            f"wake: {r['sessions']} sessions of {r['turns']} turns under --max-live 1, {r['rounds']} rounds",
            f"code: {r['code']}",
            f"wakes: {r['wakes']} steps, {r['rebuilt']} rebuilds; a session's snapshot: {r['snapshot_bytes']:,} B",
            f"wake step (rebuild + the Model ask of the whole transcript), ms: p50 {ms['p50_ms']}, p99 {ms['p99_ms']}, "
            f"max {ms['max_ms']}",
        ]
    )


# -- the command line ----------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=TURNS)
    p.add_argument("--window", type=int, default=WINDOW_TURNS, help="turns per row")
    p.add_argument("--output-bytes", type=int, default=OUTPUT_BYTES, help="each tool result's length")
    p.add_argument("--big-turn", type=int, metavar="N", help="instead: one turn of N Exec calls")
    p.add_argument(
        "--wake",
        type=int,
        metavar="N",
        help="instead: N sessions of --turns turns under --max-live 1, each then woken by a step (--rounds times)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of wakes, with --wake")
    p.add_argument("--big-every", type=int, default=BIG_EVERY_CALLS, help="calls per row of --big-turn")
    p.add_argument("--max-errors", type=int, default=MAX_ERRORS, help="error answers before the run stops")
    p.add_argument(
        "--daemon-arg", action="append", default=[], help="passed to devd serve, e.g. --daemon-arg=--max-live=10"
    )
    p.add_argument(
        "--asks",
        choices=("full", "delta"),
        default="full",
        help="what the session's Model asks carry: the whole transcript (the default) or only what is new",
    )
    p.add_argument(
        "--summary-every", type=int, default=0, metavar="N", help="a Summary of the whole conversation every N turns"
    )
    p.add_argument("--git-rev", help="run the daemon from this commit's devd/ rather than the working tree")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def command(args: argparse.Namespace) -> int:
    """Exit 1 when the run stopped on an error or counted any, else 0."""
    daemon_args, rev, max_errors = args.daemon_arg, args.git_rev, args.max_errors
    if args.wake is not None:
        result = bench_wake(args.wake, args.turns, args.rounds, args.output_bytes, rev, True)
        text = report_wake(result)
    elif args.big_turn is not None:
        result = bench_big_turn(
            args.big_turn, args.output_bytes, args.big_every, daemon_args, rev, max_errors, True, args.asks
        )
        text = report_big_turn(result)
    else:
        every, output = args.summary_every, args.output_bytes
        result = bench_long(args.turns, args.window, output, daemon_args, rev, max_errors, True, args.asks, every)
        text = report_long(result)
    if args.json:
        _write_stdout(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    else:
        print(text, flush=True)
    return 1 if result.get("stopped") or result.get("errors") else 0
