"""A session's own MCP servers (`session/new` and `session/mcp` `mcp_servers`, ACP's shape), checked against its
profile and made into the broker's configurations: allowed only where the profile has `session_mcp = true`, named as a
profile's servers are and never like one of them, stdio only (HTTP is refused, saying so); their calls are always
asked about, and each is the session's alone (`share = "session"`). Their variables' values are the session's, kept
in memory only."""

from __future__ import annotations

from devd.agent.profiles import McpServer, Profile, server_name_problem
from devd.errors import InvalidParamsError
from devd.protocol import SessionMcpServer

SESSION_MCP_REFUSED = "does not take a session's own MCP servers"  # in the refusal: the ACP bridge looks for it
SERVERS_MAX = 32


def own_servers(profile: Profile, given: list[SessionMcpServer]) -> tuple[tuple[McpServer, dict[str, str]], ...]:
    """The session's servers with their variables' values; InvalidParamsError naming what is wrong."""
    if not given:
        return ()
    if not profile.session_mcp:
        raise InvalidParamsError(
            f"agent {profile.name!r} {SESSION_MCP_REFUSED} (it has no session_mcp = true); leave out mcp_servers, or "
            "set session_mcp = true in its profile"
        )
    if len(given) > SERVERS_MAX:
        raise InvalidParamsError(f"a session brings at most {SERVERS_MAX} MCP servers, not {len(given)}")
    made: list[tuple[McpServer, dict[str, str]]] = []
    names = {s.name for s in profile.mcp}
    for spec in given:
        why = server_name_problem(spec.name)
        if why is not None:
            raise InvalidParamsError(f"MCP server {spec.name[:64]!r}: {why}; rename it")
        if spec.name in names:
            raise InvalidParamsError(
                f"MCP server {spec.name!r} is named like another of this session's (or its profile's); rename it"
            )
        names.add(spec.name)
        made.append(_server(spec))
    return tuple(made)


def _server(spec: SessionMcpServer) -> tuple[McpServer, dict[str, str]]:
    if spec.type == "http" or spec.url is not None:
        raise InvalidParamsError(
            f"MCP server {spec.name!r} is a Streamable HTTP server, which devd does not connect to yet; give it as a "
            "stdio server (command, args, env)"
        )
    if not spec.command:
        raise InvalidParamsError(f"MCP server {spec.name!r} has neither a command (stdio) nor a url (HTTP)")
    env = {v.name: v.value for v in spec.env}
    server = McpServer(
        name=spec.name, command=(spec.command, *spec.args), share="session", env=tuple((k, k) for k in env)
    )
    return server, env
