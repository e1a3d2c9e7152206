"""A stand-in OpenAI-compatible chat-completions server, for tests and benchmarks.

A real HTTP server on 127.0.0.1 (a thread of its own: the worker is the point), speaking the real wire format:
`POST /v1/chat/completions` answered as server-sent events (`data:` chunks, tool-call fragments split over several
chunks, a usage chunk with `choices: []`, `data: [DONE]`) or as one JSON object when `stream` is false. It checks
each request the way the service does (400 with an OpenAI-shaped error body) and plays a script: a list of
`Scripted` replies (or functions of the request body giving one), one per request. It records every request, and
notices a client that closes a stream early.

    from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (the `standin` fixture)

    def test_x(standin: Standin) -> None:
        standin.script(Scripted(text="hello"), Scripted(status=500), Scripted(tool_calls=[("read", {"path": "a"})]))
        ... standin.url ...  # "http://127.0.0.1:PORT/v1"
        assert standin.count == 3
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Self

import pytest

NOTICE_WAIT_S = 30.0  # a held reply is released by its test well before this


@dataclass(frozen=True)
class Scripted:
    """One reply: `text` and/or `tool_calls` (each `(name, arguments)`; arguments a dict, or a str sent as it is),
    `usage` `(prompt, completion, cached)` (default: counted from the sizes), `delay_s` before each chunk, `split`
    characters of text per chunk; or an error `status` (with `message` and `retry_after`); or `hang`: send the head,
    the role chunk and the first fragment, then nothing until the client closes; or `held`: send `held_after` chunks
    (the role chunk is the first), then wait until the event is set before the rest; or `endless` (see there)."""

    text: str | None = None
    tool_calls: list[tuple[str, dict[str, Any] | str]] = field(default_factory=list)
    usage: tuple[int, int, int | None] | None = None
    delay_s: float = 0.0
    split: int = 3
    status: int | None = None
    message: str = "the stand-in was told to fail"
    retry_after: str | None = None
    hang: bool = False
    finish_reason: str | None = None  # default: tool_calls when there are calls, else stop
    model: str | None = None  # the answering model's name (default: the request's)
    whole: bool = False  # answer one JSON object even when the request asks for a stream (as some servers do)
    held: threading.Event | None = None
    held_after: int = 0
    cut_after: int | None = None  # send this many chunks, then close the connection before data: [DONE]
    # After the role chunk, until the client closes: "line", one data line that never ends; "chunks", content chunks
    # without data: [DONE]; "trickle", a one-character content chunk every `delay_s`.
    endless: Literal["line", "chunks", "trickle"] | None = None
    garbage: str | None = None  # a line sent as it is after the role chunk (a server that breaks the format)
    # (Content-Encoding, body): the answer (of `status`, else 200) is these bytes under that header, as sent (a bomb)
    encoded: tuple[str, bytes] | None = None
    ignores_limit: bool = False  # written whole past the request's token limit (a server that ignores max_tokens)
    reasoning: str | None = None  # streamed first as `reasoning_content` deltas (as DeepSeek, vLLM and llama.cpp do)


Responder = Scripted | Callable[[dict[str, Any]], Scripted]


@dataclass(frozen=True)
class Recorded:
    path: str
    headers: dict[str, str]  # names in lower case
    body: Any


def serve_page(h: BaseHTTPRequestHandler, pages: dict[str, str | bytes]) -> None:
    """Answer a GET from `pages`: a path's text, its bytes (as a PNG), a 302 to LOCATION for `redirect:LOCATION`, or
    404 for a path it does not hold."""
    page = pages.get(h.path)
    if isinstance(page, str) and page.startswith("redirect:"):
        h.send_response(302)
        h.send_header("Location", page.removeprefix("redirect:"))
        h.send_header("Content-Length", "0")
        h.end_headers()
        return
    data = page if isinstance(page, bytes) else (page if page is not None else f"no page {h.path}").encode()
    h.send_response(200 if page is not None else 404)
    h.send_header("Content-Type", "image/png" if isinstance(page, bytes) else "text/plain; charset=utf-8")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # not socketserver's 5: a burst of connections is not left to SYN retries (1, 3, 7 s)


class Served:
    """An HTTP server of `handler` on `address` (at a free port, `port`), run on a thread of its own from the start of
    a `with` to its end."""

    def __init__(self, address: str, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = _Server((address, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), name=name, daemon=True)
        self.port = self._server.server_address[1]

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class Standin(Served):
    """The server. `url` ends in /v1; `script(...)` queues replies; `requests` holds what came in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._script: list[Responder] = []
        self.requests: list[Recorded] = []
        self.closed_early = 0  # streams the client closed before the server had finished them
        self.closed = threading.Event()  # set at each early close
        self.sent_bytes = 0  # of streamed replies' bodies, all told
        self.pages: dict[str, str | bytes] = {}  # path -> page served on GET (for Browse): text, or bytes (a PNG)
        # Real servers' ways, off by default: a context window (prompt and limit, in the stand-in's tokens: 4
        # characters of the messages' and tools' JSON) refused past it as OpenAI does (400 context_length_exceeded)
        # or as llama.cpp's server does (200 and an empty stream); no usage in a stream (llama.cpp ignores
        # include_usage); the limit's name demanded (OpenAI's newer models refuse max_tokens) and its largest value.
        self.default: Responder | None = None  # the reply when the script has none left (a long benchmark's)
        self.context_tokens: int | None = None
        self.too_long: Literal["openai", "llamacpp"] = "openai"
        self.usage_in_stream = True
        self.token_param: Literal["max_tokens", "max_completion_tokens"] | None = None
        self.output_tokens_max: int | None = None
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                standin._serve(self)

            def do_GET(self) -> None:  # noqa: N802
                standin._page(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

        super().__init__("127.0.0.1", Handler, "standin-model")
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Responder) -> None:
        """Queue replies, one per request in order."""
        with self._lock:
            self._script.extend(replies)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def wait_closed(self, timeout_s: float = 10.0) -> bool:
        """Whether a client closed a stream early (waits up to timeout_s for it)."""
        return self.closed.wait(timeout_s)

    # -- serving ---------------------------------------------------------------------------------------------------

    def _page(self, h: BaseHTTPRequestHandler) -> None:
        serve_page(h, self.pages)

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length)
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        with self._lock:
            self.requests.append(Recorded(h.path, {k.lower(): v for k, v in h.headers.items()}, body))
        if h.path != "/v1/chat/completions":
            return _json(h, 404, _error(f"Unknown request URL: POST {h.path}.", "invalid_request_error"))
        problem = check_request(body) or self._refused(body)
        if problem is not None:
            return _json(h, 400, _error(problem, "invalid_request_error"))
        if self._too_long(body):
            if self.too_long == "llamacpp":  # its log says "Requested tokens (N) exceed context window of C"
                return self._empty(h)
            prompt, limit = prompt_tokens(body), limit_of(body) or 0
            message = (
                f"This model's maximum context length is {self.context_tokens} tokens. However, you requested "
                f"{prompt + limit} tokens ({prompt} in the messages, {limit} in the completion). Please reduce the "
                "length of the messages or completion."
            )
            return _json(h, 400, _error(message, "invalid_request_error", "messages", "context_length_exceeded"))
        with self._lock:
            responder = self._script.pop(0) if self._script else self.default
        if responder is None:
            return _json(h, 400, _error("the stand-in's script has no reply left for this request", "standin"))
        reply = within_limit(body, responder if isinstance(responder, Scripted) else responder(body))
        if reply.encoded is not None:
            return _encoded(h, reply.status or 200, *reply.encoded)
        if reply.status is not None:
            headers = {"Retry-After": reply.retry_after} if reply.retry_after else {}
            return _json(h, reply.status, _error(reply.message, "server_error"), headers)
        if not body.get("stream") or reply.whole:
            return _json(h, 200, _whole(body, reply))
        try:
            self._stream(h, body, reply)
        except (BrokenPipeError, ConnectionResetError):
            self._closed_early()

    def _refused(self, body: Any) -> str | None:
        """What OpenAI says of a token limit its model does not take: the wrong name, or a value past its most."""
        names = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}
        wrong = names.get(self.token_param or "")
        if wrong is not None and wrong in body:
            return (
                f"Unsupported parameter: '{wrong}' is not supported with this model. Use '{self.token_param}' instead."
            )
        limit = limit_of(body)
        if self.output_tokens_max is not None and limit is not None and limit > self.output_tokens_max:
            return (
                f"max_tokens is too large: {limit}. This model supports at most {self.output_tokens_max} completion "
                f"tokens, whereas you provided {limit}."
            )
        return None

    def _too_long(self, body: dict[str, Any]) -> bool:
        window = self.context_tokens
        if window is None:
            return False
        if self.too_long == "llamacpp":
            return prompt_tokens(body) > window
        return prompt_tokens(body) + (limit_of(body) or 0) > window

    def _empty(self, h: BaseHTTPRequestHandler) -> None:
        """llama.cpp's answer to a request past its context: 200, an event stream, and nothing in it."""
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

    def _stream(self, h: BaseHTTPRequestHandler, body: dict[str, Any], reply: Scripted) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        if reply.endless is not None:
            return self._endless(h, body, reply)
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and self.usage_in_stream
        for n, chunk in enumerate(_chunks(body, reply, usage)):
            if reply.hang and n == 2:  # after the role chunk and a first fragment
                return self._hang(h)
            if reply.cut_after is not None and n == reply.cut_after:
                return
            if reply.garbage is not None and n == 1:
                self._send(h, reply.garbage.encode() + b"\n\n")
            if reply.held is not None and n == reply.held_after:
                reply.held.wait(NOTICE_WAIT_S)
            if reply.delay_s:
                time.sleep(reply.delay_s)
            self._send(h, b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self._send(h, b"data: [DONE]\n\n")

    def _send(self, h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(data)
        h.wfile.flush()
        with self._lock:
            self.sent_bytes += len(data)

    def _endless(self, h: BaseHTTPRequestHandler, body: dict[str, Any], reply: Scripted) -> None:
        """Stream for ever (see `Scripted.endless`); a closed client ends it (BrokenPipeError), as does shutdown."""
        role = next(_chunks(body, reply, False))
        self._send(h, b"data: " + json.dumps(role).encode() + b"\n\n")
        text = {"line": "x" * 65536, "chunks": "x" * 1000, "trickle": "x"}[reply.endless or "chunks"]
        piece = json.dumps(role | {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
        if reply.endless == "line":
            self._send(h, b'data: {"choices":[{"index":0,"delta":{"content":"')
        while self._server.socket.fileno() >= 0:
            if reply.endless == "trickle":
                time.sleep(reply.delay_s)
            self._send(h, text.encode() if reply.endless == "line" else b"data: " + piece.encode() + b"\n\n")

    def _hang(self, h: BaseHTTPRequestHandler) -> None:
        """Send nothing more; return once the client has closed the connection."""
        sock: socket.socket = h.connection
        while True:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable and not sock.recv(1, socket.MSG_PEEK):
                return self._closed_early()
            if self._server.socket.fileno() < 0:  # the server is shutting down
                return

    def _closed_early(self) -> None:
        with self._lock:
            self.closed_early += 1
        self.closed.set()


def _json(h: BaseHTTPRequestHandler, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(doc).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        h.send_header(name, value)
    h.end_headers()
    h.wfile.write(data)


def _encoded(h: BaseHTTPRequestHandler, status: int, encoding: str, data: bytes) -> None:
    h.send_response(status)
    h.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
    h.send_header("Content-Encoding", encoding)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prompt_tokens(body: dict[str, Any]) -> int:
    """The stand-in's count of a request's prompt: 4 characters of its messages' and tools' JSON a token."""
    return len(json.dumps([body.get("messages"), body.get("tools")])) // 4


def limit_of(body: dict[str, Any]) -> int | None:
    """The request's token limit, under either name."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return limit if isinstance(limit, int) else None


def within_limit(body: dict[str, Any], reply: Scripted) -> Scripted:
    """The reply cut at the request's token limit (4 characters a token of text, then of each call's arguments),
    its finish_reason `length` when it was, as a server stops writing there."""
    limit = limit_of(body)
    if limit is None or reply.status is not None or reply.ignores_limit:
        return reply
    room = limit * 4
    text = reply.text or ""
    if len(text) > room:
        return replace(reply, text=text[:room], tool_calls=[], finish_reason="length")
    room -= len(text)
    calls: list[tuple[str, dict[str, Any] | str]] = []
    for name, arguments in reply.tool_calls:
        args = _arguments(arguments)
        if len(args) > room:
            return replace(reply, tool_calls=[*calls, (name, args[:room])], finish_reason="length")
        room -= len(args)
        calls.append((name, arguments))
    return reply


def check_request(body: Any) -> str | None:
    """What the service would refuse in this request (its words where known), or None."""
    if not isinstance(body, dict):
        return "We could not parse the JSON body of your request."
    if not isinstance(body.get("model"), str):
        return "you must provide a model parameter"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "Missing required parameter: 'messages'." if messages is None else "'messages' must be a non-empty array"
    if (problem := _check_tools(body.get("tools"))) is not None:
        return problem
    return _check_messages(messages)


def _check_tools(tools: Any) -> str | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "Invalid type for 'tools': expected an array."
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            return f"Invalid value for 'tools[{i}]': expected a function tool."
        if not isinstance(function.get("name"), str):
            return f"Missing required parameter: 'tools[{i}].function.name'."
        if not isinstance(function.get("parameters", {}), dict):
            return f"Invalid type for 'tools[{i}].function.parameters': expected an object."
    return None


def _check_messages(messages: list[Any]) -> str | None:
    awaiting: list[str] = []  # tool_call ids of the last assistant message not yet answered
    answerable: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool", "developer"):
            return f"Invalid value for 'messages[{i}].role': {json.dumps(role)}."
        if role != "tool" and awaiting:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(awaiting)}"
            )
        if role in ("system", "user", "developer") and not isinstance(m.get("content"), str | list):
            return f"Missing required parameter: 'messages[{i}].content'."
        if role == "assistant":
            problem = _check_assistant(i, m)
            if problem is not None:
                return problem
            awaiting = [c["id"] for c in m.get("tool_calls") or []]
            answerable = set(awaiting)
        elif role == "tool":
            if not isinstance(m.get("content"), str | list):
                return f"Missing required parameter: 'messages[{i}].content'."
            call = m.get("tool_call_id")
            if call not in answerable or call not in awaiting:
                return (
                    f"Invalid parameter: messages with role 'tool' must be a response to a preceeding message with "
                    f"'tool_calls'. (messages[{i}].tool_call_id = {json.dumps(call)})"
                )
            awaiting.remove(call)
        else:
            answerable = set()
    if awaiting:
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(awaiting)}"
        )
    return None


def _check_assistant(i: int, m: dict[str, Any]) -> str | None:
    calls = m.get("tool_calls")
    if calls is None:
        if not isinstance(m.get("content"), str | list):
            return f"Invalid value for 'messages[{i}].content': expected a string, got null."
        return None
    if not isinstance(calls, list) or not calls:
        return f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array with minimum length 1."
    for j, c in enumerate(calls):
        function = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(function, dict):
            return f"Missing required parameter: 'messages[{i}].tool_calls[{j}].id'."
        if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
            return f"Missing required parameter: 'messages[{i}].tool_calls[{j}].function.arguments'."
    return None


def _arguments(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _usage(body: dict[str, Any], reply: Scripted) -> dict[str, Any]:
    if reply.usage is not None:
        prompt, completion, cached = reply.usage
    else:
        prompt = len(json.dumps(body.get("messages"))) // 4
        completion = (len(reply.text or "") + sum(len(_arguments(a)) for _, a in reply.tool_calls)) // 4 + 1
        cached = None
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _finish(reply: Scripted) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _chunks(body: dict[str, Any], reply: Scripted, usage: bool) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed reply: a role chunk, text fragments, tool-call fragments, the finish, the usage."""
    head = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = reply.model or body["model"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    thought = reply.reasoning or ""
    for at in range(0, len(thought), max(reply.split, 1)):
        yield chunk({"reasoning_content": thought[at : at + max(reply.split, 1)]})
    text = reply.text or ""
    for at in range(0, len(text), max(reply.split, 1)):
        yield chunk({"content": text[at : at + max(reply.split, 1)]})
    for index, (name, arguments) in enumerate(reply.tool_calls):
        args = _arguments(arguments)
        third = max(len(args) // 3, 1)
        first = {"index": index, "id": f"call_standin_{index}", "type": "function"}
        yield chunk({"tool_calls": [first | {"function": {"name": name, "arguments": args[:third]}}]})
        for at in range(third, len(args), third):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": args[at : at + third]}}]})
    yield chunk({}, _finish(reply))
    if usage:
        yield head | {"choices": [], "usage": _usage(body, reply)}


def _whole(body: dict[str, Any], reply: Scripted) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_standin_{i}", "type": "function", "function": {"name": name, "arguments": _arguments(args)}}
            for i, (name, args) in enumerate(reply.tool_calls)
        ]
    return {
        "id": "chatcmpl-standin",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model or body["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply)}],
        "usage": _usage(body, reply),
    }


@pytest.fixture(name="standin")
def standin_fixture() -> Iterator[Standin]:
    """`standin`: a running stand-in model server, its url "http://127.0.0.1:PORT/v1". A test module imports
    `standin_fixture` and names its parameter `standin`."""
    with Standin() as server:
        yield server
