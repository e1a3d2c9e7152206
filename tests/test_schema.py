"""devd.schema: its shape, and every line of a real session (requests, results, errors, notifications) validated
against it, so the schema a client generator reads is the protocol the daemon speaks; the OpenRPC document and the
TypeScript types derived from it; and its examples, each an exchange of docs/protocol.md."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from devd import errors, messages
from devd.client import Client
from devd.messages import Call, Exec, Output, Read, answer, turn
from devd.schema import (
    ERROR_EXAMPLE,
    EXCHANGES,
    NOTICE_EXAMPLE,
    U64_MAX,
    openrpc,
    openrpc_json,
    schema,
    schema_json,
    typescript,
)
from devd.server.methods import METHODS
from tests.daemon import ROOT, daemon_env, devd, stop, wait_connectable
from tests.helpers import DOC, transcripts

# The methods and notices of sessions the daemon drives need a daemon with --agents: tests/test_agent_runtime.py and
# tests/test_approvals.py cover them.
OVERSIGHT_METHODS = {"session/prompt", "session/resume", "session/approve", "session/budget", "session/usage"}
OVERSIGHT_METHODS |= {
    "session/trace",
    "session/compact",
    "session/model",
    "session/title",  # tests/test_rewind.py
    "session/effects",
    "session/rewind",
    "session/spawn",  # tests/test_children.py
    "session/wait",
    "session/answer",  # tests/test_mcp_questions.py
}  # agent sessions: tests/test_agent_context.py
OVERSIGHT_NOTICES = {"session/delta", "session/stalled", "session/approval", "session/decided"}
OVERSIGHT_NOTICES |= {"session/instructions", "session/child", "session/input", "session/answered"}

SCHEMA = schema()


def validator(pointer: str) -> jsonschema.Draft202012Validator:
    """Validates against the definition at pointer, resolved inside the whole document."""
    return jsonschema.Draft202012Validator({**SCHEMA, "$ref": pointer})


def method_pointer(method: str, part: str) -> str:
    return "#/methods/" + method.replace("~", "~0").replace("/", "~1") + "/" + part


# -- the document ------------------------------------------------------------------------------------------------


def test_the_schema_is_a_valid_2020_12_schema_and_devd_schema_prints_it() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert json.loads(schema_json()) == SCHEMA
    printed = subprocess.run(
        [sys.executable, "-m", "devd", "schema"],
        cwd=ROOT,
        env=daemon_env(),
        capture_output=True,
        timeout=30,
        check=True,
    )
    assert printed.stdout == schema_json() + b"\n"


def test_every_method_has_params_and_result_and_every_ref_resolves() -> None:
    assert list(SCHEMA["methods"]) == list(METHODS)
    assert list(SCHEMA["notifications"]) == [
        "session/actions",
        "session/unwatched",
        "session/delta",
        "session/stalled",
        "session/approval",
        "session/decided",
        "session/instructions",
        "session/child",
        "session/input",
        "session/answered",
    ]
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(SCHEMA)
    assert refs and all(r.startswith("#/$defs/") and r[len("#/$defs/") :] in SCHEMA["$defs"] for r in refs)
    for method in METHODS:
        assert set(SCHEMA["methods"][method]) == {"description", "params", "result"}


def test_raw_members_say_what_they_hold() -> None:
    """Events and actions cross as msgspec.Raw; the schema names their real types."""
    defs = SCHEMA["$defs"]
    actions = {"type": "array", "items": {"$ref": "#/$defs/Action"}}
    assert defs["StepParams"]["properties"]["event"] == {"$ref": "#/$defs/Event"}
    assert defs["StepResult"]["properties"]["actions"] == actions
    assert defs["StepNotice"]["properties"]["event"] == {"$ref": "#/$defs/Event"}
    assert defs["StepNotice"]["properties"]["actions"] == actions


def test_errors_list_every_kind_with_its_code() -> None:
    kinds = {
        cls.kind: cls.code
        for cls in vars(errors).values()
        if isinstance(cls, type)
        and issubclass(cls, errors.DevdError)
        and cls not in (errors.DevdError, errors.AbiError)
    }
    assert {kind: e["code"] for kind, e in SCHEMA["errors"].items()} == kinds
    assert SCHEMA["$defs"]["ErrorData"]["properties"]["kind"] == {"enum": list(SCHEMA["errors"])}
    assert all(e["description"] for e in SCHEMA["errors"].values())


def test_core_messages_have_exactly_one_member_and_never_null() -> None:
    event = validator("#/event")
    assert event.is_valid({"Turn": {"id": 1, "prompt": "x"}})
    assert not event.is_valid({"Turn": {"id": 1, "prompt": "x"}, "Exec": None})
    assert not event.is_valid({"Turn": {"id": 1, "prompt": "x"}, "Timer": True})
    assert not event.is_valid({})
    assert not event.is_valid({"Model": {"id": 1, "reply": {"text": None}}})
    assert validator("#/action").is_valid({"id": 6, "op": {"Save": True}})


def test_unions_are_a_one_of_of_objects_each_with_exactly_one_required_member() -> None:
    """The shape generators turn into unions that narrow (`{Complete: true} | {Cancelled: true}`)."""
    defs = SCHEMA["$defs"]
    assert defs["Outcome"] == {
        "title": "Outcome",
        "description": "How a turn ended; exactly one member: `Complete` or `Cancelled`.",
        "oneOf": [
            {
                "type": "object",
                "properties": {"Complete": {"enum": [True]}},
                "required": ["Complete"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"Cancelled": {"enum": [True]}},
                "required": ["Cancelled"],
                "additionalProperties": False,
            },
        ],
    }
    unions = [messages.Event, messages.Op, messages.Call, messages.Message, messages.Outcome]
    for cls in unions:
        branches = defs[cls.__name__]["oneOf"]
        assert [b["required"] for b in branches] == [[name] for name in cls.__struct_fields__]
        assert all(list(b["properties"]) == b["required"] and b["additionalProperties"] is False for b in branches)
    assert sorted(n for n, d in defs.items() if "oneOf" in d) == sorted(cls.__name__ for cls in unions)
    assert not any("minProperties" in d or "maxProperties" in d for d in defs.values())


def test_every_definition_has_a_description() -> None:
    defs = SCHEMA["$defs"]
    assert [name for name, d in defs.items() if not d.get("description")] == []
    assert defs["Event"]["description"].startswith("What a session is stepped with; exactly one member.\n\n`Turn`")
    assert defs["Error"]["description"].startswith("The `error` member of an error reply")
    assert all(e["description"] for e in SCHEMA["notifications"].values())


def test_the_core_messages_integers_are_unsigned_64_bit() -> None:
    assert SCHEMA["$defs"]["Turn"]["properties"]["id"] == {"type": "integer", "minimum": 0, "maximum": U64_MAX}
    event = validator("#/event")
    assert event.is_valid({"Cancel": {"turn": U64_MAX}})
    assert not event.is_valid({"Cancel": {"turn": U64_MAX + 1}})
    assert not event.is_valid({"Exec": {"id": -1, "text": "x"}})


def test_the_method_map_is_also_a_type_in_defs_for_generators_that_read_only_defs() -> None:
    defs = SCHEMA["$defs"]
    methods = defs["Methods"]
    assert methods["required"] == list(METHODS) == list(methods["properties"])
    for name, entry in methods["properties"].items():
        assert entry["properties"] == {k: SCHEMA["methods"][name][k] for k in ("params", "result")}
        assert entry["required"] == ["params", "result"]
    assert defs["Notifications"]["properties"] == {
        "session/actions": {"$ref": "#/$defs/StepNotice"},
        "session/unwatched": {"$ref": "#/$defs/UnwatchedNotice"},
        "session/delta": {"$ref": "#/$defs/DeltaNotice"},
        "session/stalled": {"$ref": "#/$defs/StalledNotice"},
        "session/approval": {"$ref": "#/$defs/ApprovalNotice"},
        "session/decided": {"$ref": "#/$defs/DecidedNotice"},
        "session/instructions": {"$ref": "#/$defs/InstructionsNotice"},
        "session/child": {"$ref": "#/$defs/ChildNotice"},
        "session/input": {"$ref": "#/$defs/InputNotice"},
        "session/answered": {"$ref": "#/$defs/AnsweredNotice"},
    }


def test_examples_are_valid_instances_of_their_definitions() -> None:
    examples = {name: d["examples"] for name, d in SCHEMA["$defs"].items() if "examples" in d}
    assert {"Event", "Action", "StepParams", "StepResult", "Error", "StepNotice"} <= set(examples)
    for name, values in examples.items():
        for value in values:
            validator(f"#/$defs/{name}").validate(value)
    assert (len(examples["Event"]), len(examples["Action"])) == (4, 7)


def documented_exchanges() -> tuple[list[tuple[str, Any, Any]], list[Any]]:
    """Every request of docs/protocol.md with its answer (a result or an error), and every notification's params."""
    exchanges: list[tuple[str, Any, Any]] = []
    notices: list[Any] = []
    for block in transcripts(DOC.read_text()):
        sent: dict[tuple[str, Any], dict[str, Any]] = {}
        for connection, arrow, text in block.lines:
            line = json.loads(text) if text.endswith("}") else None
            if line is None:
                continue  # the transcript of a line that is not JSON
            if arrow == ">" and "id" in line:
                sent[connection, line["id"]] = line
            elif arrow == "<" and "method" in line:
                notices.append(line["params"])
            elif arrow == "<" and (connection, line["id"]) in sent:
                request = sent.pop((connection, line["id"]))
                exchanges.append(
                    (request["method"], request.get("params") or {}, line.get("result", line.get("error")))
                )
    return exchanges, notices


def test_every_example_is_an_exchange_of_the_protocol_document() -> None:
    """The schema's examples are docs/protocol.md's, which tests/test_docs.py replays against a real daemon."""
    exchanges, notices = documented_exchanges()
    for example in EXCHANGES:
        result = json.loads(json.dumps(example.result).replace("2026-11-30T12:07:18.912Z", "$TIME"))
        assert (example.method, example.params, result) in exchanges, example.name
    assert ("session/step", ERROR_EXAMPLE) in [(m, r) for m, _, r in exchanges]
    assert json.loads(json.dumps(NOTICE_EXAMPLE).replace("2026-11-30T12:07:18.912Z", "$TIME")) in notices


# -- the OpenRPC document ---------------------------------------------------------------------------------------


def test_devd_schema_openrpc_prints_an_openrpc_document_over_the_same_definitions() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "devd", "schema", "--openrpc"],
        cwd=ROOT,
        env=daemon_env(),
        capture_output=True,
        timeout=30,
        check=True,
    )
    assert printed.stdout == openrpc_json() + b"\n"
    document = json.loads(printed.stdout)
    assert document["openrpc"] == "1.3.2"
    assert [m["name"] for m in document["methods"]] == list(METHODS)
    schemas = document["components"]["schemas"]
    rebased = json.loads(json.dumps(SCHEMA["$defs"]).replace('"#/$defs/', '"#/components/schemas/'))
    assert schemas == {k: v for k, v in rebased.items() if k not in ("Methods", "Notifications")}
    assert {k: e["code"] for k, e in document["components"]["errors"].items()} == {
        k: e["code"] for k, e in SCHEMA["errors"].items()
    }
    assert [n["name"] for n in document["x-notifications"]] == [
        "session/actions",
        "session/unwatched",
        "session/delta",
        "session/stalled",
        "session/approval",
        "session/decided",
        "session/instructions",
        "session/child",
        "session/input",
        "session/answered",
    ]
    refs = re.findall(r'"\$ref": ?"([^"]*)"', json.dumps(document))
    assert refs and all(r.startswith("#/components/schemas/") and r.split("/")[-1] in schemas for r in refs)


def test_openrpc_methods_take_their_params_by_name_with_their_constraints() -> None:
    step = next(m for m in openrpc()["methods"] if m["name"] == "session/step")
    assert step["paramStructure"] == "by-name"
    assert [(p["name"], p["required"]) for p in step["params"]] == [
        ("session", True),
        ("event", True),
        ("timeout_ms", False),
        ("key", False),
    ]
    assert step["params"][1]["schema"] == {"$ref": "#/components/schemas/Event"}
    assert step["params"][3]["description"] == "1-256 bytes of UTF-8"
    assert step["result"]["schema"] == {"$ref": "#/components/schemas/StepResult"}
    for method in openrpc()["methods"]:
        m = METHODS[method["name"]]
        assert [p["name"] for p in method["params"]] == [f.encode_name for f in msgspec.structs.fields(m.params)]


def test_openrpc_examples_are_valid_params_and_results_of_their_method() -> None:
    document = openrpc()
    examples = [(m["name"], e) for m in document["methods"] for e in m.get("examples", [])]
    assert len(examples) == len(EXCHANGES)
    for name, example in examples:
        params = {p["name"]: p["value"] for p in example["params"]}
        validator(method_pointer(name, "params")).validate(params)
        validator(method_pointer(name, "result")).validate(example["result"]["value"])


# -- the TypeScript types ----------------------------------------------------------------------------------------


def test_the_generated_unions_are_unions_of_single_member_objects() -> None:
    """The shape that lets TypeScript narrow with `"Model" in op`."""
    text = typescript()
    assert "export type Outcome =\n  | { Complete: true }\n  | { Cancelled: true };\n" in text
    members = ["{ User: string }", "{ Agent: Agent }", "{ Tool: Tool }", "{ Summary: Summary }"]
    assert "export type Message =\n" + "".join(f"  | {m}\n" for m in members)[:-1] + ";\n" in text
    op = re.search(r"export type Op =\n((?:  \| .*\n)+)", text)
    assert op is not None
    assert op[1].splitlines() == [
        "  | { Model: Ask }",
        "  | { Exec: Exec }",
        "  | { Read: Read }",
        "  | { Write: Write }",
        "  | { Git: Git }",
        "  | { Browse: Browse }",
        "  | { Tool: ToolCall }",
        "  | { Emit: string }",
        "  | { Save: true }",
        "  | { Done: Done };",
    ]
    assert '  "session/step": {\n    params: StepParams;\n    result: StepResult;\n  };\n' in text
    assert '  "session/actions": StepNotice;\n  "session/unwatched": UnwatchedNotice;\n' in text


def test_typescript_members_carry_their_description_and_constraints_as_jsdoc() -> None:
    text = typescript()
    key_doc = "  /**\n   * 1-256 bytes of UTF-8\n   *\n   * @minLength 1\n   * @maxLength 256\n   */\n"
    assert key_doc + "  key?: string | null;\n" in text
    assert "   * @pattern ^(?!\\.\\.?$)[A-Za-z0-9._-]{1,64}$\n" in text
    assert "export interface ErrorCodes {\n" in text and "  BUSY: -32006;\n" in text
    assert "export type ErrorKind = keyof ErrorCodes;\n" in text
    assert len(re.findall(r"^export (?:type|interface) (\w+)", text, re.M)) == len(SCHEMA["$defs"]) + 3


# -- real traffic ------------------------------------------------------------------------------------------------


class Tee:
    """A relay between one client and the daemon's socket, keeping a copy of every line each way: the client under
    test is the real one, unchanged."""

    def __init__(self, daemon: Path, at: Path) -> None:
        self.sent: list[bytes] = []
        self.received: list[bytes] = []
        self.path = at
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(at))
        self._listener.listen(1)
        self._daemon = daemon
        self._relay = threading.Thread(target=self._serve, daemon=True)
        self._relay.start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.connect(str(self._daemon))
            back = threading.Thread(target=_pump, args=(upstream, client, self.received), daemon=True)
            back.start()
            _pump(client, upstream, self.sent)
            back.join(10)

    def lines(self) -> tuple[list[bytes], list[bytes]]:
        """What was sent and received, once the client has closed its connection."""
        self._relay.join(10)
        self._listener.close()
        return self.sent, self.received


def _pump(source: socket.socket, sink: socket.socket, lines: list[bytes]) -> None:
    buffer = b""
    while data := source.recv(65536):
        sink.sendall(data)
        *whole, buffer = (buffer + data).split(b"\n")
        lines += [line + b"\n" for line in whole]
    sink.shutdown(socket.SHUT_WR)


def check_traffic(tee: Tee) -> tuple[set[str], set[str], set[str]]:
    """Validate every line the client sent and received; the methods, notifications and error kinds seen.

    A request the daemon refused as MALFORMED or INVALID_PARAMS must be one the schema refuses too, and a request
    it answered must be one the schema accepts.
    """
    sent, received = tee.lines()
    replies: dict[Any, dict[str, Any]] = {}
    notices, kinds = set(), set()
    for line in received:
        reply = json.loads(line)
        assert reply["jsonrpc"] == "2.0"
        if "method" in reply:
            notices.add(reply["method"])
            validator(f"#/notifications/{reply['method'].replace('/', '~1')}/params").validate(reply["params"])
        else:
            replies[reply["id"]] = reply
    methods = set()
    for line in sent:
        request = json.loads(line)
        assert request["jsonrpc"] == "2.0"
        reply = replies.pop(request["id"])
        kind = reply["error"]["data"]["kind"] if "error" in reply else None
        if kind == "METHOD_NOT_FOUND":
            assert request["method"] not in SCHEMA["methods"]
        elif kind in ("MALFORMED", "INVALID_PARAMS"):
            assert not validator(method_pointer(request["method"], "params")).is_valid(request["params"]), request
        else:
            validator(method_pointer(request["method"], "params")).validate(request["params"])
        if kind is None:
            validator(method_pointer(request["method"], "result")).validate(reply["result"])
            methods.add(request["method"])
        else:
            validator("#/error").validate(reply["error"])
            kinds.add(kind)
    assert replies == {}
    return methods, notices, kinds


def test_a_worked_session_validates_line_by_line(tmp_path: Path) -> None:
    """A turn with two calls, their results and the answer, watched, plus every other method and some errors."""
    path = tmp_path / "run" / "devd.sock"
    with devd(tmp_path) as proc:
        wait_connectable(path, proc).close()
        tapped, watched = Tee(path, tmp_path / "client.sock"), Tee(path, tmp_path / "watcher.sock")
        with Client.connect(tapped.path) as client, Client.connect(watched.path) as watcher:
            client.call("initialize", {"client": {"name": "test_schema", "version": "1"}})
            assert client.new(session="demo") == "demo"
            watcher.call("session/watch", {"session": "demo"})
            client.step("demo", turn(1, "fix the build"))
            calls = client.step(
                "demo", answer(1, calls=[Call(Exec=Exec(argv=["make"])), Call(Read=Read(path="build.log"))])
            )
            assert [a.op.Exec or a.op.Read for a in calls] == [Exec(argv=["make"]), Read(path="build.log")]
            client.step("demo", b'{"Exec":' + msgspec.json.encode(Output(id=calls[0].id, text="error: x")) + b"}")
            client.step("demo", b'{"File":' + msgspec.json.encode(Output(id=calls[1].id, text="x is undefined")) + b"}")
            final = client.step("demo", answer(4, text="fixed"), key="answer-4")
            assert [a.op.Emit for a in final][0] == "fixed"
            assert client.step_result("demo", answer(4, text="fixed"), key="answer-4")["replayed"] is True
            snapshot = client.call("session/snapshot", {"session": "demo"})["snapshot"]
            assert client.call("session/restore", {"snapshot": snapshot, "session": "copy"}) == {"session": "copy"}
            assert client.call("session/recover", {"session": "copy"}) == {"session": "copy"}
            assert client.call("session/pending", {"session": "demo"}) == {"actions": []}
            assert client.call("session/info", {"session": "demo"})["waiting"] == []
            assert client.call("session/agent", {"session": "demo"}) == {"agent": None, "workspace": None}
            assert client.call("session/transcript", {"session": "demo", "from": 4}) == {
                "seq": 5,
                "from": 4,
                "messages": [{"Agent": {"text": "fixed"}}],
            }
            assert client.call("session/fork", {"session": "demo", "at": 2, "as": "fork"}) == {"session": "fork"}
            assert len(client.call("session/pending", {"session": "fork"})["actions"]) == 2
            client.call("session/close", {"session": "fork"})
            assert [s["session"] for s in client.call("session/list")["sessions"]] == ["copy", "demo"]
            assert client.call("daemon/status")["steps"] == 5
            assert client.call("daemon/mcp") == {"servers": []}  # no profile names an MCP server
            assert client.call("session/mcp", {"session": "demo", "mcp_servers": []}) == {}  # it brings none
            backup = str(tmp_path / "state" / "backups" / "backup.sqlite3")
            assert client.call("daemon/backup", {"name": "backup.sqlite3"})["path"] == backup
            with pytest.raises(errors.NullError):
                client.call("daemon/drain")  # not in a fleet
            with pytest.raises(errors.MalformedError):
                client.step("demo", b'{"Turn":{"id":2,"prompt":"x"},"Exec":null}')
            with pytest.raises(errors.MethodNotFoundError):
                client.call("session/nope", {})
            with pytest.raises(errors.InvalidParamsError):
                client.call("session/step", {"session": "demo"})
            with pytest.raises(errors.HandleError):
                client.call("session/snapshot", {"session": "nobody"})
            with pytest.raises(errors.ConflictError):
                client.step("demo", answer(4, text="other"), key="answer-4")
            client.call("session/close", {"session": "copy"})
            client.call("session/close", {"session": "demo"})
            notices = [watcher.wait_notification() for _ in range(6)]
            assert [(n.method, n.params["seq"]) for n in notices] == [
                *[("session/actions", seq) for seq in range(1, 6)],
                ("session/unwatched", 5),
            ]
            watcher.call("session/unwatch", {"session": "demo"})
        sent_methods, notice_methods, kinds = check_traffic(tapped)
        watcher_methods, watcher_notices, _ = check_traffic(watched)
        assert stop(proc) == 0
    # daemon/drain answers only in a fleet (tests/test_fleet.py); here it is refused, as NULL.
    assert sent_methods | watcher_methods == set(SCHEMA["methods"]) - {"daemon/drain"} - OVERSIGHT_METHODS
    assert watcher_notices == set(SCHEMA["notifications"]) - OVERSIGHT_NOTICES
    assert notice_methods == set()
    assert kinds == {"MALFORMED", "METHOD_NOT_FOUND", "INVALID_PARAMS", "HANDLE", "CONFLICT", "NULL"}
