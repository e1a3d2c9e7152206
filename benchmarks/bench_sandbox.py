"""`python -m benchmarks.bench sandbox`: what a command's confinement costs, per command, against an unconfined one.

Each side runs `true` `runs` times in a row in a fresh workspace through the agent runtime's own `run_command` (the
workspace pinned and checked, the output read, the process group reaped) and takes the median; sides alternate round
by round, and the figure is the median over rounds, and each as a ratio of the baseline measured in the same rounds:
`true` started by anyio with nothing around it (the least a tool call that runs a program can cost). The sides:
`bwrap` (the default sandbox: bubblewrap with its seccomp filter, and under a root daemon an unprivileged user, limits,
a read-only /proc/sys and, on cgroup v1, a memory and a pids cgroup of its own) and `none` (its own pid namespace, the
same user, limits and cgroups). Run it as the daemon runs (as root, it
measures what a root daemon's commands pay).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from devd.agent import sandbox, tools
from devd.agent.profiles import Profile, SandboxMode


def _profile(root: Path, mode: SandboxMode) -> Profile:
    return Profile(
        name="bench", base_url="http://127.0.0.1:9/v1", model="m", workspace_roots=(str(root),), sandbox=mode
    )


async def _bare(workspace: Path) -> None:
    await anyio.run_process(["true"], cwd=workspace)


def _confined(root: Path, mode: SandboxMode) -> Callable[[Path], Awaitable[None]]:
    profile = _profile(root, mode)
    box = sandbox.choose(profile)
    if isinstance(box, sandbox.Refusal):
        raise SystemExit(f"the {mode} side cannot run here: {box.why}")

    async def run(workspace: Path) -> None:
        result = await tools.run_command(["true"], workspace=workspace, profile=profile, sandbox=box)
        if result.failed:
            raise SystemExit(f"the {mode} side failed: {result.text}")

    return run


async def _median_ms(run: Callable[[Path], Awaitable[None]], workspace: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        await run(workspace)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def bench_sandbox(rounds: int, runs: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-sandbox-"))
    sides = {"unconfined true": _bare, "bwrap": _confined(root, "bwrap"), "none": _confined(root, "none")}
    times: dict[str, list[float]] = {side: [] for side in sides}

    async def measure() -> None:
        for r in range(rounds):
            for side, run in sides.items():
                workspace = root / f"{side.replace(' ', '-')}-{r}"
                workspace.mkdir()
                times[side].append(await _median_ms(run, workspace, runs))

    anyio.run(measure)
    medians = {side: statistics.median(t) for side, t in times.items()}
    base = medians["unconfined true"]
    return {
        "what": f"`true` per command, median of {runs} runs a round, {rounds} rounds alternated",
        "ms": {side: round(m, 2) for side, m in medians.items()},
        "ratio_to_unconfined": {side: round(m / base, 2) for side, m in medians.items()},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=40)
