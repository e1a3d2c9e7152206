"""The kinds of tool call, one module each, in one table: `KINDS`. Adding a kind is its module and its line here.

Everything that enumerates kinds iterates this table: the tools offered to the model and how its calls are read
(`devd.agent.model`), the policy (`decide`), remembered approvals (`devd.agent.approvals`), the runner's claims,
dispatch and result events (`devd.agent.runner`), trace records and their spans (`devd.agent.otel`), the lines of
`devd run` and `devd attach` (`devd.agent.cli`), `devd inspect` (`devd.cli.operator`) and the ACP tool calls
(`devd.acp.translate`). The table is checked at import: names, `Call`/`Op` members and the kinds a profile lists
are unique, every member is one of the core's, and the wire's closed sets (`devd.protocol.Kind` of a trace record,
`devd.messages.RESULTS`, a profile's `tools`) name exactly the table's kinds.
"""

from __future__ import annotations

from typing import Any, get_args

from devd.agent.kinds import browse, command, delegate, git, named, read, write
from devd.agent.kinds.base import Context, Kind, Shown
from devd.agent.profiles import EXTRA_TOOLS, Decision, Profile, stricter
from devd.messages import RESULTS as WIRE_RESULTS
from devd.messages import Call, Event, Op, Output
from devd.protocol import Kind as TraceKind

KINDS: tuple[Kind[Any], ...] = (
    command.KIND,
    read.KIND,
    write.KIND,
    git.KIND,
    browse.KIND,
    delegate.KIND,  # before named: both are the core's Tool call, a delegation the one named `delegate`
    named.KIND,
)

BY_NAME: dict[str, Kind[Any]] = {k.name: k for k in KINDS}
BY_MEMBER: dict[str, Kind[Any]] = {k.member: k for k in KINDS}
RESULTS: tuple[str, ...] = tuple(dict.fromkeys(k.result for k in KINDS))  # the Event members that step a result
OFFERED: dict[str, Kind[Any]] = {k.name: k for k in KINDS if k.schema is not None}  # by the model's name for it


def _check() -> None:
    """The table's promises, at import: a duplicate or a kind the wire cannot carry is a programmer's error."""
    names = [k.name for k in KINDS]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"tool kinds share a name: {twice}"
    for k in KINDS:  # kinds may share a member of the core's (a Tool call) only when each tells its calls apart
        sharing = [other for other in KINDS if other.member == k.member]
        assert len(sharing) == 1 or all(type(o).of is not Kind.of for o in sharing), f"{k.member}: shared, untold"
    for k in KINDS:
        assert k.member in Call.__struct_fields__ and k.member in Op.__struct_fields__, f"{k.member}: not a call"
        assert k.result in Event.__struct_fields__, f"{k.name}: {k.result} is not an event"
    traced = {k.name for k in KINDS if k.gated}
    assert set(get_args(TraceKind)) == {"model", *traced}, "devd.protocol.Kind must name the traced kinds"
    assert set(WIRE_RESULTS) == set(RESULTS), "devd.messages.RESULTS must name the kinds' result events"
    assert set(EXTRA_TOOLS) == {k.name for k in KINDS if k.listed}, "profiles.EXTRA_TOOLS must name the listed kinds"


_check()


def of(holder: Call | Op) -> tuple[Kind[Any], Any] | None:
    """The kind of a Call or an Op and its member; None for an op that is no call (Model, Emit, Save, Done)."""
    for kind in KINDS:
        member = kind.of(holder)
        if member is not None:
            return kind, member
    return None


def result_of(event: Event) -> Output | None:
    """The result an event steps (its `Output`), or None for an event that steps none."""
    for member in RESULTS:
        output: Output | None = getattr(event, member)
        if output is not None:
            return output
    return None


def decide(profile: Profile, call: Call) -> tuple[Decision, str]:
    """Whether the profile lets the call run, and why in words the model is shown: its kind decides
    (`Kind.decide`)."""
    found = of(call)
    if found is None:
        raise ValueError("a Call with no member")  # Call's own check forbids this
    kind, member = found
    decided: tuple[Decision, str] = kind.decide(profile, member)
    if kind.narrowed and profile.ceiling is not None:  # a child's call: its parent's profile decides it too
        decided = stricter(decided, decide(profile.ceiling, call))
    return decided


__all__ = [
    "BY_MEMBER",
    "BY_NAME",
    "KINDS",
    "OFFERED",
    "RESULTS",
    "Context",
    "Kind",
    "Shown",
    "decide",
    "of",
    "result_of",
]
