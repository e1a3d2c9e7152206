"""Read: a text file (or a directory's listing) of the workspace; a read, always allowed, carried out again after a
restart."""

from __future__ import annotations

from typing import TYPE_CHECKING

from devd.agent.kinds.base import PATH, Context, Kind, Shown, nul_in_path, reached
from devd.messages import Read
from devd.render import inline

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile


class ReadKind(Kind[Read]):
    member, struct, name, result, what = "Read", Read, "read", "File", "read"
    shape = '{"path": "relative/path"}'
    schema = {
        "description": "Read a text file of the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": PATH},
            "required": ["path"],
            "additionalProperties": False,
        },
    }

    def decide(self, profile: Profile, call: Read) -> tuple[Decision, str]:
        refused = nul_in_path(call.path)
        return ("deny", refused) if refused is not None else ("allow", "reads are always allowed")

    def subject(self, call: Read) -> str | None:
        return call.path

    def line(self, call: Read) -> str:
        return f"read {inline(call.path)}"

    def summary(self, call: Read) -> str:
        return inline(call.path)

    def shown(self, call: Read) -> Shown:
        return Shown("read", inline(call.path), {"path": call.path}, path=call.path)

    async def run(self, context: Context, call: Read) -> tools.Result:
        from devd.agent import tools

        workspace = await reached(context)
        if isinstance(workspace, tools.Result):
            return workspace
        profile = context.profile
        return await tools.read_file(workspace, call.path, profile.output_bytes_max, profile=profile)


KIND = ReadKind()
