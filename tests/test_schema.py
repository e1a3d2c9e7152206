"""devd.schema: its shape, and every line of a real session (requests, results, errors, notifications) validated
against it, so the schema a client generator reads is the protocol the daemon speaks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from devd import errors
from devd.client import Client, Reply
from devd.messages import Call, Exec, Output, Read, answer, turn
from devd.methods import METHODS
from devd.schema import schema, schema_json
from tests.daemon import ROOT, daemon_env, devd, stop, wait_connectable

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
    assert list(SCHEMA["notifications"]) == ["session/actions", "session/unwatched"]
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
    assert not event.is_valid({})
    assert not event.is_valid({"Model": {"id": 1, "reply": {"text": None}}})
    assert validator("#/action").is_valid({"id": 6, "op": {"Save": True}})


# -- real traffic ------------------------------------------------------------------------------------------------


class _Tap:
    """The client's socket, keeping a copy of every line sent."""

    def __init__(self, sock: socket.socket, sent: list[bytes]) -> None:
        self._sock = sock
        self._sent = sent

    def sendall(self, data: bytes) -> None:
        self._sent.append(data)
        self._sock.sendall(data)

    def close(self) -> None:
        self._sock.close()

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)


class Recording(Client):
    """A devd Client that keeps every line it sends and receives."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.sent: list[bytes] = []
        self.received: list[bytes] = []
        self._sock = _Tap(sock, self.sent)  # type: ignore[assignment]

    def read_reply(self) -> Reply:
        line = self._file.readline()
        if not line:
            raise ConnectionError("the daemon closed the connection")
        self.received.append(line)
        return msgspec.json.decode(line, type=Reply)


def check_traffic(client: Recording) -> tuple[set[str], set[str], set[str]]:
    """Validate every line the client sent and received; the methods, notifications and error kinds seen.

    A request the daemon refused as MALFORMED or INVALID_PARAMS must be one the schema refuses too, and a request
    it answered must be one the schema accepts.
    """
    replies: dict[Any, dict[str, Any]] = {}
    notices, kinds = set(), set()
    for line in client.received:
        reply = json.loads(line)
        assert reply["jsonrpc"] == "2.0"
        if "method" in reply:
            notices.add(reply["method"])
            validator(f"#/notifications/{reply['method'].replace('/', '~1')}/params").validate(reply["params"])
        else:
            replies[reply["id"]] = reply
    methods = set()
    for line in client.sent:
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
        with Recording.connect(path) as client, Recording.connect(path) as watcher:
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
            assert client.call("session/fork", {"session": "demo", "at": 2, "as": "fork"}) == {"session": "fork"}
            assert len(client.call("session/pending", {"session": "fork"})["actions"]) == 2
            client.call("session/close", {"session": "fork"})
            assert [s["session"] for s in client.call("session/list")["sessions"]] == ["copy", "demo"]
            assert client.call("daemon/status")["steps"] == 5
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
            sent_methods, notice_methods, kinds = check_traffic(client)
            watcher_methods, watcher_notices, _ = check_traffic(watcher)
        assert stop(proc) == 0
    assert sent_methods | watcher_methods == set(SCHEMA["methods"])
    assert watcher_notices == set(SCHEMA["notifications"])
    assert notice_methods == set()
    assert kinds == {"MALFORMED", "METHOD_NOT_FOUND", "INVALID_PARAMS", "HANDLE", "CONFLICT"}
