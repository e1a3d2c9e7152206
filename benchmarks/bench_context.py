"""`python -m benchmarks.bench_context`: a long agent session against a model with a small context window, through
the real daemon and the stand-in model server.

The stand-in plays a server with an `--window`-token context (8,000 by default) that refuses, as OpenAI does, any
request whose prompt and limit pass it. The profile states that window (`context_tokens`), so the runtime measures
each request and compacts the conversation (a summary written by the model, then the core's Summary event) before it
would pass `compact_at`. Each turn the model reads a file of `--file-bytes` and then answers; a summary request is
answered with a summary of `--summary-chars`. Per window of turns it reports the largest and mean request (in the
stand-in's count: 4 characters of the messages' and tools' JSON a token), the largest with the limit sent, the
compactions, the requests past the window (there must be none: the stand-in refuses them), and the daemon's RSS at the
window's end.

It also times devd's measure of a request (`devd.agent.context.measure`) of about `compact_at` of the window,
against encoding the same request to JSON (what the driver does with it anyway), in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench import _proc_status, _write_stdout
from devd.agent import context, model
from devd.agent.profiles import Profile
from devd.messages import Agent, Call, Dispatch, Message, Read, Tool
from tests.agents import SECRET, agents_toml, run_turn
from tests.daemon import Daemon
from tests.standin_model import Scripted, Standin, limit_of, prompt_tokens

TURNS = 2000
WINDOW_TURNS = 250
CONTEXT_TOKENS = 8000
FILE_BYTES = 2048
SUMMARY_CHARS = 1200
MEASURE_ROUNDS = 2000


def bench_context(
    turns: int = TURNS,
    window: int = WINDOW_TURNS,
    context_tokens: int = CONTEXT_TOKENS,
    file_bytes: int = FILE_BYTES,
    summary_chars: int = SUMMARY_CHARS,
    measure_rounds: int = MEASURE_ROUNDS,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="devd-bench-context-") as tmp, Standin() as standin:
        root = Path(tmp)
        standin.context_tokens = context_tokens

        def reply(body: dict[str, Any]) -> Scripted:
            last = body["messages"][-1]
            if last.get("content") == context.SUMMARY_ASK:
                return Scripted(text="s" * summary_chars)
            if last["role"] == "user":
                return Scripted(tool_calls=[("read", {"path": "notes.txt"})])
            return Scripted(text="The notes say what they say. " * 8)

        workspace = root / "roots" / "ws"
        workspace.mkdir(parents=True)
        (workspace / "notes.txt").write_text("n" * file_bytes)
        agents = root / "agents.toml"
        keys = {"context_tokens": str(context_tokens), "sandbox": '"none"'}
        agents.write_text(agents_toml(standin.url, root / "roots", **keys))
        daemon = Daemon(root / "d", "--agents", str(agents), env={"DEVD_TEST_KEY": SECRET})
        rows: list[dict[str, Any]] = []
        standin.default = reply
        sizes: list[tuple[int, int, bool]] = []  # each request's prompt, limit, and whether it asked for a summary
        with daemon.start(), daemon.client() as c:
            assert daemon.proc is not None
            session = c.new(agent="coder", workspace=workspace)
            seen = 0
            for turn in range(1, turns + 1):
                run_turn(c, session, f"turn {turn}: read notes.txt and say what it says")
                sizes += [_size(r.body) for r in standin.requests]  # refused ones too
                standin.requests.clear()
                if turn % window == 0 or turn == turns:
                    fresh = sizes[seen:]
                    seen = len(sizes)
                    asks = [prompt for prompt, _, summary in fresh if not summary]
                    rows.append(
                        {
                            "turns": f"{turn - window + 1}-{turn}" if turn % window == 0 else f"-{turn}",
                            "requests": len(fresh),
                            "prompt_tokens_max": max(asks),
                            "prompt_tokens_mean": round(statistics.fmean(asks)),
                            "with_limit_max": max(prompt + limit for prompt, limit, _ in fresh),
                            "compactions": sum(1 for _, _, summary in fresh if summary),
                            "over_window": sum(1 for prompt, limit, _ in fresh if prompt + limit > context_tokens),
                            "rss_mib": round(_proc_status(daemon.proc.pid)["VmRSS"] / 1024, 1),
                        }
                    )
    return {
        "turns": turns,
        "context_tokens": context_tokens,
        "windows": rows,
        "over_window": sum(r["over_window"] for r in rows),
        "measure": _measure_cost(context_tokens, measure_rounds),
    }


def _size(body: dict[str, Any]) -> tuple[int, int, bool]:
    """A request's prompt and limit in the stand-in's count, and whether it asked for a summary."""
    return prompt_tokens(body), limit_of(body) or 0, body["messages"][-1].get("content") == context.SUMMARY_ASK


def _measure_cost(context_tokens: int, rounds: int) -> dict[str, Any]:
    """µs to measure a request of about 80% of the window, against JSON-encoding it, alternated in one run."""
    p = Profile(name="coder", base_url="http://127.0.0.1:9/v1", model="m", workspace_roots=("/",), system="Be careful.")
    messages: list[Message] = []
    n = 0
    while context.measure(model.request_body(p, messages)) < context_tokens * 0.8:
        n += 1
        call = Dispatch(id=2 * n, call=Call(Read=Read(path=f"f{n}.txt")))
        messages += [
            Message(User=f"read f{n}.txt"),
            Message(Agent=Agent(text="Reading.", calls=[call])),
            Message(Tool=Tool(id=2 * n, text="x" * 400)),
        ]
    body = model.request_body(p, messages)
    measured, encoded = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        context.measure(body)
        t1 = time.perf_counter()
        json.dumps(body, ensure_ascii=False).encode()
        t2 = time.perf_counter()
        measured.append((t1 - t0) * 1e6)
        encoded.append((t2 - t1) * 1e6)
    m, e = statistics.median(measured), statistics.median(encoded)
    return {
        "request_tokens": context.measure(body),
        "messages": len(messages),
        "measure_us_p50": round(m, 1),
        "encode_us_p50": round(e, 1),
        "ratio": round(m / e, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_context", description=__doc__)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--window-turns", type=int, default=WINDOW_TURNS)
    parser.add_argument("--window", type=int, default=CONTEXT_TOKENS, help="the model's context, in tokens")
    parser.add_argument("--file-bytes", type=int, default=FILE_BYTES)
    parser.add_argument("--summary-chars", type=int, default=SUMMARY_CHARS)
    args = parser.parse_args(argv)
    r = bench_context(args.turns, args.window_turns, args.window, args.file_bytes, args.summary_chars)
    _write_stdout(json.dumps(r, indent=2).encode() + b"\n")
    return 0 if r["over_window"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
