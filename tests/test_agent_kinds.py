"""The table of tool kinds: one kind per member of the core's Call, each named once, checked at import; what the
model is offered and what a profile decides come from it."""

from __future__ import annotations

import msgspec
import pytest

from devd.agent import kinds
from devd.agent.model import tool_names
from devd.agent.profiles import Profile
from devd.messages import Call, ToolCall


def profile(**fields: object) -> Profile:
    base = {"name": "coder", "base_url": "http://127.0.0.1:1/v1", "model": "m", "workspace_roots": ("/",)}
    return Profile(**(base | fields))  # type: ignore[arg-type]


def test_the_table_has_one_kind_for_each_member_of_the_cores_call_in_its_order() -> None:
    assert [k.member for k in kinds.KINDS] == list(Call.__struct_fields__)


def test_a_table_naming_a_kind_twice_is_refused_saying_which_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, kinds.BY_NAME["read"]))
    with pytest.raises(AssertionError, match=r"tool kinds share a name: \['read'\]"):
        kinds._check()


def test_the_model_is_offered_every_kind_with_a_schema_that_the_profile_enables() -> None:
    enabled = profile(tools=("browse",))
    assert tool_names(enabled, exec_available=True) == ["exec", "read", "write", "git", "browse"]


def test_a_named_tool_call_is_answered_at_once_and_never_decided_by_the_policy() -> None:
    call = ToolCall(name="search", input=msgspec.Raw(b"{}"))
    kind = kinds.BY_MEMBER["Tool"]
    assert (kinds.of(Call(Tool=call)), kind.gated, kind.answered(call)) == (
        (kind, call),
        False,
        "no tool is named search",
    )
