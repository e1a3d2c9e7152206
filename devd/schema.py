"""The protocol described for machines, generated from the msgspec types so that it cannot drift from the code.

`devd schema` prints one of three documents, each derived from `schema()`:

- `schema()` (`devd schema`): one JSON Schema (draft 2020-12) document, shaped for client generators:

      {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": ..., "protocol": 1,
        "methods":       {"session/step": {"description": ..., "params": {"$ref": "#/$defs/StepParams"},
                                           "result": {"$ref": "#/$defs/StepResult"}}, ...},
        "notifications": {"session/actions": {"description": ..., "params": {"$ref": "#/$defs/StepNotice"}}, ...},
        "error":         {"$ref": "#/$defs/Error"},          the `error` member of an error reply
        "errors":        {"HANDLE": {"code": -32001, "description": ...}, ...},
        "event":  {"$ref": "#/$defs/Event"},   "action": {"$ref": "#/$defs/Action"},
        "config": {"$ref": "#/$defs/Config"},
        "$defs":  {...every type named above, the types they use, and `Methods` and `Notifications`...}
      }

  Every `$ref` points into `$defs`, so any of them can be validated against by adding that `$ref` to the document
  itself (`{**schema, "$ref": "#/$defs/StepParams"}`); the other top-level members are annotations a validator
  ignores. For generators that read only `$defs`, `$defs/Methods` is an object type with one member per method,
  `{params, result}`, and `$defs/Notifications` one per notification, its params: not messages, but the method map
  as a type (json-schema-to-typescript makes `interface Methods {"session/step": {params: StepParams; ...}}`).
- `openrpc()` (`devd schema --openrpc`): the same as an OpenRPC 1.3 document, the standard method map of JSON-RPC:
  every method with its params by name and its result, the same definitions as `components.schemas`, the errors
  as `components.errors`, and the notifications (which OpenRPC has no word for) as the `x-notifications` extension.
- `typescript()` (`devd schema --typescript`): a TypeScript module of types only, so also a declaration file; the
  TypeScript client (`clients/typescript/src/types.ts`) is this output, checked in.

What msgspec cannot see is fixed up here:
- members typed `msgspec.Raw` (an event or actions passed to the core without re-encoding) say what they hold:
  `StepParams.event` and `StepNotice.event` are an Event, `StepResult.actions`, `PendingResult.actions` and
  `StepNotice.actions` a list of Action, `TranscriptResult.messages` a list of Message;
- the core's messages never carry null (an absent member is omitted, and the core refuses a null), so their
  optional members lose the `null` alternative; their integers are the core's, 0 to 2^64-1;
- a union (Event, Call, Op, Message, Outcome) is a `oneOf` of objects, each with exactly one member, required,
  and nothing else, which generators turn into unions that narrow (`{Model: Ask} | {Exec: Exec} | ...`);
- `Error.data.kind` lists the kinds there are;
- every definition has a description (its Struct's docstring, or one here for the types without one), and some
  have `examples`, taken from the transcripts of docs/protocol.md (tests/test_schema.py checks they are there).
"""

from __future__ import annotations

import copy
import json
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import msgspec

from devd import __version__, errors, messages, protocol
from devd.protocol import METHODS

DIALECT = "https://json-schema.org/draft/2020-12/schema"
OPENRPC = "1.3.2"
PROTOCOL = 1
U64_MAX = (1 << 64) - 1  # the core reads every integer of a message as a u64

# Raw members, and what they hold on the wire.
_EVENT = {"$ref": "#/$defs/Event"}
_ACTIONS = {"type": "array", "items": {"$ref": "#/$defs/Action"}}
_RAW_MEMBERS: dict[tuple[str, str], dict[str, Any]] = {
    ("StepParams", "event"): _EVENT,
    ("StepResult", "actions"): _ACTIONS,
    ("PendingResult", "actions"): _ACTIONS,
    ("StepNotice", "event"): _EVENT,
    ("StepNotice", "actions"): _ACTIONS,
    ("TranscriptResult", "messages"): {"type": "array", "items": {"$ref": "#/$defs/Message"}},
}

# Descriptions of the types whose Struct has no docstring (devd/server/rpc.py's envelope types).
_DESCRIPTIONS = {
    "Error": "The `error` member of an error reply: the JSON-RPC `code`, a `message` for people that says what to do "
    "next, and `data.kind`, the kind to branch on.",
    "ErrorData": "What an error carries besides its message: its `kind` (the document's `errors` lists them).",
}

# JSON-RPC's own errors, which devd/errors.py leaves undocumented.
_JSONRPC_ERRORS = {
    "PARSE": "The line is not UTF-8 JSON; nothing was done. Send one JSON object per line.",
    "INVALID_REQUEST": "The line is JSON but not a JSON-RPC 2.0 request (or is a batch); nothing was done.",
    "METHOD_NOT_FOUND": "There is no such method; `methods` lists them.",
    "INVALID_PARAMS": "The params do not fit the method's params schema, or break a rule it states.",
    "INTERNAL": "The daemon failed to answer; its log says why.",
}


# -- examples, from docs/protocol.md ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """A request's params and the result it was answered, as a transcript of docs/protocol.md shows them."""

    name: str
    method: str
    params: dict[str, Any]
    result: dict[str, Any]


_TIME = "2026-11-30T12:07:18.912Z"  # the document's `$TIME`, as the document itself spells one out
_TURN = {"Turn": {"id": 1, "prompt": "fix the build"}}
_CALLS = [{"Exec": {"argv": ["make"]}}, {"Read": {"path": "build.log"}}]
_FINAL = {"Model": {"id": 4, "reply": {"text": "x was never declared; declare it."}}}
_FINAL_ACTIONS = [
    {"id": 5, "op": {"Emit": "x was never declared; declare it."}},
    {"id": 6, "op": {"Save": True}},
    {"id": 7, "op": {"Done": {"turn": 1, "outcome": {"Complete": True}}}},
]
_LIMITS = {
    "line_bytes_max": 16777216,
    "sessions_max": 1000000,
    "connections_max": 1024,
    "call_timeout_ms": 5000,
    "memory_bytes_per_session": 67108864,
    "keys_kept_per_session": 1000,
}
EXCHANGES: tuple[Exchange, ...] = (
    Exchange(
        "say hello",
        "initialize",
        {"client": {"name": "example", "version": "1.0"}},
        {"server": {"name": "devd", "version": "0.1.0"}, "protocol": 1, "abi": 2, "limits": _LIMITS},
    ),
    Exchange("a new session", "session/new", {"session": "demo", "config": {"model": "small"}}, {"session": "demo"}),
    Exchange(
        "a turn starts: the model is asked",
        "session/step",
        {"session": "demo", "event": _TURN},
        {"actions": [{"id": 1, "op": {"Model": {"model": "small", "messages": [{"User": "fix the build"}]}}}]},
    ),
    Exchange(
        "the model asks for two calls",
        "session/step",
        {"session": "demo", "event": {"Model": {"id": 1, "reply": {"calls": _CALLS}}}},
        {"actions": [{"id": 2, "op": {"Exec": {"argv": ["make"]}}}, {"id": 3, "op": {"Read": {"path": "build.log"}}}]},
    ),
    Exchange(
        "one call's result: the other is still awaited",
        "session/step",
        {"session": "demo", "event": {"Exec": {"id": 2, "text": "main.c:3: error: x undeclared", "failed": True}}},
        {"actions": []},
    ),
    Exchange(
        "the model's answer, with a key: emitted, saved, done",
        "session/step",
        {"session": "demo", "event": _FINAL, "key": "demo-answer-4"},
        {"actions": _FINAL_ACTIONS},
    ),
    Exchange(
        "the same key and event again: answered from the journal",
        "session/step",
        {"session": "demo", "event": _FINAL, "key": "demo-answer-4"},
        {"actions": _FINAL_ACTIONS, "replayed": True},
    ),
    Exchange(
        "a session's conversation, from its third message on",
        "session/transcript",
        {"session": "brief", "from": 2},
        {"seq": 3, "from": 2, "messages": [{"Tool": {"id": 2, "text": "1 failed"}}]},
    ),
    Exchange(
        "what a session still waits for",
        "session/pending",
        {"session": "plan"},
        {"actions": [{"id": 3, "op": {"Read": {"path": "ci.log"}}}]},
    ),
    Exchange("a fork at step 2", "session/fork", {"session": "plan", "at": 2, "as": "plan-b"}, {"session": "plan-b"}),
    Exchange(
        "the sessions",
        "session/list",
        {},
        {"sessions": [{"session": "demo", "state": "live", "seq": 5, "created": _TIME, "last_used": _TIME}]},
    ),
    Exchange(
        "one session, and what its turn waits for",
        "session/info",
        {"session": "look"},
        {
            "session": "look",
            "state": "live",
            "seq": 2,
            "created": _TIME,
            "last_used": _TIME,
            "waiting": [{"id": 2, "kind": "Read"}],
        },
    ),
    Exchange("watch a session", "session/watch", {"session": "demo"}, {}),
    Exchange("close a session", "session/close", {"session": "demo"}, {}),
)
ERROR_EXAMPLE: dict[str, Any] = {
    "code": -32012,
    "message": "key 'demo-answer-4' was used for another event (step 5); use a new key for a new event",
    "data": {"kind": "CONFLICT"},
}
NOTICE_EXAMPLE: dict[str, Any] = {
    "session": "demo",
    "seq": 3,
    "event": {"Exec": {"id": 2, "text": "main.c:3: error: x undeclared", "failed": True}},
    "actions": [],
    "at": _TIME,
}


# -- the JSON Schema ----------------------------------------------------------------------------------------------


def error_kinds() -> dict[str, type[errors.DevdError]]:
    """Every error kind that can cross the wire, with its class. ABI errors stop the daemon at start and never do."""
    found: dict[str, type[errors.DevdError]] = {}
    pending: list[type[errors.DevdError]] = [errors.DevdError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        # Only the protocol's own: a client may define errors of its own (devd.driver.TurnError) that never cross.
        if cls not in (errors.DevdError, errors.AbiError) and cls.__module__ == errors.__name__:
            found.setdefault(cls.kind, cls)
    return dict(sorted(found.items(), key=lambda item: (item[1].code < -32099, -item[1].code)))


def _ref(cls: type) -> dict[str, str]:
    return {"$ref": f"#/$defs/{cls.__name__}"}


def schema() -> dict[str, Any]:
    """The schema document as a dict (see the module docstring for its shape)."""
    types = [
        *(m.params for m in METHODS.values()),
        *(m.result for m in METHODS.values()),
        *protocol.NOTIFICATIONS.values(),
        protocol.Error,
        messages.Event,
        messages.Action,
        messages.Config,
    ]
    _, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    for name, definition in defs.items():
        cls = getattr(messages, name, None)
        if isinstance(cls, type) and issubclass(cls, messages._Wire):
            _never_null(definition)
            _u64(definition)
            if issubclass(cls, messages._OneOf):
                _one_of(definition)
    for (struct, member), replacement in _RAW_MEMBERS.items():
        properties = defs[struct]["properties"]
        assert properties[member] == {}, f"{struct}.{member} is no longer Raw; update devd/schema.py"
        properties[member] = replacement
    kinds = error_kinds()
    defs["ErrorData"]["properties"]["kind"] = {"enum": list(kinds)}
    for name, definition in defs.items():
        description = definition.get("description") or _DESCRIPTIONS.get(name)
        assert description, f"{name} has no docstring; give it one (it is the type's description for every client)"
        definition["description"] = _tidy(description)
    _examples(defs)
    assert not {"Methods", "Notifications"} & set(defs), "a Struct is named like a map type; rename one"
    defs["Methods"] = _methods_type()
    defs["Notifications"] = _notifications_type()

    return {
        "$schema": DIALECT,
        "title": "devd protocol 1: JSON-RPC 2.0 over newline-delimited JSON",
        "protocol": PROTOCOL,
        "methods": {
            name: {"description": m.doc, "params": _ref(m.params), "result": _ref(m.result)}
            for name, m in METHODS.items()
        },
        "notifications": {
            method: {"description": _tidy(cls.__doc__ or ""), "params": _ref(cls)}
            for method, cls in protocol.NOTIFICATIONS.items()
        },
        "error": _ref(protocol.Error),
        "errors": {
            kind: {"code": cls.code, "description": " ".join((cls.__doc__ or _JSONRPC_ERRORS[kind]).split())}
            for kind, cls in kinds.items()
        },
        "event": _ref(messages.Event),
        "action": _ref(messages.Action),
        "config": _ref(messages.Config),
        "$defs": dict(sorted(defs.items())),
    }


def _never_null(definition: dict[str, Any]) -> None:
    """A core message omits an absent member and refuses null: its optional members lose the null alternative."""
    for member in definition.get("properties", {}).values():
        alternatives = member.get("anyOf")
        if alternatives and {"type": "null"} in alternatives and member.get("default", ...) is None:
            rest = [a for a in alternatives if a != {"type": "null"}]
            member.clear()
            member.update(rest[0] if len(rest) == 1 else {"anyOf": rest})


def _u64(definition: dict[str, Any]) -> None:
    """The core reads a message's integers as u64: no sign, at most 2^64-1."""
    for member in definition.get("properties", {}).values():
        if member.get("type") == "integer":
            member.setdefault("minimum", 0)
            member.setdefault("maximum", U64_MAX)


def _one_of(definition: dict[str, Any]) -> None:
    """A union becomes a oneOf of single-member objects: the shape generators turn into unions that narrow."""
    properties = definition.pop("properties")
    for keyword in ("type", "required", "additionalProperties"):
        definition.pop(keyword, None)
    definition["oneOf"] = [
        {"type": "object", "properties": {name: member}, "required": [name], "additionalProperties": False}
        for name, member in properties.items()
    ]


def _tidy(text: str) -> str:
    """A docstring as a description: paragraphs kept, the line breaks inside them gone."""
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _examples(defs: dict[str, Any]) -> None:
    """Each example where its type is defined: params and results, the events and actions in them, an error."""
    found: dict[str, list[Any]] = {}

    def add(name: str, value: Any) -> None:
        values = found.setdefault(name, [])
        if value not in values:
            values.append(value)

    for exchange in EXCHANGES:
        m = METHODS[exchange.method]
        add(m.params.__name__, exchange.params)
        add(m.result.__name__, exchange.result)
        if "event" in exchange.params:
            add("Event", exchange.params["event"])
        for action in exchange.result.get("actions", []):
            add("Action", action)
    add("Error", ERROR_EXAMPLE)
    add("StepNotice", NOTICE_EXAMPLE)
    for name, values in found.items():
        defs[name]["examples"] = values


def _methods_type() -> dict[str, Any]:
    """Every method's params and result as one object type: the method map for generators that read only $defs."""
    return {
        "title": "Methods",
        "description": "Not a message: every method by name, with its params and result, for typed clients. "
        "`devd schema --openrpc` says the same as an OpenRPC document.",
        "type": "object",
        "properties": {
            name: {
                "description": m.doc,
                "type": "object",
                "properties": {"params": _ref(m.params), "result": _ref(m.result)},
                "required": ["params", "result"],
                "additionalProperties": False,
            }
            for name, m in METHODS.items()
        },
        "required": list(METHODS),
        "additionalProperties": False,
    }


def _notifications_type() -> dict[str, Any]:
    """Every notification's params as one object type, for generators that read only $defs."""
    return {
        "title": "Notifications",
        "description": "Not a message: every notification the daemon sends, by method, with its params.",
        "type": "object",
        "properties": {method: _ref(cls) for method, cls in protocol.NOTIFICATIONS.items()},
        "required": list(protocol.NOTIFICATIONS),
        "additionalProperties": False,
    }


def schema_json() -> bytes:
    """The schema document as pretty JSON."""
    return msgspec.json.format(msgspec.json.encode(schema()), indent=2)


# -- OpenRPC ------------------------------------------------------------------------------------------------------

_COMPONENTS = "#/components/schemas/"


def openrpc() -> dict[str, Any]:
    """The OpenRPC 1.3 document: methods with params by name and result, over the schema's definitions."""
    doc = schema()
    defs = _rebase({k: v for k, v in doc["$defs"].items() if k not in ("Methods", "Notifications")})
    return {
        "openrpc": OPENRPC,
        "info": {
            "title": "devd",
            "version": __version__,
            "description": f"{doc['title']}. A connection is a Unix socket, or TCP whose first call is "
            "`initialize` with the token; docs/protocol.md is the whole contract.",
        },
        "methods": [_openrpc_method(name, defs) for name in METHODS],
        "components": {
            "schemas": defs,
            "errors": {
                kind: {"code": e["code"], "message": e["description"], "data": {"kind": kind}}
                for kind, e in doc["errors"].items()
            },
        },
        "x-notifications": [
            {
                "name": method,
                "description": entry["description"],
                "paramStructure": "by-name",
                "params": _by_name(defs[protocol.NOTIFICATIONS[method].__name__]),
            }
            for method, entry in doc["notifications"].items()
        ],
    }


def _rebase(node: Any) -> Any:
    """A copy of node whose refs point into components.schemas rather than $defs."""
    if isinstance(node, dict):
        return {k: (_COMPONENTS + v.removeprefix("#/$defs/") if k == "$ref" else _rebase(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(v) for v in node]
    return node


def _by_name(definition: dict[str, Any]) -> list[dict[str, Any]]:
    """A params object's members as OpenRPC content descriptors, in order."""
    required = set(definition.get("required", []))
    params = []
    for name, member in definition.get("properties", {}).items():
        descriptor: dict[str, Any] = {"name": name, "required": name in required, "schema": copy.deepcopy(member)}
        description = _annotation(member, "description")
        if description is not None:
            descriptor["description"] = description
        params.append(descriptor)
    return params


def _openrpc_method(name: str, defs: dict[str, Any]) -> dict[str, Any]:
    m = METHODS[name]
    result = m.result.__name__
    examples = [
        {
            "name": e.name,
            "params": [{"name": k, "value": v} for k, v in e.params.items()],
            "result": {"name": result, "value": e.result},
        }
        for e in EXCHANGES
        if e.method == name
    ]
    method: dict[str, Any] = {
        "name": name,
        "description": m.doc,
        "paramStructure": "by-name",
        "params": _by_name(defs[m.params.__name__]),
        "result": {
            "name": result,
            "description": defs[result]["description"],
            "schema": {"$ref": _COMPONENTS + result},
        },
    }
    return method | ({"examples": examples} if examples else {})


def openrpc_json() -> bytes:
    """The OpenRPC document as pretty JSON."""
    return msgspec.json.format(msgspec.json.encode(openrpc()), indent=2)


# -- TypeScript ---------------------------------------------------------------------------------------------------

_TS_HEADER = """\
// The devd protocol's types: generated by `devd schema --typescript` from devd's msgspec types. Do not edit.
// Regenerate with `make typescript`, which runs `.venv/bin/devd schema --typescript > clients/typescript/src/types.ts`
// (tests/test_typescript.py and .ci/run fail when this file is not what that prints).
//
// Types only, so this module is a declaration file too. A union of the protocol (Event, Op, Call, Message,
// Outcome) is a union of single-member object types, and `"Model" in op` narrows an `Op` to `{ Model: Ask }`.
// Optional members of the core's messages are left out, never null; integers are JSON numbers, exact up to 2^53.
"""

# Constraints a member's JSDoc states, under their JSON Schema names.
_TS_TAGS = (
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "default",
)
_IDENTIFIER = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_TS_WIDTH = 116


def typescript() -> str:
    """The schema's definitions as a TypeScript module of types (see _TS_HEADER for what it promises)."""
    doc = schema()
    parts = [
        _TS_HEADER,
        _jsdoc(["The protocol these types describe; `initialize` answers it as `protocol`."], "")
        + f"export type Protocol = {PROTOCOL};\n",
        _ts_error_codes(doc["errors"]),
    ]
    for name, definition in doc["$defs"].items():
        parts.append(_ts_definition(name, definition))
    return "\n".join(parts)


def _ts_error_codes(kinds: dict[str, Any]) -> str:
    members = "".join(_jsdoc([e["description"]], "  ") + f"  {kind}: {e['code']};\n" for kind, e in kinds.items())
    return (
        _jsdoc(["Every error kind (`error.data.kind`, to branch on) with its JSON-RPC code (`error.code`)."], "")
        + f"export interface ErrorCodes {{\n{members}}}\n\n"
        + _jsdoc(["The kind of an error reply."], "")
        + "export type ErrorKind = keyof ErrorCodes;\n"
    )


def _ts_definition(name: str, definition: dict[str, Any]) -> str:
    lines = [definition["description"], *(_ts_example(v) for v in definition.get("examples", [])[:1])]
    head = _jsdoc(lines, "")
    if "oneOf" in definition:
        branches = "".join(f"\n  | {_ts_branch(branch)}" for branch in definition["oneOf"])
        return f"{head}export type {name} ={branches};\n"
    if definition.get("type") == "object" and definition.get("properties"):
        return f"{head}export interface {name} {_ts_members(definition, '')}\n"
    return f"{head}export type {name} = {_ts_type(definition, '')};\n"


def _ts_branch(branch: dict[str, Any]) -> str:
    """A union's branch on one line, `{ Model: Ask }`: the member's own type carries its documentation."""
    [(name, member)] = branch["properties"].items()
    assert branch["required"] == [name] and not _member_doc(member), branch
    return f"{{ {_ts_key(name)}: {_ts_type(member, '  ')} }}"


def _ts_example(value: Any) -> str:
    return "@example " + json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _ts_members(definition: dict[str, Any], indent: str) -> str:
    required = set(definition.get("required", []))
    inner = indent + "  "
    body = ""
    for name, member in definition["properties"].items():
        kind = _ts_type(member, inner)
        optional = "" if name in required else "?"
        space = "" if kind.startswith("\n") else " "  # a long union starts on the next line
        body += _jsdoc(_member_doc(member), inner) + f"{inner}{_ts_key(name)}{optional}:{space}{kind};\n"
    return f"{{\n{body}{indent}}}"


def _member_doc(member: dict[str, Any]) -> list[str]:
    """A member's JSDoc: its description, then one tag per constraint."""
    lines = []
    description = _annotation(member, "description")
    if description:
        lines.append(description)
    for tag in _TS_TAGS:
        value = _annotation(member, tag)
        if value is not None:
            lines.append(f"@{tag} {value if tag == 'pattern' else json.dumps(value)}")
    return lines


def _annotation(member: dict[str, Any], keyword: str) -> Any:
    """A keyword of the member, or of its one non-null alternative (`X | None` in msgspec)."""
    if keyword in member:
        return member[keyword]
    for alternative in member.get("anyOf", []):
        if keyword in alternative:
            return alternative[keyword]
    return None


def _ts_type(node: dict[str, Any], indent: str) -> str:
    """The TypeScript for one schema node."""
    if "$ref" in node:
        return str(node["$ref"]).rsplit("/", 1)[1]
    for keyword in ("anyOf", "oneOf"):
        if keyword in node:
            return " | ".join(_ts_type(alternative, indent) for alternative in node[keyword])
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        literals = [json.dumps(value) for value in node["enum"]]
        if len(indent) + sum(len(literal) + 3 for literal in literals) <= _TS_WIDTH - 20:
            return " | ".join(literals)
        return "".join(f"\n{indent}  | {literal}" for literal in literals)  # one a line, past the width
    kind = node.get("type")
    if kind in _TS_SCALARS:
        return _TS_SCALARS[kind]
    if kind == "array":
        items = _ts_type(node["items"], indent)
        return f"({items})[]" if " | " in items else f"{items}[]"
    if kind == "object":
        if node.get("properties"):
            return _ts_members(node, indent)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            return f"{{ [key: string]: {_ts_type(extra, indent)} }}"
        return "Record<string, never>"
    if kind is None and not {"not", "allOf", "if"} & set(node):
        return "unknown"
    raise ValueError(f"devd/schema.py has no TypeScript for {node}; teach _ts_type")


_TS_SCALARS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null"}


def _ts_key(name: str) -> str:
    return name if _IDENTIFIER.fullmatch(name) else json.dumps(name)


def _jsdoc(lines: list[str], indent: str) -> str:
    """A JSDoc comment of paragraphs, wrapped; empty when there is nothing to say."""
    if not lines:
        return ""
    body: list[str] = []
    for i, text in enumerate(lines):
        if i and not (text.startswith("@") and lines[i - 1].startswith("@")):
            body.append("")
        for paragraph_number, paragraph in enumerate(text.replace("*/", "*\\/").split("\n\n")):
            if paragraph_number:
                body.append("")
            if paragraph.startswith("@"):
                body.append(paragraph)  # a tag's value (a pattern, an example) is not reflowed
            else:
                body.extend(textwrap.wrap(paragraph, _TS_WIDTH - len(indent)) or [""])
    if len(body) == 1 and len(indent) + len(body[0]) + 7 <= _TS_WIDTH + 4:
        return f"{indent}/** {body[0]} */\n"
    inner = "".join(f"{indent} *{' ' + line if line else ''}\n" for line in body)
    return f"{indent}/**\n{inner}{indent} */\n"
