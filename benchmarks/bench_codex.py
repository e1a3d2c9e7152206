"""`python -m benchmarks.bench codex`: the same scripted turn through devd's runtime and through OpenAI's Codex
app-server (`@openai/codex` on npm: `npm install --prefix DIR @openai/codex@0.171`, then `--codex
DIR/node_modules/.bin/codex`), side by side, rounds alternated, medians.

The turn: the model asks to run `true`; the command runs; its output goes back; the model answers "done". Each side
has its own stand-in model in one process of its own (devd's speaks chat completions: `tests/standin_model.py`;
Codex's speaks the Responses API Codex uses, written here, its shell tool `exec_command`), answering at once. Timed
from the request that starts the turn (`session/prompt`, `turn/start`) to the notice that ends it (`Done`,
`turn/completed`), on a daemon or app-server that has served a turn already; a session's start (`session/new`,
`thread/start`) apart. devd runs the command under bubblewrap (`sandbox = "auto"`) and unconfined (`"none"`); Codex
under its own sandbox (`workspace-write`) and without it (`danger-full-access`), never asking for approval.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# -- Codex's stand-in: the Responses API, streamed --------------------------------------------------------------------


def _sse(kind: str, doc: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | doc)}\n\n".encode()


_USAGE = {
    "input_tokens": 10,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 5,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 15,
}


class _Responses(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        answered = any(item.get("type") == "function_call_output" for item in body.get("input", []))
        if answered:
            item: dict[str, Any] = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed"}
            item["content"] = [{"type": "output_text", "text": "done", "annotations": []}]
            events = _sse("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "delta": "done"})
        else:
            item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command"}
            item |= {"arguments": json.dumps({"cmd": "true"}), "status": "completed"}
            events = b""
        data = _sse("response.created", {"response": {"id": "resp_1"}}) + events
        data += _sse("response.output_item.done", {"output_index": 0, "item": item})
        data += _sse("response.completed", {"response": {"id": "resp_1", "usage": _USAGE}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _models_main(url_file: str) -> None:
    """`bench _codex_models FILE`: both stand-ins (devd's, answering `run 1` with an Exec of `true` then text;
    Codex's), their URLs written to FILE as JSON."""
    from benchmarks.bench import _agent_reply
    from tests.standin_model import Standin

    class Server(ThreadingHTTPServer):
        request_queue_size = 256
        daemon_threads = True

    responses = Server(("127.0.0.1", 0), _Responses)
    threading.Thread(target=responses.serve_forever, daemon=True).start()
    with Standin() as standin:
        standin.default = _agent_reply
        urls = {"devd": standin.url, "codex": f"http://127.0.0.1:{responses.server_address[1]}/v1"}
        Path(url_file).write_text(json.dumps(urls))
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


# -- the two sides ----------------------------------------------------------------------------------------------------


class _Codex:
    """A Codex app-server on stdio, driven over JSON-RPC."""

    def __init__(self, codex: str, url: str, root: Path) -> None:
        home = root / "codex-home"
        home.mkdir()
        provider = f'{{name="standin",base_url="{url}",wire_api="responses",env_key="STANDIN_KEY"}}'
        argv = [codex, "app-server", "-c", 'model_provider="standin"', "-c", f"model_providers.standin={provider}"]
        argv += ["-c", 'model="standin-model"']
        env = dict(os.environ, CODEX_HOME=str(home), STANDIN_KEY="unused")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        self.next_id = 0
        self.call("initialize", {"clientInfo": {"name": "bench", "version": "0"}})
        self._send({"jsonrpc": "2.0", "method": "initialized"})

    def _send(self, doc: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc).encode() + b"\n")
        self.proc.stdin.flush()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the Codex app-server exited")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        self._send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        while True:
            doc = self._line()
            if doc.get("id") == self.next_id and "method" not in doc:
                if "error" in doc:
                    raise RuntimeError(f"{method}: {doc['error']}")
                result: dict[str, Any] = doc["result"]
                return result

    def session(self, workspace: Path, sandbox: str) -> str:
        thread = self.call("thread/start", {"cwd": str(workspace), "approvalPolicy": "never", "sandbox": sandbox})
        return str(thread["thread"]["id"])

    def turn(self, thread: str) -> None:
        self.call("turn/start", {"threadId": thread, "input": [{"type": "text", "text": "run true"}]})
        while True:
            doc = self._line()
            if doc.get("method") == "turn/completed" and doc["params"]["threadId"] == thread:
                status = doc["params"]["turn"]["status"]
                if status != "completed":
                    raise RuntimeError(f"a Codex turn ended {status}: {json.dumps(doc)[:600]}")
                return

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


class _Devd:
    """devd serve with two agent profiles: `bwrap` (bubblewrap) and `none` (unconfined)."""

    def __init__(self, url: str, root: Path) -> None:
        from benchmarks.bench import _wait_socket
        from devd.client import Client

        agents = root / "agents.toml"
        roots = root / "roots"
        agents.write_text(
            "".join(
                f'[agent.{name}]\nbase_url = "{url}"\nmodel = "standin"\nworkspace_roots = ["{roots}"]\n'
                f'sandbox = "{mode}"\n'
                for name, mode in (("bwrap", "auto"), ("none", "none"))
            )
        )
        sock = root / "devd.sock"
        argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(root / "state")]
        self.proc = subprocess.Popen([*argv, "--agents", str(agents), "--log-level", "warning"])
        _wait_socket(sock, self.proc)
        self.client = Client.connect(sock, timeout=60)

    def session(self, workspace: Path, agent: str) -> str:
        session = self.client.new(agent=agent, workspace=str(workspace))
        self.client.call("session/watch", {"session": session})
        return session

    def turn(self, session: str) -> None:
        turn = self.client.prompt(session, "run 1")
        while True:
            notice = self.client.wait_notification(60)
            if notice.method == "session/stalled":
                raise RuntimeError(f"a devd turn stalled: {notice.params}")
            if notice.method == "session/actions" and any(
                a["op"].get("Done", {}).get("turn") == turn for a in notice.params["actions"]
            ):
                return

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - t0) * 1000, out


def bench_codex(codex: str, rounds: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-codex-", dir=Path.home()))  # not /tmp: the sandbox's is private
    url_file = root / "models.json"
    models = subprocess.Popen([sys.executable, "-m", "benchmarks.bench", "_codex_models", str(url_file)])
    sides: dict[str, Any] = {}
    try:
        while not (url_file.exists() and url_file.read_text()):
            time.sleep(0.02)
        urls = json.loads(url_file.read_text())
        workspace = root / "roots" / "ws"
        workspace.mkdir(parents=True)
        devd, cx = _Devd(urls["devd"], root), _Codex(codex, urls["codex"], root)
        sides = {"devd": devd, "codex": cx}
        setups: dict[str, tuple[Any, str]] = {
            "devd bwrap": (devd, "bwrap"),
            "devd none": (devd, "none"),
            "codex workspace-write": (cx, "workspace-write"),
            "codex danger-full-access": (cx, "danger-full-access"),
        }
        for side, mode in setups.values():  # a turn of each first: what a first turn loads is not timed
            side.turn(side.session(workspace, mode))
        turns: dict[str, list[float]] = {name: [] for name in setups}
        starts: dict[str, list[float]] = {name: [] for name in setups}
        for r in range(rounds):
            for name, (side, mode) in setups.items() if r % 2 == 0 else reversed(setups.items()):
                started, session = _timed(side.session, workspace, mode)
                starts[name].append(started)
                turns[name].append(_timed(side.turn, session)[0])
    finally:
        for side in sides.values():
            side.close()
        models.send_signal(signal.SIGTERM)
        models.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    turn_ms = {name: round(statistics.median(v), 2) for name, v in turns.items()}
    start_ms = {name: round(statistics.median(v), 2) for name, v in starts.items()}
    codex_p50 = turn_ms["codex workspace-write"]
    codex_free = turn_ms["codex danger-full-access"]
    return {
        "rounds": rounds,
        "turn_ms_p50": turn_ms,
        "session_start_ms_p50": start_ms,
        "devd_bwrap_per_codex_sandboxed": round(turn_ms["devd bwrap"] / codex_p50, 3),
        "devd_none_per_codex_sandboxed": round(turn_ms["devd none"] / codex_p50, 3),
        "devd_bwrap_per_codex_unsandboxed": round(turn_ms["devd bwrap"] / codex_free, 3),
        "devd_none_per_codex_unsandboxed": round(turn_ms["devd none"] / codex_free, 3),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codex", default=shutil.which("codex") or "codex", help="the codex program (@openai/codex)")
    p.add_argument("--rounds", type=int, default=20)


def main(args: argparse.Namespace) -> int:
    print(json.dumps(bench_codex(args.codex, args.rounds), indent=1))
    return 0
