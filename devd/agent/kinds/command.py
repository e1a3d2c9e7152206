"""Exec: run a command in the workspace, under the profile's sandbox (an effect: claimed before it starts).

`Commands` is what Exec and Git share: the policy's rules decide the argv that runs (`profiles.decide_command`), a
decision may be remembered for the argv, and a cancelled one has its process group killed."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import msgspec

from devd.agent.kinds.base import ARGV, Context, Kind, Shown, Subject, reached
from devd.agent.profiles import decide_command
from devd.messages import Exec
from devd.render import argv

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile

C = TypeVar("C", bound=msgspec.Struct)


class Commands(Kind[C]):
    effect = True
    kills = True

    def words(self, call: C) -> list[str]:
        """The call's argv as given."""
        raise NotImplementedError

    def runs(self, call: C) -> list[str]:
        """The argv that runs."""
        return self.words(call)

    def offered(self, profile: Profile, *, exec_available: bool) -> bool:
        return profile.exec != "deny" and exec_available

    def decide(self, profile: Profile, call: C) -> tuple[Decision, str]:
        at = next((i for i, word in enumerate(self.words(call)) if "\0" in word), None)
        if at is not None:
            return "deny", (
                f"refused: argument {at} of the command holds a NUL character, which no program can be given (what "
                "ran would differ from what was asked); send the command without it"
            )
        return decide_command(profile, self.runs(call))

    def remembered(self, call: C) -> Subject | None:
        return "argv", tuple(self.runs(call))

    def prompt(self, action: int, call: C) -> str:
        return (
            f"allow action {action}? [y/N/a/p] (a: always, this exact command; p: always, also followed by "
            'more words not starting with "-") '
        )

    def line(self, call: C) -> str:
        return "$ " + argv(self.runs(call))

    def shown(self, call: C) -> Shown:
        return Shown("execute", argv(self.runs(call)), {"argv": self.words(call)}, asked=True)

    async def run(self, context: Context, call: C) -> tools.Result:
        from devd.agent import sandbox as sandboxes
        from devd.agent import tools

        workspace = await reached(context)
        if isinstance(workspace, tools.Result):
            return workspace
        confined = await context.sandbox()
        if isinstance(confined, sandboxes.Refusal):
            return tools.Result(confined.why, failed=True)
        return await tools.run_command(self.runs(call), workspace=workspace, profile=context.profile, sandbox=confined)


class Command(Commands[Exec]):
    member, struct, name, result, what = "Exec", Exec, "exec", "Exec", "command"
    shape = '{"argv": ["command", "arg", ...]}'
    schema = {
        "description": "Run a command in the workspace (no shell: argv[0] is the program). Returns its output.",
        "parameters": {
            "type": "object",
            "properties": {"argv": {**ARGV, "minItems": 1, "description": "the program and its arguments"}},
            "required": ["argv"],
            "additionalProperties": False,
        },
    }

    def words(self, call: Exec) -> list[str]:
        return call.argv

    def invalid(self, call: Exec) -> str | None:
        return None if call.argv else f"exec needs a program to run, argv is empty; exec expects {self.shape}"

    def subject(self, call: Exec) -> str | None:
        return call.argv[0] if call.argv else None

    def summary(self, call: Exec) -> str:
        return argv(call.argv)


KIND = Command()
