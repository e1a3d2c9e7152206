"""`python -m benchmarks.bench fleet`: daemons sharing one PostgreSQL, against the SQLite daemon in the same run.

Two questions from the fleet issue (docs/fleet.md): do two daemons on one database serve more durable steps per
second than one, and how long does a session take to move from one daemon to another?

**Throughput.** The bench starts a PostgreSQL 15 cluster of its own (initdb and pg_ctl in a temporary directory, on a
free loopback port, `fsync` and `synchronous_commit` on, as the `postgres` user when run as root; stopped and removed
at the end, whatever happens). Three setups, each under the daemon bench's load generator (`benchmarks.bench._load`: 16
clients, one request in flight each, conversations of 20 seed turns then a new session, every answer durable), in
two generator processes of 8 clients for every setup, so that the rows differ only in their servers:

- `sqlite`: `devd serve` as it starts by default (its SQLite store in its state directory);
- `fleet-1`: one daemon on the PostgreSQL store (`--store postgresql://…`, `--node a`), both generators on it;
- `fleet-2`: two daemons (`a`, `b`) on the same database, one generator (8 clients) on each. A client makes its
  sessions on the daemon it talks to, so no call answers MOVED in the steady state.

Each run has a fresh state directory and a fresh database, so no round inherits the sessions of the one before. The
setups are alternated round by round, so that drift on the machine hits them alike, and each figure is the median of
the rounds (as `bench daemon` does). The ratios fleet-1/sqlite and fleet-2/fleet-1 are the figures to trust: the
machine is small and shared. `server_cpu_share` is the daemons' CPU (both, for fleet-2); PostgreSQL's own is in
`other_cpu_share` with whatever else ran. The generator stops on any error answer, so a round in which a daemon
answers one fails: the row is the median of the rounds that did not, and the report says why the others failed (the
bench then exits 1).

**A session's move.** Two fleet daemons `a` and `b` on a fresh database. `--sessions` sessions are made on `a` and as
many on `b`, each stepped through 5 seed turns. Then `a` is drained (`daemon/drain`: it gives its sessions back to
the fleet), and for each of `a`'s sessions one step (the next turn's prompt) is sent to `b` on a client that does
not follow MOVED: that step acquires the session (a new epoch), reads it and rebuilds it from its durable state,
then steps and commits it. Each is paired with the same step on one of `b`'s own sessions, live there already (the
baseline: a step and its commit alone), sent next, so that the two alternate. Reported: the move step's p50 and p99,
the baseline's, and the median of the pairwise differences (what the move itself costs).

PostgreSQL is started by `benchmarks.pg_local`, as the tests start theirs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import pg_local
from benchmarks.bench import (
    TURNS_PER_SESSION,
    _conversation,
    _loop_name,
    _median_row,
    _run_load,
    _run_split_load,
    _server_argv,
    _wait_socket,
    _write_stdout,
)
from benchmarks.pg_local import Cluster
from devd.client import Client
from devd.errors import DevdError
from tests.helpers import seed_turn

CLIENTS = 16
GENERATORS = 2  # in every setup: fleet-2 needs one per daemon, and the other rows get the same
SETUPS = ("sqlite", "fleet-1", "fleet-2")
MOVE_TURNS = 5  # seed turns each session of the move test has before it moves
MOVE_FILL_CONNECTIONS = 8  # per daemon, to make the move test's sessions (not measured)
MOVE_TARGET_MS = 10.0
STOP_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 60.0
# What a failed setup or move test raises (a daemon that dies or answers an error, a generator that fails, a task
# group's errors): recorded as the row's error, and the bench goes on. Anything else is a bug here, and stops it.
FAILURES = (RuntimeError, TimeoutError, OSError, ValueError, DevdError, ExceptionGroup)

# Durable as a deployment would run it (the figures are for acknowledged, fsync'd steps); PostgreSQL's default
# shared_buffers, since a round's journal (tens of MB) would not fit the tests' 16 MB.
PG_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "shared_buffers": "128MB",
    "max_connections": "60",
    "log_min_messages": "warning",
}


# -- PostgreSQL, for this run only --------------------------------------------------------------------------------


@contextlib.contextmanager
def _postgres() -> Iterator[Cluster]:
    """A new cluster in a temporary directory, running until the block ends, then stopped and removed."""
    pg = pg_local.start(PG_SETTINGS, prefix="devd-bench-pg-", database_prefix="fleet")
    try:  # stopped on any way out, an interrupt included: a stray postmaster would hold the machine's memory
        yield pg
    finally:
        pg.stop()


# -- the daemons ----------------------------------------------------------------------------------------------------


@dataclass
class _Server:
    """One `devd serve` process with a socket, a state directory and a log of its own."""

    sock: Path
    log: Path
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, root: Path, name: str, extra: list[str]) -> _Server:
        sock, state, log = root / f"{name}.sock", root / f"state-{name}", root / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(_server_argv("devd", sock, state) + extra, stdout=out, stderr=subprocess.STDOUT)
        server = cls(sock, log, proc)
        try:
            _wait_socket(sock, proc)
            # The socket accepts before the store is open (a fleet daemon migrates and registers first): an answer
            # means it serves, so no load window opens on a daemon still starting.
            with Client.connect(sock, timeout=CLIENT_TIMEOUT_S) as c:
                c.call("daemon/status")
        except (RuntimeError, TimeoutError, OSError) as e:
            server.stop()
            tail = server.tail()
            raise RuntimeError(f"{name} did not start: {e}" + (f"; its output ends: {tail}" if tail else "")) from None
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_bytes()[-1500:].decode(errors="replace").strip() if self.log.exists() else ""


def _said(e: BaseException) -> str:
    """An error's message; a task group's, its errors' (its own says only how many there were)."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_said(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}" if isinstance(e, DevdError) else str(e)


def _fleet_flags(url: str, node: str) -> list[str]:
    return ["--store", url, "--node", node]


@contextlib.contextmanager
def _servers(root: Path, specs: list[tuple[str, list[str]]]) -> Iterator[list[_Server]]:
    """The servers of one setup, all answering before the block runs, all stopped (SIGTERM) after it."""
    started: list[_Server] = []
    try:
        for name, extra in specs:
            started.append(_Server.start(root, name, extra))
        yield started
    finally:
        for s in started:
            s.stop()


# -- throughput ------------------------------------------------------------------------------------------------------


def _measure(setup: str, root: Path, pg: Cluster, clients: int, seconds: float) -> dict[str, Any]:
    """One setup under load on fresh state; an error is the row's, and the bench goes on (as `bench daemon`)."""
    database = pg.create_database() if setup != "sqlite" else None
    url = pg.url(database) if database else ""
    specs: dict[str, list[tuple[str, list[str]]]] = {
        "sqlite": [("sqlite", [])],
        "fleet-1": [("a", _fleet_flags(url, "a"))],
        "fleet-2": [("a", _fleet_flags(url, "a")), ("b", _fleet_flags(url, "b"))],
    }
    servers: list[_Server] = []
    try:
        with _servers(root, specs[setup]) as servers:
            if len(servers) == 1:
                return _run_load(str(servers[0].sock), clients, seconds, GENERATORS, servers[0].proc.pid)
            half = clients // len(servers)
            targets = [(str(s.sock), half) for s in servers]
            targets[-1] = (targets[-1][0], clients - half * (len(servers) - 1))
            return _run_split_load(targets, seconds, [s.proc.pid for s in servers])
    except FAILURES as e:
        tails = "; ".join(f"{s.sock.stem}'s output ends: {t}" for s in servers if (t := s.tail()))
        return {"error": _said(e) + (f"; {tails}" if tails else "")}
    finally:
        if database:
            pg.drop_database(database)
        for stale in root.iterdir():  # each run's state directory goes with it: rounds must not fill the disk
            if stale.is_dir() and stale.name.startswith("state-"):
                shutil.rmtree(stale, ignore_errors=True)


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def over(a: str, b: str) -> float | None:
        if "steps_per_s" not in rows.get(a, {}) or "steps_per_s" not in rows.get(b, {}):
            return None  # one of the two was not measured, or failed
        return float(rows[a]["steps_per_s"] / rows[b]["steps_per_s"])

    return {"fleet_1_over_sqlite": over("fleet-1", "sqlite"), "fleet_2_over_fleet_1": over("fleet-2", "fleet-1")}


def _throughput(pg: Cluster, root: Path, clients: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Every setup once per round, in turn; the median of the rounds for each."""
    runs: dict[str, list[dict[str, Any]]] = {setup: [] for setup in SETUPS}
    for _ in range(rounds):
        for setup in SETUPS:
            runs[setup].append(_measure(setup, root, pg, clients, seconds))
    rows = {setup: _median_row(measured) for setup, measured in runs.items()}
    return {
        "rows": rows,
        "ratios": _ratios(rows),
        "ratios_per_round": [_ratios({s: runs[s][r] for s in SETUPS}) for r in range(rounds)],
        "runs": {
            s: [{k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()} for m in measured]
            for s, measured in runs.items()
        },
    }


# -- a session's move ------------------------------------------------------------------------------------------------


async def _make_sessions(address: str, names: list[str], events: list[bytes]) -> None:
    """Each named session made and stepped through `events`, from a few connections at once (not measured)."""
    import anyio

    from devd.client import AsyncClient

    async def one(first: int) -> None:
        async with AsyncClient.connect(address, follow_moved=False) as c:
            for name in names[first::MOVE_FILL_CONNECTIONS]:
                await c.new(session=name)
                for event in events:
                    await c.call_raw("session/step", {"session": name, "event": msgspec.Raw(event)})

    async with anyio.create_task_group() as tg:
        for i in range(min(MOVE_FILL_CONNECTIONS, len(names))):
            tg.start_soon(one, i)


def _timed_step(client: Client, session: str, event: bytes) -> float:
    """Seconds from sending the step to reading its answer; an error answer (MOVED, say) raises."""
    started = time.perf_counter()
    client.call_raw("session/step", {"session": session, "event": msgspec.Raw(event)})
    return time.perf_counter() - started


def _ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(ordered[len(ordered) // 2] * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1000, 3),
    }


def _move(pg: Cluster, root: Path, sessions: int) -> dict[str, Any]:
    """`sessions` sessions moved from a drained daemon `a` to `b`, one step each, each paired with a step on a
    session live on `b` already."""
    import anyio

    conversation = _conversation()
    assert MOVE_TURNS < TURNS_PER_SESSION
    steps = MOVE_TURNS * len(seed_turn(1, 1))
    history, next_turn = conversation[:steps], conversation[steps]  # the next seed turn's prompt
    moving = [f"move-{i:05}" for i in range(sessions)]
    staying = [f"stay-{i:05}" for i in range(sessions)]
    database = pg.create_database()
    url = pg.url(database)
    try:
        with _servers(root, [("move-a", _fleet_flags(url, "a")), ("move-b", _fleet_flags(url, "b"))]) as (a, b):
            anyio.run(_make_sessions, str(a.sock), moving, history)
            anyio.run(_make_sessions, str(b.sock), staying, history)
            with Client.connect(a.sock, timeout=CLIENT_TIMEOUT_S) as ca:
                drained = ca.drain()
            moves, baseline = [], []
            with Client.connect(b.sock, timeout=CLIENT_TIMEOUT_S, follow_moved=False) as cb:
                for mover, stayer in zip(moving, staying, strict=True):  # alternated: drift hits both alike
                    moves.append(_timed_step(cb, mover, next_turn))
                    baseline.append(_timed_step(cb, stayer, next_turn))
                status = cb.call("daemon/status")
            owners = dict(pg.query("SELECT coalesce(owner, ''), count(*) FROM sessions GROUP BY 1", database))
    finally:
        pg.drop_database(database)
    # The move's own cost: each move step less the baseline step sent right after it.
    extra = [m - s for m, s in zip(moves, baseline, strict=True)]
    return {
        "sessions": sessions,
        "turns": MOVE_TURNS,
        "drained": drained,
        "moved": len(moves),
        "baseline_steps": len(baseline),
        "move": _ms(moves),
        "baseline": _ms(baseline),
        "move_minus_baseline_p50_ms": round(statistics.median(extra) * 1000, 3),
        "b_rebuilt": status["rebuilt"],
        "b_errors": status["errors"],
        "owners_after": {str(k): int(v) for k, v in owners.items()},
    }


# -- the whole bench -----------------------------------------------------------------------------------------------


def bench_fleet(seconds: float = 4.0, rounds: int = 3, sessions: int = 200, clients: int = CLIENTS) -> dict[str, Any]:
    """The three setups under load, then a session's move; one PostgreSQL cluster for the whole run."""
    root = Path(tempfile.mkdtemp(prefix="devd-bench-fleet-"))
    try:
        with _postgres() as pg:
            version = str(pg.query("SHOW server_version")[0][0])
            result: dict[str, Any] = {
                "clients": clients,
                "generators": GENERATORS,
                "seconds": seconds,
                "rounds": rounds,
                "event_loop": _loop_name(),
                "cpus": os.cpu_count(),
                "postgres": {"version": version, **{k: PG_SETTINGS[k] for k in ("fsync", "synchronous_commit")}},
            }
            result.update(_throughput(pg, root, clients, seconds, rounds))
            try:
                result["move"] = _move(pg, root, sessions)
            except FAILURES as e:
                result["move"] = {"error": _said(e)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["targets"] = _targets(result)
    return result


def _targets(r: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's two targets; None where the figure is missing (a failed setup)."""
    move_p50 = r["move"].get("move", {}).get("p50_ms")
    two_over_one = r["ratios"]["fleet_2_over_fleet_1"]
    return {
        "move_p50_under_10_ms": None if move_p50 is None else move_p50 < MOVE_TARGET_MS,
        "two_daemons_serve_more": None if two_over_one is None else two_over_one > 1,
    }


# -- the report --------------------------------------------------------------------------------------------------------

_LABELS = {
    "sqlite": "sqlite: devd serve",
    "fleet-1": "fleet-1: 1 daemon, PostgreSQL",
    "fleet-2": "fleet-2: 2 daemons, 8+8 clients",
}


def _verdict(ok: bool | None) -> str:
    return {True: "MET", False: "NOT MET", None: "not measured"}[ok]


def _short(error: str) -> str:
    """A failed run's error in a line: a generator's own message rather than its traceback, without the daemons'
    output (kept whole in the JSON)."""
    said = error.rsplit("RuntimeError: ", 1)[-1] if "Traceback" in error else error
    said = said.split("'s output ends: ", 1)[0].rsplit("; ", 1)[0] if "'s output ends: " in said else said
    # Newlines, whether real or escaped in the JSON of an answer shown as bytes, would break the line.
    return said.replace("\\\\n", " ").replace("\\n", " ").replace("\n", " ")[:300]


def _ratio_text(r: dict[str, Any], key: str) -> str:
    value = r["ratios"][key]
    by_round = ", ".join("-" if x[key] is None else f"{x[key]:.2f}" for x in r["ratios_per_round"])
    return f"{'-' if value is None else f'{value:.2f}'} (by round: {by_round})"


def report(r: dict[str, Any]) -> str:
    pg = r["postgres"]
    out = [
        f"fleet: {r['clients']} clients in {r['generators']} generator processes, durable steps, {r['rounds']} rounds "
        f"of {r['seconds']:g} s alternated, medians; PostgreSQL {pg['version']} on loopback (fsync {pg['fsync']}, "
        f"synchronous_commit {pg['synchronous_commit']}); {r['event_loop']}, {r['cpus']} cpus",
        "",
        f"{'setup':<34}{'steps/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'daemons cpu':>13}{'generators cpu':>16}"
        f"{'other cpu':>11}",
    ]
    for setup in SETUPS:
        row = r["rows"][setup]
        if "error" in row:
            out.append(f"{_LABELS[setup]:<34}failed in every round")
            continue
        failed = f"  ({row['failed_rounds']} rounds failed)" if row.get("failed_rounds") else ""
        out.append(
            f"{_LABELS[setup]:<34}{row['steps_per_s']:>9,.0f}{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}"
            f"{row['server_cpu_share']:>13.2f}{row['generator_cpu_share']:>16.2f}{row['other_cpu_share']:>11.2f}"
            + failed
        )
    for setup in SETUPS:  # why a round failed, in its words: a daemon's error answer is a finding, not noise
        for n, run in enumerate(r["runs"][setup], 1):
            if "error" in run:
                out.append(f"  {setup}, round {n} failed: {_short(run['error'])}")
    out += [
        "",
        f"fleet-1 / sqlite:  {_ratio_text(r, 'fleet_1_over_sqlite')}",
        f"fleet-2 / fleet-1: {_ratio_text(r, 'fleet_2_over_fleet_1')}",
        "",
    ]
    m = r["move"]
    if "error" in m:
        out.append(f"session move: failed: {_short(m['error'])}")
    else:
        out += [
            f"session move: {m['sessions']} sessions of {m['turns']} seed turns on a, a drained ({m['drained']}), then "
            f"one step each on b",
            f"  move step (acquire + rebuild + step), ms: p50 {m['move']['p50_ms']}, p99 {m['move']['p99_ms']}",
            f"  baseline step, live on b, ms:             p50 {m['baseline']['p50_ms']}, p99 {m['baseline']['p99_ms']}",
            f"  move less baseline, paired, p50:          {m['move_minus_baseline_p50_ms']} ms",
            f"  b afterwards: {m['b_rebuilt']} rebuilt, errors {m['b_errors'] or 'none'}, owners {m['owners_after']}",
        ]
    t = r["targets"]
    out += [
        "",
        f"target: a session moves in under {MOVE_TARGET_MS:g} ms p50: {_verdict(t['move_p50_under_10_ms'])}",
        f"target: two daemons serve more steps/s than one: {_verdict(t['two_daemons_serve_more'])}",
    ]
    return "\n".join(out)


# -- the command line ----------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=4.0, help="each setup's measured window, per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=200, help="sessions moved in the move test")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def command(args: argparse.Namespace) -> int:
    """Exit 1 when a setup or the move test failed, else 0 (targets not met are reported, not failed)."""
    result = bench_fleet(args.seconds, args.rounds, args.sessions)
    if args.json:
        _write_stdout(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    else:
        print(report(result), flush=True)
    failed = any("error" in row or row.get("failed_rounds") for row in result["rows"].values())
    return 1 if failed or "error" in result["move"] else 0
