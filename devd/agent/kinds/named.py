"""Tool: a call of a tool the model names itself (`{"Tool": {"name", "input"}}`): the MCP tools of the session's
servers (`devd.agent.mcp`), named `SERVER__TOOL`. A call is an effect (claimed before it is sent, never sent twice);
the profile's server decides it (`decision`, a tool's own in `rules`), a session's own server's calls are asked
about; a name that is no MCP tool's is answered as failed at once, neither decided nor traced, never left waiting."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import msgspec

from devd.agent.kinds.base import Context, Kind, Shown, Subject
from devd.agent.mcp.names import model_name, server_of
from devd.messages import ToolCall
from devd.render import inline

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile


class NamedTool(msgspec.Struct, frozen=True):
    """A tool offered to the model by the name it calls it: its description and its input's JSON Schema."""

    name: str
    description: str
    parameters: dict[str, Any]


class Named(Kind[ToolCall]):
    member, struct, name, result, what = "Tool", ToolCall, "tool", "Tool", "tool call"
    effect = True

    def model_name(self, call: ToolCall) -> str:
        return call.name  # the model named it itself

    def arguments(self, call: ToolCall) -> str:
        return bytes(call.input).decode()  # its input, as the model wrote it

    def decide(self, profile: Profile, call: ToolCall) -> tuple[Decision, str]:
        server = server_of(call.name)
        found = next((s for s in profile.mcp if s.name == server), None)
        if found is None:
            if profile.session_mcp:
                return "ask", f"{call.name} is a tool of this session's own MCP server {server}: a person decides"
            return "deny", f"denied by the policy: agent {profile.name!r} has no MCP server {server}"
        decision: Decision = found.decision
        reason = f'the MCP server {found.name} of agent {profile.name!r} has decision = "{found.decision}"'
        for tool, ruled in found.rules:
            if model_name(found.name, tool) == call.name:
                decision, reason = (
                    ruled,
                    f'the MCP server {found.name} of agent {profile.name!r} rules {tool} "{ruled}"',
                )
        if decision == "deny":
            reason = f"denied by the policy: {reason}"
        return decision, reason

    def remembered(self, call: ToolCall) -> Subject | None:
        """The tool and a digest of its exact input (canonical JSON, members sorted): an "always" settles calls of
        this tool with these arguments, no others."""
        try:
            canonical = msgspec.json.encode(msgspec.json.decode(call.input), order="sorted")
        except msgspec.DecodeError:
            return None
        return "tool", (call.name, hashlib.sha256(canonical).hexdigest())

    def subject(self, call: ToolCall) -> str | None:
        return call.name

    def line(self, call: ToolCall) -> str:
        return f"tool {inline(call.name)} {inline(bytes(call.input).decode())}"

    def summary(self, call: ToolCall) -> str:
        return inline(call.name)

    def shown(self, call: ToolCall) -> Shown:
        return Shown("other", inline(call.name), {"input": msgspec.json.decode(call.input)}, asked=True)

    def answered(self, call: ToolCall) -> str | None:
        return None if server_of(call.name) is not None else f"no tool is named {call.name}"

    async def run(self, context: Context, call: ToolCall) -> tools.Result:
        from devd.agent import tools

        if context.named is None:
            return tools.Result(f"no tool is named {call.name}", failed=True)
        return await context.named(call.name, bytes(call.input))


KIND = Named()
