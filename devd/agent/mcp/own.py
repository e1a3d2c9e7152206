"""A session's own MCP servers (`session/new` and `session/mcp` `mcp_servers`, ACP's shape), checked against its
profile and made into the broker's configurations: allowed only where the profile has `session_mcp = true`, named as a
profile's servers are and never like one of them, stdio or Streamable HTTP (its headers' values given); their calls
are always asked about, and each is the session's alone (`share = "session"`). Their variables' and headers' values
are the session's, kept in memory only."""

from __future__ import annotations

from urllib.parse import urlsplit

from devd.agent.profiles import McpServer, Profile, server_name_problem, shown_url
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
        split = urlsplit(spec.url or "")
        if split.scheme not in ("http", "https") or not split.netloc or "@" in split.netloc:
            raise InvalidParamsError(
                f"MCP server {spec.name!r} has url {shown_url(spec.url or '')[:200]!r}, which is not an http:// or "
                "https:// URL without a user or password; give the server's Streamable HTTP endpoint"
            )
        if spec.command is not None or spec.env:
            raise InvalidParamsError(
                f"MCP server {spec.name!r} has a url (HTTP) and a command or env (stdio); give one or the other"
            )
        headers = {h.name: h.value for h in spec.headers}
        return McpServer(name=spec.name, url=spec.url, share="session", headers=tuple((h, h) for h in headers)), headers
    if spec.headers:
        raise InvalidParamsError(f"MCP server {spec.name!r} is a stdio server: headers are for an HTTP server's url")
    if not spec.command:
        raise InvalidParamsError(f"MCP server {spec.name!r} has neither a command (stdio) nor a url (HTTP)")
    env = {v.name: v.value for v in spec.env}
    server = McpServer(
        name=spec.name, command=(spec.command, *spec.args), share="session", env=tuple((k, k) for k in env)
    )
    return server, env
