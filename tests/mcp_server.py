"""A real MCP server for the tests, written with the official SDK's MCPServer (FastMCP of mcp 1.x): `python -m
tests.mcp_server [--http PORT]` serves over stdio (or Streamable HTTP on loopback). Its tools: echo, add, whoami (the
process's pid, uid, working directory and a variable), touch (writes a file in its working directory: an effect a
test can count), slow (sleeps, then writes; cancelled, it writes `cancelled`), picture (an image), big (N bytes of
text), boom (an error), readme (read-only by its hint), die (exits mid-call), relist (adds the tool `fresh` and says
its tool list changed), header (an HTTP request's header), exec (named like a built-in), careful (asks a person
first, with an elicitation: the legacy request, or 2026-07-28's `input_required` with a sealed `request_state`,
sealed under MCP_STATE_KEY when it is set, so that a process started again can read it; its body appends a line to
the file it names each time it runs), survey (asks two questions at once)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
import time
from typing import Annotated

import anyio
from mcp.server.elicitation import AcceptedElicitation, ElicitationResult
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp.server.request_state import RequestStateSecurity
from mcp_types import ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel

_KEY = os.environ.get("MCP_STATE_KEY")
server = MCPServer("devd-test", request_state_security=RequestStateSecurity(keys=[_KEY]) if _KEY else None)


@server.tool()
def echo(text: str) -> str:
    """Say text back."""
    return text


@server.tool()
def add(a: int, b: int) -> str:
    """a + b."""
    return str(a + b)


@server.tool()
def whoami() -> str:
    """The server's pid, uid, working directory, MCP_TEST_VALUE and whether it reaches the network."""
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=0.5).close()
        net = "net"
    except OSError:
        net = "nonet"
    return f"{os.getpid()} {os.getuid()} {os.getcwd()} {os.environ.get('MCP_TEST_VALUE', '-')} {net}"


@server.tool()
def touch(name: str) -> str:
    """Append a line to the file name in the working directory."""
    with open(name, "a") as f:
        f.write("touched\n")
    return f"touched {name}"


@server.tool()
async def slow(name: str, seconds: float) -> str:
    """Append `started` to name, sleep, then `finished` (or `cancelled` when cancelled)."""
    with open(name, "a") as f:
        f.write("started\n")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        with open(name, "a") as f:
            f.write("cancelled\n")
        raise
    with open(name, "a") as f:
        f.write("finished\n")
    return "slept"


@server.tool()
def picture() -> list[TextContent | ImageContent]:
    """A caption and a 12 KiB PNG."""
    data = base64.b64encode(b"\x89PNG" + b"\0" * (12 * 1024 - 4)).decode()
    return [TextContent(type="text", text="a picture:"), ImageContent(type="image", data=data, mime_type="image/png")]


@server.tool()
def big(size: int) -> str:
    """size bytes of x."""
    return "x" * size


@server.tool()
def boom() -> str:
    """Always fails."""
    from mcp.server.mcpserver.exceptions import ToolError

    raise ToolError("it went boom")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def readme() -> str:
    """Read-only by its hint."""
    return "read me"


@server.tool()
def header(name: str, ctx: Context) -> str:
    """The HTTP request's header name (`-` when there is none, or no HTTP)."""
    return (ctx.headers or {}).get(name.lower(), "-")


@server.tool()
async def relist(ctx: Context) -> str:
    """Add the tool `fresh` and tell the client its tool list changed."""
    server.add_tool(lambda: "fresh", name="fresh", description="added by relist")
    await ctx.session.send_tool_list_changed()  # the handshake era's notification
    await ctx.notify_tools_changed()  # the 2026-07-28 revision's, to subscriptions/listen
    return "relisted"


@server.tool()
def exec(argv: list[str]) -> str:
    """Named like devd's built-in exec; runs nothing."""
    return "the server's exec ran nothing"


@server.tool()
def die() -> str:
    """Exit the process mid-call, saying why on stderr."""
    print("fatal: the test server was told to die", file=sys.stderr, flush=True)
    os._exit(3)


class Confirm(BaseModel):
    ok: bool
    note: str = ""


def confirmation(name: str) -> Elicit[Confirm]:
    return Elicit(f"May I write {name}?", Confirm)


@server.tool()
def careful(name: str, confirm: Annotated[ElicitationResult[Confirm], Resolve(confirmation)]) -> str:
    """Ask whether to write name; write it (a line appended) only when the answer says ok."""
    if not isinstance(confirm, AcceptedElicitation):
        return f"not written: the question was {confirm.action}d"
    if not confirm.data.ok:
        return "not written: the answer was no"
    with open(name, "a") as f:
        f.write(f"written {confirm.data.note}\n")
    return f"wrote {name} ({confirm.data.note})"


class Name(BaseModel):
    name: str


class Color(BaseModel):
    color: str


def who() -> Elicit[Name]:
    return Elicit("Who are you?", Name)


def which() -> Elicit[Color]:
    return Elicit("Which color?", Color)


@server.tool()
def survey(name: Annotated[Name, Resolve(who)], color: Annotated[Color, Resolve(which)]) -> str:
    """Ask two questions at once (one round of the 2026-07-28 revision), and say both answers."""
    return f"{name.name} likes {color.color}"


def garbage(port: int) -> None:
    """An HTTP server on loopback that answers every request 200, `application/json`, with what is not JSON."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            body = b"this is not JSON-RPC"
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_DELETE = do_POST

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def mute(port: int) -> None:
    """A Streamable HTTP server of the handshake era, written by hand, that leaves `server/discover` unanswered (as
    some do with a method they do not know) and answers initialize, tools/list and an `echo` call in JSON."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    echo = {"name": "echo", "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
            if "id" not in asked:
                self.send_response(202)
                self.end_headers()
                return
            if asked["method"] == "server/discover":
                time.sleep(3600)
            if asked["method"] == "initialize":
                info = {"name": "mute", "version": "1"}
                result = {"protocolVersion": asked["params"]["protocolVersion"], "capabilities": {"tools": {}}}
                result |= {"serverInfo": info}
            elif asked["method"] == "tools/list":
                result = {"tools": [echo]}
            else:
                result = {"content": [{"type": "text", "text": asked["params"]["arguments"]["text"]}]}
            body = json.dumps({"jsonrpc": "2.0", "id": asked["id"], "result": result}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.send_response(405)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def listed_twice() -> None:
    """A server written by hand that lists two tools of one name, `dup`, each answering with its place."""
    tools = [{"name": "dup", "description": f"dup #{i}", "inputSchema": {"type": "object"}} for i in (1, 2)]
    for line in sys.stdin:
        asked = json.loads(line)
        if "id" not in asked:
            continue  # a notification
        if asked["method"] == "initialize":
            info = {"name": "twice", "version": "1"}
            result = {"protocolVersion": asked["params"]["protocolVersion"], "capabilities": {"tools": {}}}
            result |= {"serverInfo": info}
        elif asked["method"] == "tools/list":
            result = {"tools": tools}
        else:
            result = {"content": [{"type": "text", "text": "the first dup"}]}
        print(json.dumps({"jsonrpc": "2.0", "id": asked["id"], "result": result}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--tools", type=int, default=0, help="add this many more tools, t0..tN")
    parser.add_argument("--hang", action="store_true", help="never finish the handshake")
    parser.add_argument("--malformed", action="store_true", help="answer initialize with what JSON-RPC forbids")
    parser.add_argument(
        "--garbage", action="store_true", help="with --http: answer every request with what is not JSON"
    )
    parser.add_argument(
        "--mute",
        action="store_true",
        help="with --http: a server of the handshake era, by hand, that never answers server/discover",
    )
    parser.add_argument("--twice", action="store_true", help="list the tool `dup` twice (by hand: the SDK will not)")
    args = parser.parse_args()
    if args.malformed:  # valid JSON, but a response with neither result nor error, then one of no request's id
        asked = json.loads(sys.stdin.readline())
        print(json.dumps({"jsonrpc": "2.0", "id": asked["id"], "bogus": True}), flush=True)
        print(json.dumps({"jsonrpc": "2.0", "id": 9999, "result": {}}), flush=True)
        time.sleep(3600)
    if args.garbage:
        garbage(args.http)
        return
    if args.mute:
        mute(args.http)
        return
    if args.twice:
        listed_twice()
        return
    for i in range(args.tools):
        server.add_tool(lambda: "x", name=f"t{i}", description="one of many")
    if args.hang:
        time.sleep(3600)
    if args.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
