"""The JSON Schema of the protocol, generated from the msgspec types so that it cannot drift from the code.

`schema_json()` is one JSON Schema (draft 2020-12) document, shaped for client generators:

    {
      "$schema": "https://json-schema.org/draft/2020-12/schema",
      "title": ..., "protocol": 1,
      "methods":       {"session/step": {"params": {"$ref": "#/$defs/StepParams"},
                                         "result": {"$ref": "#/$defs/StepResult"}}, ...},
      "notifications": {"session/actions": {"params": {"$ref": "#/$defs/StepNotice"}}, ...},
      "error":         {"$ref": "#/$defs/Error"},          the `error` member of an error reply
      "errors":        {"HANDLE": {"code": -32001, "description": ...}, ...},
      "event":  {"$ref": "#/$defs/Event"},   "action": {"$ref": "#/$defs/Action"},
      "config": {"$ref": "#/$defs/Config"},
      "$defs":  {...every type named above, and the types they use...}
    }

Every `$ref` points into `$defs`, so any of them can be validated against by adding that `$ref` to the document
itself (`{**schema, "$ref": "#/$defs/StepParams"}`); the other top-level members are annotations a validator ignores.

What msgspec cannot see is fixed up here:
- members typed `msgspec.Raw` (an event or actions passed to the core without re-encoding) say what they hold:
  `StepParams.event` and `StepNotice.event` are an Event, `StepResult.actions` and `StepNotice.actions` a list of
  Action;
- the core's messages never carry null (an absent member is omitted, and the core refuses a null), so their
  optional members lose the `null` alternative, and a union (Event, Call, Op, Message, Outcome) is an object with
  exactly one member;
- `Error.data.kind` lists the kinds there are.
"""

from __future__ import annotations

from typing import Any

import msgspec

from devd import errors, messages, rpc
from devd.methods import METHODS

DIALECT = "https://json-schema.org/draft/2020-12/schema"
PROTOCOL = 1

# Raw members, and what they hold on the wire.
_EVENT = {"$ref": "#/$defs/Event"}
_ACTIONS = {"type": "array", "items": {"$ref": "#/$defs/Action"}}
_RAW_MEMBERS: dict[tuple[str, str], dict[str, Any]] = {
    ("StepParams", "event"): _EVENT,
    ("StepResult", "actions"): _ACTIONS,
    ("PendingResult", "actions"): _ACTIONS,
    ("StepNotice", "event"): _EVENT,
    ("StepNotice", "actions"): _ACTIONS,
}


# JSON-RPC's own errors, which devd/errors.py leaves undocumented.
_JSONRPC_ERRORS = {
    "PARSE": "The line is not UTF-8 JSON; nothing was done. Send one JSON object per line.",
    "INVALID_REQUEST": "The line is JSON but not a JSON-RPC 2.0 request (or is a batch); nothing was done.",
    "METHOD_NOT_FOUND": "There is no such method; `methods` lists them.",
    "INVALID_PARAMS": "The params do not fit the method's params schema, or break a rule it states.",
    "INTERNAL": "The daemon failed to answer; its log says why.",
}


def error_kinds() -> dict[str, type[errors.DevdError]]:
    """Every error kind that can cross the wire, with its class. ABI errors stop the daemon at start and never do."""
    found: dict[str, type[errors.DevdError]] = {}
    pending: list[type[errors.DevdError]] = [errors.DevdError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls not in (errors.DevdError, errors.AbiError):
            found.setdefault(cls.kind, cls)
    return dict(sorted(found.items(), key=lambda item: (item[1].code < -32099, -item[1].code)))


def schema() -> dict[str, Any]:
    """The schema document as a dict (see the module docstring for its shape)."""
    types = [
        *(m.params for m in METHODS.values()),
        *(m.result for m in METHODS.values()),
        *rpc.NOTIFICATIONS.values(),
        rpc.Error,
        messages.Event,
        messages.Action,
        messages.Config,
    ]
    _, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    for name, definition in defs.items():
        cls = getattr(messages, name, None)
        if isinstance(cls, type) and issubclass(cls, messages._Wire):
            _never_null(definition, one_of=issubclass(cls, messages._OneOf))
    for (struct, member), replacement in _RAW_MEMBERS.items():
        properties = defs[struct]["properties"]
        assert properties[member] == {}, f"{struct}.{member} is no longer Raw; update devd/schema.py"
        properties[member] = replacement
    kinds = error_kinds()
    defs["ErrorData"]["properties"]["kind"] = {"enum": list(kinds)}

    def ref(cls: type) -> dict[str, str]:
        return {"$ref": f"#/$defs/{cls.__name__}"}

    return {
        "$schema": DIALECT,
        "title": "devd protocol 1: JSON-RPC 2.0 over newline-delimited JSON",
        "protocol": PROTOCOL,
        "methods": {
            name: {"description": m.doc, "params": ref(m.params), "result": ref(m.result)}
            for name, m in METHODS.items()
        },
        "notifications": {method: {"params": ref(cls)} for method, cls in rpc.NOTIFICATIONS.items()},
        "error": ref(rpc.Error),
        "errors": {
            kind: {"code": cls.code, "description": " ".join((cls.__doc__ or _JSONRPC_ERRORS[kind]).split())}
            for kind, cls in kinds.items()
        },
        "event": ref(messages.Event),
        "action": ref(messages.Action),
        "config": ref(messages.Config),
        "$defs": dict(sorted(defs.items())),
    }


def _never_null(definition: dict[str, Any], *, one_of: bool) -> None:
    """A core message omits an absent member and refuses null: say so, and that a union has exactly one member."""
    for member in definition.get("properties", {}).values():
        alternatives = member.get("anyOf")
        if alternatives and {"type": "null"} in alternatives and member.get("default", ...) is None:
            rest = [a for a in alternatives if a != {"type": "null"}]
            member.clear()
            member.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
    if one_of:
        definition["minProperties"] = 1
        definition["maxProperties"] = 1


def schema_json() -> bytes:
    """The schema document as pretty JSON."""
    return msgspec.json.format(msgspec.json.encode(schema()), indent=2)
