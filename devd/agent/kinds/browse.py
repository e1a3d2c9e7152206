"""Browse: fetch a web page, in the daemon (public addresses only, unless the profile allows private ones); a read,
enabled by listing "browse" in the profile's `tools`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from devd.agent.kinds.base import Context, Kind, Shown
from devd.messages import Browse
from devd.render import inline

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile


class BrowseKind(Kind[Browse]):
    member, struct, name, result, what = "Browse", Browse, "browse", "Browse", "page fetch"
    listed = True
    shape = '{"url": "https://..."}'
    schema = {
        "description": "Fetch a web page and return its text.",
        "parameters": {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "an http:// or https:// URL"}},
            "required": ["url"],
            "additionalProperties": False,
        },
    }

    def offered(self, profile: Profile, *, exec_available: bool) -> bool:
        return self.name in profile.tools

    def decide(self, profile: Profile, call: Browse) -> tuple[Decision, str]:
        if self.name in profile.tools:
            return "allow", f"agent {profile.name!r} lists browse in its tools"
        return "deny", f'denied by the policy: agent {profile.name!r} does not list "browse" in its tools'

    def subject(self, call: Browse) -> str | None:
        return call.url

    def line(self, call: Browse) -> str:
        return f"browse {inline(call.url)}"

    def summary(self, call: Browse) -> str:
        return inline(call.url)

    def shown(self, call: Browse) -> Shown:
        return Shown("fetch", inline(call.url), {"url": call.url})

    async def run(self, context: Context, call: Browse) -> tools.Result:
        from devd.agent import tools

        return await tools.browse(call.url, context.profile)


KIND = BrowseKind()
