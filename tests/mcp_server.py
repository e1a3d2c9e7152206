"""A real MCP server for the tests, written with the official SDK's MCPServer (FastMCP of mcp 1.x): `python -m
tests.mcp_server [--http PORT]` serves over stdio (or Streamable HTTP on loopback). Its tools: echo, add, whoami (the
process's pid, uid, working directory and a variable), touch (writes a file in its working directory: an effect a
test can count), slow (sleeps, then writes; cancelled, it writes `cancelled`), picture (an image), big (N bytes of
text), boom (an error), readme (read-only by its hint), die (exits mid-call), relist (changes its tool list), careful
(asks a person first, with an elicitation: the legacy request, or 2026-07-28's `input_required` with a sealed
`request_state`, sealed under MCP_STATE_KEY when it is set, so that a process started again can read it; its body
appends a line to the file it names each time it runs), survey (asks two questions at once)."""

from __future__ import annotations

import argparse
import base64
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
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
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
async def relist(ctx: Context) -> str:
    """Add the tool `added`, and tell the client the tool list changed (as its protocol tells it)."""
    server.add_tool(lambda: "added", name="added", description="a tool relist added")
    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        await ctx.notify_tools_changed()  # to its subscriptions/listen streams
    else:
        await ctx.request_context.session.send_tool_list_changed()
    return "relisted"


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--tools", type=int, default=0, help="add this many more tools, t0..tN")
    parser.add_argument("--hang", action="store_true", help="never finish the handshake")
    args = parser.parse_args()
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
