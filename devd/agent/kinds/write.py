"""Write: a text file of the workspace, whole; an effect (claimed before it starts), decided by the profile's
`write`, and a decision on it may be remembered for its path."""

from __future__ import annotations

from typing import TYPE_CHECKING

from devd.agent.kinds.base import LINE_CHARS_MAX, PATH, Context, Kind, Shown, Subject, nul_in_path, reached
from devd.messages import Write
from devd.render import brief, inline

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile


class WriteKind(Kind[Write]):
    member, struct, name, result, what = "Write", Write, "write", "File", "write"
    effect = True
    shape = '{"path": "relative/path", "text": "the whole new content"}'
    schema = {
        "description": "Write a text file of the workspace whole (created, or replaced), creating its directories.",
        "parameters": {
            "type": "object",
            "properties": {"path": PATH, "text": {"type": "string", "description": "the file's whole content"}},
            "required": ["path", "text"],
            "additionalProperties": False,
        },
    }

    def offered(self, profile: Profile, *, exec_available: bool) -> bool:
        return profile.write != "deny"

    def decide(self, profile: Profile, call: Write) -> tuple[Decision, str]:
        refused = nul_in_path(call.path)
        if refused is not None:
            return "deny", refused
        reason = f'agent {profile.name!r} has write = "{profile.write}"'
        return profile.write, f"denied by the policy: {reason}" if profile.write == "deny" else reason

    def remembered(self, call: Write) -> Subject | None:
        return "path", (call.path,)

    def prompt(self, action: int, call: Write) -> str:
        path = brief(inline(call.path), LINE_CHARS_MAX)
        return f"allow action {action}? [y/N/a] (a: always, writes to {path}) "

    def subject(self, call: Write) -> str | None:
        return call.path

    def line(self, call: Write) -> str:
        return f"write {inline(call.path)} ({len(call.text.encode(errors='surrogatepass'))} bytes)"

    def summary(self, call: Write) -> str:
        return f"{inline(call.path)} ({len(call.text)} characters)"

    def shown(self, call: Write) -> Shown:
        return Shown("edit", inline(call.path), {"path": call.path}, path=call.path, new_text=call.text, asked=True)

    async def run(self, context: Context, call: Write) -> tools.Result:
        from devd.agent import tools

        workspace = await reached(context)
        if isinstance(workspace, tools.Result):
            return workspace
        return await tools.write_file(workspace, call.path, call.text)


KIND = WriteKind()
