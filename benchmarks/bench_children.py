"""`python -m benchmarks.bench children`: what a child run (issue 34) costs the daemon, against the same work done
without one, in the same run.

A daemon with two profiles asking the stand-in model server (a process of its own, tests/standin_model.py, so run it
from a checkout): `lead`, which delegates to `worker`. Each round, alternated:

- **delegated**: a turn of `lead` whose model delegates one task to `worker` (the child made, linked both ways, its
  turn started and driven: one model call; its answer handed back as the call's result), then answers: timed from
  `session/prompt` to `session/wait`'s answer. Its **baseline** is the same model calls without a child: a turn of
  `lead` whose model reads a file instead (two model calls and a call between), plus a plain `worker` session's
  turn of one model call (`session/new`, `session/prompt`, `session/wait`). The overhead is the difference of the
  medians: what starting a child and handing its result back adds beyond the work itself.
- **spawned**: `session/spawn` of a `worker` child of an idle `lead` session, then `session/wait` for its turn,
  against `session/new` of a `worker` session, `session/prompt`, `session/wait` (the same one model call).

Then **fan-out**: one turn of `lead` whose one reply delegates `--children` tasks at once: the wall time from the
prompt to its end, whether every child ended `completed` (each asked with `session/wait`), against the same number
of plain `worker` sessions prompted at once from here and waited for.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LEAD, WORKER = "You are lead.", "You are worker."


def _reply(body: dict[str, Any]) -> Any:
    """The stand-in's answer: `lead` prompted `delegate N` delegates N tasks in one reply, `read 1` reads a.txt,
    then says `ok`; `worker` says `done`."""
    from tests.standin_model import Scripted

    messages = body["messages"]
    if messages[0]["content"] == WORKER:
        return Scripted(text="done", usage=(20, 2, 0))
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    verb, _, count = str(messages[last_user]["content"]).partition(" ")
    if any(m["role"] == "tool" for m in messages[last_user:]):
        return Scripted(text="ok", usage=(20, 2, 0))
    if verb == "delegate":
        calls = [("delegate", {"agent": "worker", "task": f"task {i}"}) for i in range(int(count))]
        return Scripted(tool_calls=calls, usage=(20, 2, 0))  # type: ignore[arg-type]
    if verb == "read":
        return Scripted(tool_calls=[("read", {"path": "a.txt"})], usage=(20, 2, 0))
    return Scripted(text="ok", usage=(20, 2, 0))


def _standin_main(url_file: str) -> None:
    from tests.standin_model import Standin

    with Standin() as standin:
        standin.script(*[_reply] * 1_000_000)
        Path(url_file).write_text(standin.url)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _start_standin(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    url_file = root / "standin.url"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_children", "_standin", str(url_file)])
    for _ in range(1500):
        if url_file.exists() and (url := url_file.read_text()):
            return proc, url
        if proc.poll() is not None:
            raise SystemExit("bench children needs the stand-in model server of a checkout (tests/standin_model.py)")
        time.sleep(0.02)
    raise TimeoutError("the stand-in model server did not start within 30 s")


def _agents(url: str, roots: Path) -> str:
    common = f'base_url = "{url}"\nmodel = "standin"\nworkspace_roots = ["{roots}"]\nsandbox = "none"\n'
    lead = f'[agent.lead]\n{common}system = "{LEAD}"\ndelegates = ["worker"]\n'
    return f'{lead}\n[agent.worker]\n{common}system = "{WORKER}"\n'


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def bench_children(rounds: int, children: int) -> dict[str, Any]:
    from benchmarks.bench import _wait_socket
    from devd.client import Client

    root = Path(tempfile.mkdtemp(prefix="devd-bench-children-"))
    workspace = root / "roots" / "ws"
    workspace.mkdir(parents=True)
    (workspace / "a.txt").write_text("hello\n")
    standin, url = _start_standin(root)
    times: dict[str, list[float]] = {k: [] for k in ("delegated", "read", "plain", "spawned", "new")}
    try:
        (root / "agents.toml").write_text(_agents(url, root / "roots"))
        sock, state = root / "devd.sock", root / "state"
        argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(state)]
        proc = subprocess.Popen([*argv, "--agents", str(root / "agents.toml"), "--log-level", "warning"])
        try:
            _wait_socket(sock, proc)
            with Client.connect(sock, timeout=600) as c:

                def turn(agent: str, prompt: str) -> float:
                    session = c.new(agent=agent, workspace=str(workspace))
                    started = time.perf_counter()
                    done = c.wait(session, c.prompt(session, prompt))
                    took = _ms(started)
                    if not done.done or done.outcome != "completed":
                        raise SystemExit(f"a turn of {agent} ({prompt!r}) ended {done.outcome}")
                    return took

                for r in range(rounds + 1):  # the first round warms up, and is not counted
                    measured = {
                        "delegated": turn("lead", "delegate 1"),
                        "read": turn("lead", "read 1"),
                        "plain": turn("worker", "do it"),
                    }
                    lead = c.new(agent="lead", workspace=str(workspace))
                    started = time.perf_counter()
                    spawned = c.spawn(lead, f"r{r}", "worker", "do it")
                    waited = c.wait(spawned.session, spawned.turn)
                    measured["spawned"] = _ms(started)
                    if waited.outcome != "completed":
                        raise SystemExit(f"a spawned child ended {waited.outcome}: {waited.why}")
                    started = time.perf_counter()
                    session = c.new(agent="worker", workspace=str(workspace))
                    c.wait(session, c.prompt(session, "do it"))
                    measured["new"] = _ms(started)
                    if r:
                        for k, v in measured.items():
                            times[k].append(v)
                fan = _fan_out(c, workspace, children)
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        standin.terminate()
        standin.wait(30)
    p = {k: statistics.median(v) for k, v in times.items()}
    baseline = p["read"] + p["plain"]
    return {
        "what": f"a child run against the same work without one, medians of {rounds} rounds; then {children} at once",
        "delegated_turn_ms_p50": _p50(times["delegated"]),
        "baseline_ms_p50": round(baseline, 2),
        "baseline_read_turn_ms_p50": _p50(times["read"]),
        "baseline_plain_turn_ms_p50": _p50(times["plain"]),
        "delegation_overhead_ms_p50": round(p["delegated"] - baseline, 2),
        "delegated_per_baseline": round(p["delegated"] / baseline, 2),
        "spawn_and_wait_ms_p50": _p50(times["spawned"]),
        "new_prompt_wait_ms_p50": _p50(times["new"]),
        "spawn_overhead_ms_p50": round(p["spawned"] - p["new"], 2),
        **fan,
    }


def _fan_out(c: Any, workspace: Path, children: int) -> dict[str, Any]:
    """One turn delegating `children` tasks at once, against as many plain sessions prompted at once."""
    lead = c.new(agent="lead", workspace=str(workspace))
    started = time.perf_counter()
    turn = c.prompt(lead, f"delegate {children}")
    ended = c.wait(lead, turn)
    wall = _ms(started)
    kids = c.info(lead).children or []
    states = [c.wait(kid, 1).outcome for kid in kids]
    completed = sum(s == "completed" for s in states)
    started = time.perf_counter()
    plain = [c.new(agent="worker", workspace=str(workspace)) for _ in range(children)]
    turns = [(s, c.prompt(s, "do it")) for s in plain]
    plain_done = sum(c.wait(s, t).outcome == "completed" for s, t in turns)
    plain_wall = _ms(started)
    if ended.outcome != "completed" or completed != children or plain_done != children:
        raise SystemExit(
            f"fan-out: the turn ended {ended.outcome}, {completed} of {len(kids)} children completed "
            f"({children} asked), {plain_done} plain sessions completed"
        )
    return {
        "fan_out_children": children,
        "fan_out_children_completed": completed,
        "fan_out_wall_ms": round(wall, 1),
        "fan_out_plain_sessions_wall_ms": round(plain_wall, 1),
        "fan_out_per_plain": round(wall / plain_wall, 2),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--children", type=int, default=100, help="children one turn delegates at once")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_standin"]:
        _standin_main(sys.argv[2])
