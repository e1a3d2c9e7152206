"""`python -m benchmarks.bench mcp`: what the MCP broker costs per call, against the server's own time, and how many
server processes N sessions of a profile use.

The broker side calls the test server's `echo` (tests/mcp_server.py, the official SDK's MCPServer) through
`Broker.call` as the runner does: the session's table looked up, the input read, the request handed to the
connection's supervisor task over its memory stream, the SDK's call, the result made text. The baseline is the SDK's
own client (`ClientSession` over its `stdio_client`) calling the same server, started unconfined: the server's own
time plus the least a client adds. Sides alternate round by round; each figure is the median over rounds of each
round's median. The broker's server runs under the profile's sandbox (bubblewrap, as the daemon runs it), which
costs at its start, not per call. The same pair over Streamable HTTP: the test server started with `--http` on
loopback, called through the broker's connection to it (`url = ...`), against the SDK's own client
(`streamable_http_client`, `server/discover`). Then N sessions are offered the tools (the server started at first
need): the figure is the server processes running after (the target: one per configuration).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from devd.agent import sandbox as sandboxes
from devd.agent import tools
from devd.agent.profiles import McpServer, Profile
from tests.mcp_place import PYTHON, placed  # the server where the sandbox's user reaches it


def _profile(root: Path, url: str) -> Profile:
    server = McpServer(name="demo", command=(PYTHON, str(placed().server)), env=(("PYTHONPATH", "BENCH_MCP_PATH"),))
    web = McpServer(name="web", url=url)
    return Profile(
        name="bench", base_url="http://127.0.0.1:9/v1", model="m", workspace_roots=(str(root),), mcp=(server, web)
    )


def bench_mcp(rounds: int, calls: int, sessions: int) -> dict[str, Any]:
    # The SDK (and the broker, which loads it) are imported here: `bench --help` need not pay for them.
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    from devd.agent.mcp.broker import Broker
    from tests.mcp_http import sdk_server

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is the figures' JSON
    root = Path(tempfile.mkdtemp(prefix="devd-bench-mcp-"))
    web = contextlib.ExitStack()
    url = web.enter_context(sdk_server())
    profile = _profile(root, url)
    workspace = tools.Workspace(root, tools.pin(root))
    box = sandboxes.choose(profile)
    broker = Broker({"BENCH_MCP_PATH": placed().site})
    times: dict[str, list[float]] = {"sdk client": [], "broker": [], "sdk client (http)": [], "broker (http)": []}
    result: dict[str, Any] = {}

    async def ws() -> tools.Workspace:
        return workspace

    async def sb() -> sandboxes.Sandbox | sandboxes.Refusal | None:
        return box

    async def measure() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(broker.run)
            await broker.offered("s0", profile, ws, sb)
            params = StdioServerParameters(
                command=sys.executable, args=[str(placed().server)], env={"PYTHONPATH": placed().site}
            )
            with open(os.devnull, "w") as quiet:
                async with stdio_client(params, errlog=quiet) as (read, write), ClientSession(read, write) as bare:
                    await bare.initialize()
                    for _ in range(rounds):
                        times["sdk client"].append(
                            await _median_ms(lambda: bare.call_tool("echo", {"text": "x"}), calls)
                        )
                        times["broker"].append(
                            await _median_ms(
                                lambda: broker.call("s0", profile, ws, sb, "demo__echo", b'{"text": "x"}'), calls
                            )
                        )
            async with streamable_http_client(url) as (read, write), ClientSession(read, write) as bare:
                await bare.discover()
                for _ in range(rounds):
                    times["sdk client (http)"].append(
                        await _median_ms(lambda: bare.call_tool("echo", {"text": "x"}), calls)
                    )
                    times["broker (http)"].append(
                        await _median_ms(
                            lambda: broker.call("s0", profile, ws, sb, "web__echo", b'{"text": "x"}'), calls
                        )
                    )
            for n in range(1, sessions):
                await broker.offered(f"s{n}", profile, ws, sb)
            result["processes"] = broker.processes()
            result["sessions"] = broker.statuses()[0].sessions
            tg.cancel_scope.cancel()

    with web:
        anyio.run(measure)
    medians = {side: statistics.median(t) for side, t in times.items()}
    return {
        "what": f"echo per call, median of {calls} calls a round, {rounds} rounds alternated; then {sessions} sessions",
        "ms": {side: round(m, 3) for side, m in medians.items()},
        "broker_overhead_ms": round(medians["broker"] - medians["sdk client"], 3),
        "ratio_to_sdk_client": round(medians["broker"] / medians["sdk client"], 2),
        "broker_overhead_ms_http": round(medians["broker (http)"] - medians["sdk client (http)"], 3),
        "ratio_to_sdk_client_http": round(medians["broker (http)"] / medians["sdk client (http)"], 2),
        "server_processes": result["processes"],
        "sessions": result["sessions"],
    }


async def _median_ms(call: Any, calls: int) -> float:
    spent = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--sessions", type=int, default=50)
