"""The table of tool kinds: one kind per member of the core's Call, each named once, checked at import; what the
model is offered and what a profile decides come from it."""

from __future__ import annotations

import msgspec
import pytest

from devd.agent import kinds
from devd.agent.model import tool_names
from devd.agent.profiles import McpServer, Profile
from devd.messages import Call, ToolCall


def profile(**fields: object) -> Profile:
    base = {"name": "coder", "base_url": "http://127.0.0.1:1/v1", "model": "m", "workspace_roots": ("/",)}
    return Profile(**(base | fields))  # type: ignore[arg-type]


def test_the_table_has_a_kind_for_each_member_of_the_cores_call_in_its_order() -> None:
    # A delegation is a Tool call of its own kind (named `delegate`), beside the named (MCP) tools'.
    assert list(dict.fromkeys(k.member for k in kinds.KINDS)) == list(Call.__struct_fields__)


def test_a_table_naming_a_kind_twice_is_refused_saying_which_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, kinds.BY_NAME["read"]))
    with pytest.raises(AssertionError, match=r"tool kinds share a name: \['read'\]"):
        kinds._check()


def test_the_model_is_offered_every_kind_with_a_schema_that_the_profile_enables() -> None:
    enabled = profile(tools=("browse",))
    assert tool_names(enabled, exec_available=True) == ["exec", "read", "write", "git", "browse"]


def test_a_named_tool_call_that_names_no_mcp_tool_is_answered_at_once() -> None:
    call = ToolCall(name="search", input=msgspec.Raw(b"{}"))
    kind = kinds.BY_MEMBER["Tool"]
    assert (kinds.of(Call(Tool=call)), kind.answered(call)) == ((kind, call), "no tool is named search")


def test_an_mcp_tool_call_is_an_effect_decided_by_its_server_and_its_rules() -> None:
    servers = (
        McpServer(name="gh", command=("gh",), decision="allow", rules=(("delete_repo", "deny"),)),
        McpServer(name="docs", command=("docs",)),
    )
    p = profile(mcp=servers)
    calls = [ToolCall(name=n, input=msgspec.Raw(b"{}")) for n in ("gh__get", "gh__delete_repo", "docs__x", "web__y")]
    kind = kinds.BY_MEMBER["Tool"]
    assert (kind.effect, [kind.decide(p, c)[0] for c in calls], kind.decide(p, calls[3])[1]) == (
        True,
        ["allow", "deny", "ask", "deny"],
        "denied by the policy: agent 'coder' has no MCP server web",
    )
