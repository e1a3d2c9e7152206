"""What a kind of tool call is: the one class every kind's module fills in (`devd.agent.kinds` holds the table).

A kind says everything devd does with its calls, so that nothing else spells kinds out: its name and schema for the
model, whether it is an effect (claimed before it starts, never run twice) or a read, how the profile's policy decides
it, what the trace, `devd run`/`devd attach`, `devd inspect` and an ACP editor show of it, how it is carried out and
which event steps its result. This module and the kinds' modules load no part of the runtime at import (the tools are
imported when a call is carried out): `devd inspect` and the ACP bridge show calls without loading it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from devd.messages import Event, Output

if TYPE_CHECKING:
    from devd.agent import sandbox as sandboxes
    from devd.agent import tools
    from devd.agent.profiles import Decision, Profile

M = TypeVar("M", bound=msgspec.Struct)

LINE_CHARS_MAX = 1000  # of a command, path, URL or reason shown (13 rows of 80 columns); a longer one is shortened

AcpKind = Literal["read", "edit", "delete", "move", "search", "execute", "think", "fetch", "other"]
Subject = tuple[Literal["argv", "path", "tool"], tuple[str, ...]]  # a tool's: (its name, its input's digest)


class Shown(msgspec.Struct, frozen=True):
    """A call as an ACP editor is shown it: its tool kind and title, the workspace path it is about (its location),
    its raw input, a write's new text (for its diff), and whether a client may be asked about it."""

    kind: AcpKind
    title: str
    raw_input: dict[str, Any]
    path: str | None = None
    new_text: str | None = None
    asked: bool = False


class Context:
    """What carrying out a call may reach: the profile, (when asked for) the session's workspace and the profile's
    sandbox, and `named`, which carries out a call of a tool named at run time (the session's MCP tools); the runner
    hands one in."""

    def __init__(
        self,
        profile: Profile,
        workspace: Callable[[], Awaitable[tools.Workspace]],
        sandbox: Callable[[], Awaitable[sandboxes.Sandbox | sandboxes.Refusal | None]],
        named: Callable[[str, bytes], Awaitable[tools.Result]] | None = None,
    ) -> None:
        self.profile, self.workspace, self.sandbox, self.named = profile, workspace, sandbox, named


class Kind(Generic[M]):
    """One kind of call. `member` is its member of the core's `Call` and `Op` (and `struct` that member's type);
    `name` the tool's name for the model, and the kind a trace record and a claim name; `result` the `Event` member
    that steps its result; `effect`: it changes something, so it is claimed durably before it starts and never run
    twice; `what` names one in words ("command"); `kills`: a cancelled one has its process group killed; `listed`: a
    profile enables it by naming it in `tools`; `schema` (description and parameters) and `shape` (its arguments in
    words) are what the model is told; None: it is not offered by this name."""

    member: str
    struct: type[M]
    name: str
    result: str
    what: str
    effect: bool = False
    kills: bool = False
    listed: bool = False
    schema: dict[str, Any] | None = None
    shape: str = ""

    def of(self, holder: Any) -> M | None:
        """This kind's member of a Call or an Op, or None."""
        member: M | None = getattr(holder, self.member)
        return member

    def event(self, action: int, text: str, failed: bool) -> Event:
        """The event that steps a result of this kind under the action's id."""
        output: Any = Output(id=action, text=text, failed=failed)  # Event's members are of several types
        return Event(**{self.result: output})

    # -- the model ------------------------------------------------------------------------------------------------

    def offered(self, profile: Profile, *, exec_available: bool) -> bool:
        """Whether the model is offered this tool."""
        return self.schema is not None

    def invalid(self, call: M) -> str | None:
        """What is wrong with a call of the right shape that the core should still not be given, or None."""
        return None

    def model_name(self, call: M) -> str:
        """The tool's name in the model's transcript."""
        return self.name

    def arguments(self, call: M) -> str:
        """The call's arguments as the JSON text of a tool call."""
        return msgspec.json.encode(call).decode()

    # -- the policy -----------------------------------------------------------------------------------------------

    gated: bool = True  # the policy decides it (else it is answered at once: `answered`)

    def decide(self, profile: Profile, call: M) -> tuple[Decision, str]:
        """Whether the profile lets the call run, and why in words the model is shown."""
        raise NotImplementedError

    def remembered(self, call: M) -> Subject | None:
        """What a remembered decision on it is about (an argv or a path), or None: a decision on it is not kept."""
        return None

    def prompt(self, action: int, call: M) -> str:
        """The question `devd run` asks a person about it."""
        return f"allow action {action}? [y/N] "

    # -- what is shown --------------------------------------------------------------------------------------------

    def subject(self, call: M) -> str | None:
        """What a run is about, for its trace record (never content: a command's program, a path, a URL)."""
        return None

    def line(self, call: M) -> str:
        """The call as `devd run` and `devd attach` show it, whole (the caller shortens it)."""
        raise NotImplementedError

    def summary(self, call: M) -> str:
        """What the call is about, as `devd inspect` shows it after its member (the caller shortens it)."""
        raise NotImplementedError

    def shown(self, call: M) -> Shown:
        """The call as an ACP editor is shown it."""
        raise NotImplementedError

    # -- carrying it out ------------------------------------------------------------------------------------------

    def answered(self, call: M) -> str | None:
        """Why a call is answered as failed at once, neither decided nor traced; None: it is carried out."""
        return None

    async def run(self, context: Context, call: M) -> tools.Result:
        """Carry the call out; what goes wrong is a failed Result, never an exception (but a cancellation)."""
        raise NotImplementedError


async def reached(context: Context) -> tools.Workspace | tools.Result:
    """The session's workspace, or the failed result that says why it cannot be reached."""
    from devd.agent import tools

    try:
        return await context.workspace()
    except tools.Refused as e:
        return tools.Result(f"refused: {e.why}", failed=True)


ARGV: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
PATH: dict[str, Any] = {"type": "string", "description": "a path relative to the workspace"}


def nul_in_path(path: str) -> str | None:
    """Why a call naming this path is refused for a NUL in it, or None."""
    if "\0" in path:
        return "refused: the path holds a NUL character, which no file name can; send the path without it"
    return None
