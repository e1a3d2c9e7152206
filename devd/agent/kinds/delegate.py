"""delegate: the model hands a task to another agent, run as a child session of its own (`devd.agent.children`).

A call is the core's generic `Tool` call named `delegate` (so the core needs nothing new): its input is
`{agent, task, context?, output_schema?, budget?}`. It is offered only to a profile with `delegates`; the profile's
`delegates` decide it (an agent not listed is denied, naming the rule); the limits (depth, children at once and per
turn, budget) are checked when it is carried out, and a call past one fails naming it, no child made. It is not
claimed as an effect: carrying it out again (after a restart) finds the child the first time made, by its name,
and waits for it again; the child's own effects are claimed in the child's session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec

from devd.agent.kinds.base import Context, Kind, Shown
from devd.messages import Call, ToolCall
from devd.render import inline

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile

NAME = "delegate"


class DelegateInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a delegation asks: the `agent` (one of the profile's `delegates`), its `task`, what it starts from
    (`context`: the task alone, or the delegating conversation so far), the JSON Schema its final answer must
    satisfy, and its own token `budget` (at most what the delegating session has left)."""

    agent: str
    task: str
    context: Literal["task", "fork"] = "task"
    output_schema: dict[str, Any] | None = None
    budget: int | None = None


_input = msgspec.json.Decoder(DelegateInput)


def read(call: ToolCall) -> DelegateInput | str:
    """The delegation a call asks for, or what is wrong with its input."""
    try:
        found = _input.decode(bytes(call.input))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return f"the arguments of delegate do not fit ({e}); delegate expects {KIND.shape}"
    if not found.agent or not found.task:
        return f"delegate needs an agent and a task; it expects {KIND.shape}"
    if found.budget is not None and found.budget < 1:
        return "delegate's budget is a number of tokens, at least 1"
    return found


class Delegate(Kind[ToolCall]):
    member, struct, name, result, what = "Tool", ToolCall, NAME, "Tool", "delegated run"
    arguments_type = DelegateInput
    narrowed = False  # the parent's own delegates do not bound its child's: depth and limits do (children)
    schema = {
        "description": (
            "Hand a task to another agent, which works on it in a session of its own (with the workspace of this "
            "session, never more than this session may do) and answers; its final answer is this call's result. "
            "Use it for work another agent is made for."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "agent": {"type": "string", "description": "the agent to delegate to"},
                "task": {"type": "string", "description": "what it is to do, with all it needs to know"},
                "context": {
                    "type": "string",
                    "enum": ["task", "fork"],
                    "description": "task: it starts with the task alone (default); fork: with this conversation too",
                },
                "output_schema": {"type": "object", "description": "a JSON Schema its final answer must satisfy"},
                "budget": {"type": "integer", "description": "tokens it may spend, at most what this session has"},
            },
            "required": ["agent", "task"],
        },
    }
    shape = '{"agent": "NAME", "task": "TEXT", "context"?: "task" | "fork", "output_schema"?: {...}, "budget"?: N}'

    def of(self, holder: Any) -> ToolCall | None:
        member: ToolCall | None = getattr(holder, self.member)
        return member if member is not None and member.name == NAME else None

    def offered(self, profile: Profile, *, exec_available: bool) -> bool:
        return bool(profile.delegates)

    def to_call(self, args: Any, text: str) -> Call:
        return Call(Tool=ToolCall(name=NAME, input=msgspec.Raw(text.encode())))

    def model_name(self, call: ToolCall) -> str:
        return NAME

    def arguments(self, call: ToolCall) -> str:
        return bytes(call.input).decode()

    def decide(self, profile: Profile, call: ToolCall) -> tuple[Decision, str]:
        found = read(call)
        if isinstance(found, str):
            return "deny", found
        if found.agent not in profile.delegates:
            allowed = ", ".join(profile.delegates) or "none"
            return "deny", (
                f"denied by the policy: agent {profile.name!r} may delegate only to the agents its delegates list "
                f"({allowed}), not to {found.agent!r}"
            )
        return "allow", f"agent {found.agent!r} is one of the delegates of agent {profile.name!r}"

    def subject(self, call: ToolCall) -> str | None:
        found = read(call)
        return None if isinstance(found, str) else found.agent

    def line(self, call: ToolCall) -> str:
        found = read(call)
        if isinstance(found, str):
            return f"delegate {inline(bytes(call.input).decode())}"
        return f"delegate to {inline(found.agent)}: {inline(found.task)}"

    def summary(self, call: ToolCall) -> str:
        found = read(call)
        return inline(NAME if isinstance(found, str) else found.agent)

    def shown(self, call: ToolCall) -> Shown:
        found = read(call)
        title = "delegate" if isinstance(found, str) else f"delegate to {inline(found.agent)}"
        return Shown("other", title, {"input": msgspec.json.decode(call.input)})

    async def run(self, context: Context, call: ToolCall) -> tools.Result:
        from devd.agent import tools

        found = read(call)
        if isinstance(found, str):
            return tools.Result(found, failed=True)
        if context.delegate is None:
            return tools.Result("delegation is not available in this daemon", failed=True)
        return await context.delegate(found)


KIND = Delegate()
