"""Tool: a call of a tool the model names itself (`{"Tool": {"name", "input"}}`). No tool answers to a name yet, so
such a call is answered as failed at once, neither decided by the policy nor traced, never left waiting."""

from __future__ import annotations

import msgspec

from devd.agent.kinds.base import Kind, Shown
from devd.messages import ToolCall
from devd.render import inline


class Named(Kind[ToolCall]):
    member, struct, name, result, what = "Tool", ToolCall, "tool", "Tool", "tool call"
    gated = False

    def model_name(self, call: ToolCall) -> str:
        return call.name  # the model named it itself

    def arguments(self, call: ToolCall) -> str:
        return bytes(call.input).decode()  # its input, as the model wrote it

    def line(self, call: ToolCall) -> str:
        return f"tool {inline(call.name)}"

    def summary(self, call: ToolCall) -> str:
        return inline(call.name)

    def shown(self, call: ToolCall) -> Shown:
        return Shown("other", inline(call.name), {"input": msgspec.json.decode(call.input)})

    def answered(self, call: ToolCall) -> str | None:
        return f"no tool is named {call.name}"


KIND = Named()
