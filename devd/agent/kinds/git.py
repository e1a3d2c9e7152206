"""Git: run git in the workspace with the model's arguments (`git` itself is not theirs to choose); an effect, run
as a command (`devd.agent.kinds.command.Commands`)."""

from __future__ import annotations

from devd.agent.kinds.base import ARGV
from devd.agent.kinds.command import Commands
from devd.messages import Git
from devd.render import argv


class GitKind(Commands[Git]):
    member, struct, name, result, what = "Git", Git, "git", "Git", "git command"
    shape = '{"argv": ["status"]} (the arguments after "git")'
    schema = {
        "description": "Run git in the workspace with these arguments (without the leading 'git').",
        "parameters": {
            "type": "object",
            "properties": {"argv": {**ARGV, "description": "the arguments after git"}},
            "required": ["argv"],
            "additionalProperties": False,
        },
    }

    def words(self, call: Git) -> list[str]:
        return call.argv

    def runs(self, call: Git) -> list[str]:
        return ["git", *call.argv]

    def subject(self, call: Git) -> str | None:
        return f"git {call.argv[0]}" if call.argv else "git"

    def summary(self, call: Git) -> str:
        return argv(call.argv)


KIND = GitKind()
