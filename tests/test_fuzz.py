"""Property-based fuzzing (hypothesis) of everything that reads untrusted bytes: line framing, request decoding,
method params, a connection's rules, and the core's event and snapshot decoders. Each test states one property that
must hold for every input it is given.

The default profile ("ci") is bounded and derandomized, so a CI run is reproducible (about 25 s on 2 cores). The
long run draws 20 times as many examples from fresh random seeds (about 5-8 minutes):

    DEVD_FUZZ=long .venv/bin/python -m pytest -q tests/test_fuzz.py

A property that found a bug in devd keeps the failing input as an explicit `@example` and is marked xfail(strict)
until the bug is fixed; beside it, a narrower property without that input keeps guarding everything else.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import zlib
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from msgspec import Raw

from devd import errors
from devd.config import Settings
from devd.errors import InvalidParamsError, MalformedError, MethodNotFoundError, NullError
from devd.host import Core, Instance
from devd.messages import (
    Browse,
    Call,
    Cancel,
    Event,
    Exec,
    Git,
    Output,
    Read,
    Write,
    answer,
    decode_actions,
    encode,
    turn,
)
from devd.protocol import SEQ_MAX
from devd.server.connection import Event as ConnectionEvent
from devd.server.connection import Rules
from devd.server.framing import TOO_LONG, LineFramer, TooLong
from devd.server.methods import METHODS, resolve
from devd.server.rpc import (
    Request,
    RequestError,
    decode_request,
    error_response,
    response,
)

# -- profiles -------------------------------------------------------------------------------------------------------

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
settings.register_profile("long", settings.get_profile("ci"), max_examples=2000, derandomize=False)
PROFILE = settings.get_profile(os.environ.get("DEVD_FUZZ", "ci"))


def fuzz(examples: int) -> settings:
    """The chosen profile, with `examples` examples under "ci" and as many times more as the profile has."""
    return settings(PROFILE, max_examples=examples * PROFILE.max_examples // 100)


# -- JSON as sent, not as a dict: duplicate members, any order, lone surrogates, NaN --------------------------------


class Obj(list[tuple[str, Any]]):
    """A JSON object as its members in order; unlike a dict it can say `{"a":1,"a":2}`."""


class Number(str):
    """A JSON number written as is: out of every range (1e400), or spelled as Python never writes one (-0, 1E+2)."""


def render(value: Any, *, ascii: bool) -> bytes:
    """The JSON text of value: non-ASCII escaped (ascii) or as raw UTF-8, where a lone surrogate is invalid UTF-8."""
    return _render(value, ascii).encode("utf-8", "surrogatepass")


def _render(value: Any, ascii: bool) -> str:
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=ascii)}:{_render(v, ascii)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_render(v, ascii) for v in value) + "]"
    if isinstance(value, Number):
        return value
    return json.dumps(value, ensure_ascii=ascii)  # floats may be NaN and Infinity, which JSON has not


def to_obj(value: Any) -> Any:
    """msgspec builtins as the JSON model above."""
    if isinstance(value, dict):
        return Obj((k, to_obj(v)) for k, v in value.items())
    if isinstance(value, list):
        return [to_obj(v) for v in value]
    return value


TRICKY_TEXT = st.sampled_from(
    ["", "2.0", "\x00", "\ufeff", "\u2028", "\\", '"', "\n", "é", "\U0001f600", "\ud800", "\udfff", "\udc00\ud800"]
)
TEXT = st.one_of(
    st.text(max_size=12), st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=6), TRICKY_TEXT
)
INTS = st.one_of(
    st.integers(-3, 10),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
    st.integers(),
)
NUMBERS = st.sampled_from(["1e400", "-1e400", "1e-400", "-0", "1E+2", "0.0e0", "1" * 30, "-" + "9" * 400]).map(Number)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(), NUMBERS, TEXT)


def objects(values: st.SearchStrategy[Any], keys: st.SearchStrategy[str] = TEXT) -> st.SearchStrategy[Obj]:
    return st.lists(st.tuples(keys, values), max_size=4).map(Obj)


VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | objects(kids), max_leaves=10)


def one_json_line(line: bytes) -> Any:
    """The value of a reply, which must be exactly one line of JSON."""
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    return msgspec.json.decode(line)


# -- 1. framing -----------------------------------------------------------------------------------------------------


def frame(limit: int, chunks: list[bytes]) -> tuple[list[bytes | TooLong], int]:
    """What a LineFramer yields for chunks, and what it holds after; checks the bound after every step."""
    framer, got = LineFramer(limit), []
    for chunk in chunks:
        for item in framer.feed(chunk, 0.0):
            assert framer.pending_bytes <= limit
            got.append(item)
        assert framer.pending_bytes <= limit
    return got, framer.pending_bytes


def reference_frame(limit: int, stream: bytes) -> tuple[list[bytes | TooLong], int]:
    """The lines of stream, an over-long one as TOO_LONG; an unfinished tail is held, or TOO_LONG once too long."""
    *lines, tail = stream.split(b"\n")
    got: list[bytes | TooLong] = [line if len(line) <= limit else TOO_LONG for line in lines]
    if len(tail) > limit:
        return [*got, TOO_LONG], 0
    return got, len(tail)


CHUNKS = st.one_of(
    st.just(b"\n"),
    st.binary(max_size=12),
    st.sampled_from([b"x" * n for n in (3, 8, 9, 17, 40)]),
    st.sampled_from([b"ab\ncd", b"\n\n", b"0123456789\n", b"\r\n"]),
)


@fuzz(500)
@given(limit=st.integers(0, 12), chunks=st.lists(CHUNKS.filter(len), max_size=24))
def test_framing_yields_the_lines_of_the_stream_however_it_is_chunked_and_holds_at_most_the_limit(
    limit: int, chunks: list[bytes]
) -> None:
    assert frame(limit, chunks) == reference_frame(limit, b"".join(chunks))


@fuzz(500)
@example(limit=8, chunks=[b""])
@given(limit=st.integers(0, 12), chunks=st.lists(CHUNKS, max_size=24))
def test_framing_of_any_chunks_empty_ones_included_yields_the_lines_of_the_stream(
    limit: int, chunks: list[bytes]
) -> None:
    assert frame(limit, chunks) == reference_frame(limit, b"".join(chunks))


# -- 2. request decoding --------------------------------------------------------------------------------------------

MEMBERS = ("jsonrpc", "method", "id", "params")


@st.composite
def envelopes(draw: st.DrawFn) -> Obj:
    """A JSON-RPC request object, each member present or not, valid or any JSON, with extra and repeated members."""
    valid = {
        "jsonrpc": st.just("2.0"),
        "method": st.one_of(st.sampled_from(sorted(METHODS)), st.text(max_size=12)),
        "id": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=12)),
        "params": VALUES,
    }
    invalid = {
        "jsonrpc": st.one_of(st.sampled_from(["2", "2.00", "1.0", " 2.0"]), VALUES),
        "method": st.one_of(TEXT, VALUES),
        "id": st.one_of(INTS, TEXT, VALUES),
        "params": VALUES,
    }
    members = []
    for name in MEMBERS:
        presence = draw(st.sampled_from(["valid", "valid", "valid", "invalid", "absent"]))
        if presence != "absent":
            members.append((name, draw((valid if presence == "valid" else invalid)[name])))
    if draw(st.booleans()):
        members += draw(st.lists(st.tuples(st.one_of(st.sampled_from(MEMBERS), TEXT), VALUES), min_size=1, max_size=3))
    return Obj(draw(st.permutations(members)))


@st.composite
def nested(draw: st.DrawFn) -> bytes:
    """A request with one member nested deep, closed or not."""
    depth = draw(st.sampled_from([2, 64, 1000, 100_000]))
    member = draw(st.sampled_from(MEMBERS))
    value = b"[" * depth + (b"]" * depth if draw(st.booleans()) else b"")
    return b'{"jsonrpc":"2.0","method":"x","id":1,"' + member.encode() + b'":' + value + b"}"


@st.composite
def request_lines(draw: st.DrawFn) -> bytes:
    value = draw(st.one_of(envelopes(), envelopes(), envelopes(), VALUES, st.lists(envelopes(), max_size=2)))
    line = render(value, ascii=draw(st.booleans()))
    damage = draw(st.sampled_from(["none", "none", "none", "escape", "truncate", "insert"]))
    at = draw(st.integers(0, len(line)))
    if damage == "escape":  # the same text, written with JSON escapes
        line = line.replace(b'"2.0"', b'"\\u0032.0"').replace(b'"id"', b'"\\u0069d"')
    elif damage == "truncate":
        line = line[:at]
    elif damage == "insert":
        line = line[:at] + draw(st.binary(min_size=1, max_size=3)) + line[at:]
    return line


LINES = st.one_of(st.binary(max_size=64), request_lines(), nested())


@fuzz(800)
@given(line=LINES)
def test_any_line_decodes_to_a_request_or_a_request_error_and_either_is_answered_in_one_json_line_with_its_id(
    line: bytes,
) -> None:
    try:
        request = decode_request(line)
    except RequestError as refused:
        e = refused.error
        event(f"refused: {e.kind}")
        assert type(refused.id) in (int, str, type(None))
        assert one_json_line(error_response(refused.id, e)) == {
            "jsonrpc": "2.0",
            "id": refused.id,
            "error": {"code": e.code, "message": str(e), "data": {"kind": e.kind}},
        }
    else:
        event("a request")
        assert type(request.id) in (int, str, type(None)) and type(request.method) is str
        assert one_json_line(response(request.id, None)) == {"jsonrpc": "2.0", "id": request.id, "result": None}


WIRE_IDS = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text())
JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(),
    ),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4),
    max_leaves=10,
)


@fuzz(300)
@given(id=WIRE_IDS, method=st.text(), params=JSON, notification=st.booleans())
def test_a_well_formed_request_decodes_to_its_id_method_and_params_bytes(
    id: int | str | None, method: str, params: Any, notification: bool
) -> None:
    envelope = {"jsonrpc": "2.0", "method": method, "params": params} | ({} if notification else {"id": id})
    request = decode_request(msgspec.json.encode(envelope))
    assert (request.id, request.method, bytes(request.params), request.notification) == (
        None if notification else id,
        method,
        msgspec.json.encode(params),
        notification,
    )


def error_classes(root: type[errors.DevdError] = errors.DevdError) -> Iterator[type[errors.DevdError]]:
    for cls in root.__subclasses__():
        yield cls
        yield from error_classes(cls)


@fuzz(200)
@given(id=WIRE_IDS, kind=st.sampled_from(sorted(set(error_classes()), key=lambda c: c.__name__)), message=st.text())
def test_an_error_reply_is_one_json_line_with_its_id_code_message_and_kind(
    id: int | str | None, kind: type[errors.DevdError], message: str
) -> None:
    # MOVED also names the daemon that holds the session: null when it was raised without one.
    data = {"kind": kind.kind, "owner": None} if kind is errors.MovedError else {"kind": kind.kind}
    assert one_json_line(error_response(id, kind(message))) == {
        "jsonrpc": "2.0",
        "id": id,
        "error": {"code": kind.code, "message": message, "data": data},
    }


# -- 3. method params -----------------------------------------------------------------------------------------------


def field_names(method: str) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(METHODS[method].params)}


FIELD_NAMES = sorted(set().union(*(field_names(m) for m in METHODS)))
SESSION_NAMES = st.text("abcXYZ019._-", min_size=1, max_size=66)  # "." and ".." and too long among them
SPECIAL_PARAMS = st.sampled_from(
    ["a/b", "", "x" * 257, "é" * 129, 0, -1, 1.5, SEQ_MAX, SEQ_MAX + 1, Obj([("Timer", True)])]
)


def field_values(values: st.SearchStrategy[Any], text: st.SearchStrategy[str]) -> dict[str, st.SearchStrategy[Any]]:
    """Values for the members of methods' params, mostly valid ones (a member not named here gets any value)."""
    return {
        "session": SESSION_NAMES,
        "as": SESSION_NAMES,
        "config": st.sampled_from([None, Obj([]), Obj([("model", "zen5")]), Obj([("model", "zen5"), ("x", 1)])]),
        "client": st.sampled_from([None, Obj([("name", "cli")]), Obj([("name", "cli"), ("version", "1")]), Obj([])]),
        "token": st.none() | text,
        "event": values,
        "timeout_ms": st.none() | st.integers(-1, 2**64),
        "key": st.none() | text | st.sampled_from(["x" * 256, "x" * 257, "é" * 128, "é" * 129]),
        "since": st.none() | INTS,
        "at": st.none() | INTS,
        "snapshot": text,
        "limit": st.none() | st.sampled_from([0, 1, 100_000, 100_001]) | INTS,
        "cursor": st.none() | text,
    }


CLEAN_SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), st.text())
CLEAN_VALUES = st.recursive(
    CLEAN_SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4).map(to_obj)
)


@st.composite
def method_params(draw: st.DrawFn, clean: bool) -> tuple[str, Any]:
    """A method (mostly one devd has) and params: its own members, mostly valid, sometimes more, sometimes not an
    object. Unless `clean`, members repeat and values may be what msgspec cannot read as plain JSON (NaN, 1e400,
    lone surrogates, which are invalid UTF-8 when not escaped)."""
    values, text = (CLEAN_VALUES, st.text(max_size=12)) if clean else (VALUES, TEXT)
    any_value, own_value = st.one_of(values, SESSION_NAMES, SPECIAL_PARAMS), field_values(values, text)
    method = draw(st.sampled_from(sorted(METHODS)) if draw(st.integers(0, 3)) else text)
    fields = sorted(field_names(method)) if method in METHODS else []
    members = [
        (f, draw(st.one_of(own_value.get(f, any_value), own_value.get(f, any_value), any_value)))
        for f in fields
        if draw(st.integers(0, 2))
    ]
    if not draw(st.integers(0, 3)):
        members += draw(st.lists(st.tuples(st.one_of(st.sampled_from(FIELD_NAMES), text), any_value), max_size=2))
    if clean:
        members = list({name: (name, value) for name, value in reversed(members)}.values())
    if not draw(st.integers(0, 4)):
        return method, draw(st.one_of(CLEAN_SCALARS, st.lists(CLEAN_SCALARS, max_size=3)) if clean else VALUES)
    return method, Obj(draw(st.permutations(members)))


def resolve_or_refuse(method: str, raw: bytes) -> None:
    """resolve succeeds with the method's params, or refuses as METHOD_NOT_FOUND / INVALID_PARAMS, nothing else."""
    try:
        m, params = resolve(METHODS, Request(method, Raw(raw), 1, False))
    except MethodNotFoundError:
        event("METHOD_NOT_FOUND")
        assert method not in METHODS
    except InvalidParamsError as e:
        event("INVALID_PARAMS")
        assert method in METHODS
        assert one_json_line(error_response(1, e))["error"]["code"] == -32602
    else:
        event("params")
        assert m is METHODS[method] and type(params) is m.params


@fuzz(500)
@example(call=("session/close", Obj([("session", "a/b"), ("session", None)])), ascii=True)
@example(call=("session/fork", Obj([("session", "a/b"), ("at", Number("1e400"))])), ascii=True)
@given(call=method_params(clean=False), ascii=st.booleans())
def test_resolve_answers_params_or_refuses_them_as_method_not_found_or_invalid_params(
    call: tuple[str, Any], ascii: bool
) -> None:
    method, params = call
    resolve_or_refuse(method, render(params, ascii=ascii))


@fuzz(500)
@given(call=method_params(clean=True), ascii=st.booleans())
def test_resolve_answers_plain_json_params_without_repeats_or_refuses_them_as_method_not_found_or_invalid_params(
    call: tuple[str, Any], ascii: bool
) -> None:
    method, params = call
    resolve_or_refuse(method, render(params, ascii=ascii))


REQUIRED_VALUES = {
    "session": "a",
    "event": Obj([("Timer", True)]),
    "snapshot": "REVWRA==",
    "path": "/tmp/b",
    "prompt": "hello",
    "action": 2,
    "digest": "0" * 64,
    "decision": "allow",
    "tokens": 1000,
    "title": "the build",
    "turn": 1,
    "model": "m",
    "mcp_servers": [],
    "parent": "a",  # session/spawn
    "id": "run-1",
    "agent": "reviewer",
    "task": "review it",
    "request": 1,
}


def valid_params(method: str) -> list[tuple[str, Any]]:
    """The method's required members, each with a valid value."""
    fields = msgspec.structs.fields(METHODS[method].params)
    return [(f.encode_name, REQUIRED_VALUES[f.encode_name]) for f in fields if f.required]


def refuse_unknown(method: str, name: str, value: Any, at: int) -> None:
    assume(name not in field_names(method))
    members = valid_params(method)
    members.insert(at % (len(members) + 1), (name, value))
    with pytest.raises(InvalidParamsError) as refused:
        resolve(METHODS, Request(method, Raw(render(Obj(members), ascii=True)), 1, False))
    assert str(refused.value) == f"bad params for {method}: Object contains unknown field `{name}`"


@fuzz(300)
@given(
    method=st.sampled_from(sorted(METHODS)),
    name=st.text(max_size=12).filter(lambda n: "`" not in n),
    value=VALUES,
    at=st.integers(0, 3),
)
def test_an_unknown_member_is_refused_as_invalid_params_naming_it(method: str, name: str, value: Any, at: int) -> None:
    refuse_unknown(method, name, value, at)


@fuzz(300)
@example(method="session/close", name="x - at `$.session", value=1, at=1)
@given(
    method=st.sampled_from(sorted(METHODS)),
    name=st.one_of(st.text(max_size=12), st.sampled_from(FIELD_NAMES).map(lambda f: f"x - at `$.{f}")),
    value=VALUES,
    at=st.integers(0, 3),
)
def test_an_unknown_member_of_any_name_is_refused_as_invalid_params_naming_it(
    method: str, name: str, value: Any, at: int
) -> None:
    refuse_unknown(method, name, value, at)


# -- 4. connection rules --------------------------------------------------------------------------------------------

TOKEN = "t0k"
RULES_SETTINGS = Settings(
    state_dir=Path("/tmp"), socket_path=None, line_bytes_max=160, auth_line_bytes_max=96, auth_timeout_s=5.0
)
HTTP = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
HELLO = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"token":"t0k"}}'
RULES_LINES = st.one_of(
    st.sampled_from(
        [
            HELLO,
            b'{"jsonrpc":"2.0","id":"a","method":"initialize","params":{"token":"nope"}}',
            b'{"jsonrpc":"2.0","method":"initialize","params":{"token":"t0k"}}',
            b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":null}',
            b'{"jsonrpc":"2.0","id":2,"method":"session/list"}',
            b"",
            b"  ",
            b"\r",
            b"x" * 100,
            b"x" * 200,
        ]
    ),
    st.binary(max_size=24),
    request_lines(),
)
HTTP_LINES = st.sampled_from([b"GET / HTTP/1.1\r", b"  POST /rpc HTTP/1.1\r", b"G", b"HEAD "])


def rules_streams(lines: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Lines, each ended or not; half the streams open with initialize and the token."""
    line = st.tuples(lines, st.sampled_from([b"\n", b"\n", b""])).map(b"".join)
    return st.tuples(st.sampled_from([b"", HELLO + b"\n"]), st.lists(line, max_size=6).map(b"".join)).map(b"".join)


def receive(stream: bytes, cuts: list[int], tcp: bool) -> tuple[list[ConnectionEvent], bool, bool, float]:
    """The events of stream received in chunks split at cuts, and the state the rules end in."""
    rules = Rules(RULES_SETTINGS, authenticated=not tcp, token=TOKEN if tcp else None, now=0.0)
    edges = [0, *sorted(cuts), len(stream)]
    events = [e for a, b in pairwise(edges) for e in rules.receive(stream[a:b], 0.0)]
    return events, rules.closed, rules.authenticated, rules.deadline()


@fuzz(300)
@given(stream=rules_streams(RULES_LINES), cuts=st.lists(st.integers(1, 4000), max_size=8), tcp=st.booleans())
def test_a_connection_answers_the_same_events_however_its_bytes_are_chunked(
    stream: bytes, cuts: list[int], tcp: bool
) -> None:
    assume(not stream.lstrip().startswith(HTTP))  # the HTTP sniff has a test of its own, below
    cuts = sorted({c for c in cuts if c < len(stream)})
    whole = receive(stream, [], tcp)
    event(f"{'tcp' if tcp else 'unix'}: {'closed' if whole[1] else 'open'}, {len(whole[0])} events")
    assert receive(stream, cuts, tcp) == whole
    assert receive(stream, list(range(1, min(len(stream), 1000))), tcp) == whole  # one byte at a time (at first)


@fuzz(300)
@example(stream=b"GET / HTTP/1.1\r\n\r\n", cuts=[1], tcp=False)
@given(
    stream=rules_streams(st.one_of(HTTP_LINES, RULES_LINES)),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
    tcp=st.booleans(),
)
def test_a_connection_that_opens_like_http_is_closed_however_its_bytes_are_chunked(
    stream: bytes, cuts: list[int], tcp: bool
) -> None:
    cuts = [c for c in cuts if c <= len(stream)]  # repeated cuts are empty chunks
    assert receive(stream, cuts, tcp) == receive(stream, [], tcp)


# -- 5. the core's event decoder ------------------------------------------------------------------------------------

IDS = st.one_of(st.integers(0, 6), st.sampled_from([2**32, 2**63 - 1, 2**64 - 1]))
WORDS = st.text(max_size=10)
ARGV = st.lists(WORDS, max_size=3)
CALLS = st.one_of(
    st.builds(lambda argv: Call(Exec=Exec(argv=argv)), ARGV),
    st.builds(lambda path: Call(Read=Read(path=path)), WORDS),
    st.builds(lambda path, text: Call(Write=Write(path=path, text=text)), WORDS, WORDS),
    st.builds(lambda argv: Call(Git=Git(argv=argv)), ARGV),
    st.builds(lambda url: Call(Browse=Browse(url=url)), WORDS),
)
OUTPUTS = st.builds(Output, id=IDS, text=WORDS, failed=st.booleans())
EVENTS = st.one_of(
    st.builds(turn, IDS, WORDS),
    st.builds(answer, IDS, WORDS, st.none() | st.lists(CALLS, max_size=3)),
    st.builds(lambda family, out: Event(**{family: out}), st.sampled_from(["Exec", "File", "Git", "Browse"]), OUTPUTS),
    st.builds(lambda t: Event(Cancel=Cancel(turn=t)), IDS),
    st.just(Event(Timer=True)),
)
EVENT_NAMES = st.sampled_from(
    ["Turn", "Model", "Exec", "File", "Git", "Browse", "Cancel", "Timer", "Read", "Write"]
    + ["id", "prompt", "reply", "text", "calls", "argv", "path", "url", "failed", "turn"]
)


def nodes(value: Any, at: tuple[int, ...] = ()) -> Iterator[tuple[int, ...]]:
    """The path of every value in a JSON tree (an Obj's members and a list's items by index)."""
    yield at
    if isinstance(value, Obj):
        for i, (_, v) in enumerate(value):
            yield from nodes(v, (*at, i))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from nodes(v, (*at, i))


@st.composite
def mutated_events(draw: st.DrawFn) -> Any:
    """A valid event with one to three members renamed, dropped, added, repeated, rewrapped or given other values."""
    tree = to_obj(msgspec.to_builtins(draw(EVENTS)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(nodes(tree))))
        parent = None if not path else _node(tree, path[:-1])
        node = _node(tree, path)
        op = draw(st.sampled_from(["value", "number", "rename", "drop", "add", "repeat", "wrap"]))
        if op in ("value", "number", "wrap"):
            if op == "value":
                new = draw(VALUES)
            elif op == "number":
                new = draw(st.one_of(INTS, st.floats(), st.sampled_from([True, "1", [1]])))
            else:
                new = draw(st.sampled_from([[node], Obj([(draw(EVENT_NAMES), node)])]))
            if parent is None:
                tree = new
            elif isinstance(parent, Obj):
                parent[path[-1]] = (parent[path[-1]][0], new)
            else:
                parent[path[-1]] = new
        elif isinstance(node, (Obj, list)):
            i = draw(st.integers(0, len(node)))
            member = draw(st.tuples(st.one_of(EVENT_NAMES, TEXT), VALUES))
            if op == "add" or not node:
                node.insert(i, member if isinstance(node, Obj) else member[1])
            elif op == "rename" and isinstance(node, Obj):
                node[i % len(node)] = (member[0], node[i % len(node)][1])
            elif op == "repeat":
                node.insert(i, copy.deepcopy(node[i % len(node)]))
            else:
                del node[i % len(node)]
    return tree


def _node(tree: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        tree = tree[i][1] if isinstance(tree, Obj) else tree[i]
    return tree


@st.composite
def deep_events(draw: st.DrawFn) -> bytes:
    """An event with something nested deep (closed or not), or one long string, all under 64 KiB."""
    where = draw(
        st.sampled_from(
            [
                b"%s",
                b'{"Turn":{"id":1,"prompt":%s}}',
                b'{"Turn":{"id":1,"prompt":"x","extra":%s}}',
                b'{"Model":{"id":1,"reply":{"calls":[{"Exec":{"argv":%s}}]}}}',
                b'{"Exec":{"id":2,"text":%s}}',
            ]
        )
    )
    room = 64 * 1024 - 1 - len(where)
    kind = draw(st.sampled_from(["[", "{", "string"]))
    if kind == "string":
        piece = draw(st.sampled_from([b"a", b"\\u00e9", b"\\n", "é".encode()]))
        return where.replace(b"%s", b'"' + piece * ((room - 2) // len(piece)) + b'"')
    opener, closer = (b"[", b"]") if kind == "[" else (b'{"a":', b"}")
    depth = min(draw(st.sampled_from([64, 1000, 100_000])), (room - 1) // (len(opener) + len(closer)))
    inner = opener * depth + b"1" + (closer * depth if draw(st.booleans()) else b"")
    return where.replace(b"%s", inner)


EVENT_BYTES = st.one_of(
    st.binary(max_size=256),
    st.builds(render, mutated_events(), ascii=st.booleans()),
    EVENTS.map(encode),
    deep_events(),
)
FIX = "fix the build"
PRIMES = {
    "fresh": [],
    "asking": [turn(1, FIX)],
    "calls": [turn(1, FIX), answer(1, calls=[Call(Exec=Exec(argv=["make"])), Call(Read=Read(path="Makefile"))])],
    "queued": [turn(1, FIX), turn(2, "and test it")],
}


@fuzz(400)
@given(prime=st.sampled_from(sorted(PRIMES)), data=EVENT_BYTES)
def test_the_core_answers_any_event_with_actions_or_refuses_it_unchanged_and_never_traps(
    core: Core, prime: str, data: bytes
) -> None:
    assert len(data) < 64 * 1024
    session = core.new()
    try:
        for primer in PRIMES[prime]:
            session.step(primer)
        before = session.snapshot()
        try:
            actions = session.step_raw(data)  # PanicError / PoisonError, HandleError and DeadlineError all fail it
        except (MalformedError, NullError) as e:
            event(f"{prime}: {e.kind}")
            assert session.snapshot() == before
        else:
            event(f"{prime}: answered")
            assert b"\n" not in actions
            decode_actions(actions)  # one JSON array of the protocol's actions
    finally:
        session.close()


# -- 6. the core's snapshot decoder ---------------------------------------------------------------------------------

FAMILY = {"Exec": "Exec", "Read": "File", "Write": "File", "Git": "Git", "Browse": "Browse"}
MOVES = st.lists(
    st.tuples(
        st.sampled_from(["turn", "answer", "result", "cancel"]), WORDS, st.lists(CALLS, max_size=2), st.booleans()
    ),
    max_size=10,
)


def drive(session: Instance, moves: list[tuple[str, str, list[Call], bool]]) -> None:
    """Step a session through a plausible history: turns, answers to its asks, results of its calls, cancels."""
    next_turn = 1
    for move, text, calls, failed in moves:
        pending = decode_actions(session.pending())
        asks = [a for a in pending if a.op.Model is not None]
        waits = [a for a in pending if a.op.Model is None]
        if move == "turn":
            session.step(turn(next_turn, text))
            next_turn += 1
        elif move == "answer" and asks:
            session.step(answer(asks[0].id, text, calls or None))
        elif move == "result" and waits:
            op = next(f for f in FAMILY if getattr(waits[0].op, f) is not None)
            session.step(Event(**{FAMILY[op]: Output(id=waits[0].id, text=text, failed=failed)}))
        elif move == "cancel":
            session.step(Event(Cancel=Cancel(turn=next_turn - 1)))


def snapshot_of(core: Core, moves: list[tuple[str, str, list[Call], bool]]) -> bytes:
    session = core.new()
    try:
        drive(session, moves)
        return session.snapshot()
    finally:
        session.close()


def seal(body: bytes) -> bytes:
    """A snapshot frame around body, with a matching length and CRC-32: past the checksum, to the field checks."""
    head = b"DEVD" + struct.pack("<II", 1, len(body)) + body
    return head + struct.pack("<I", zlib.crc32(head))


DAMAGE = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(0, 7)),
        st.tuples(st.just("fill"), st.integers(0, 1 << 16), st.integers(1, 8), st.sampled_from([0x00, 0x01, 0xFF])),
        st.tuples(st.just("cut"), st.integers(0, 1 << 16)),
        st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 8)),
    ),
    min_size=1,
    max_size=3,
)


def damage(data: bytes, ops: list[tuple[Any, ...]]) -> bytes:
    """data with each op applied at its offset modulo the length so far."""
    b = bytearray(data)
    for name, offset, *args in ops:
        at = offset % (len(b) + 1)
        if name == "flip" and at < len(b):
            b[at] ^= 1 << args[0]
        elif name == "fill":
            b[at : at + args[0]] = bytes([args[1]]) * len(b[at : at + args[0]])
        elif name == "cut":
            del b[at:]
        elif name == "insert":
            b[at:at] = args[0]
        elif name == "delete":
            del b[at : at + args[0]]
    return bytes(b)


def restore_or_refuse(core: Core, data: bytes) -> Instance | None:
    """The session restored from data, whose own snapshot must be data again; None when data is malformed."""
    try:
        restored = core.restore(data)  # anything but MalformedError (a trap, a deadline) fails the property
    except MalformedError:
        event("MALFORMED")
        return None
    event("restored")
    assert restored.snapshot() == data
    return restored


@fuzz(300)
@given(data=st.one_of(st.binary(max_size=256), st.binary(max_size=128).map(seal), st.binary().map(b"DEVD".__add__)))
def test_restoring_any_bytes_is_malformed_unless_they_are_a_snapshot(core: Core, data: bytes) -> None:
    restored = restore_or_refuse(core, data)
    if restored is not None:
        restored.close()


@fuzz(300)
@example(moves=[("turn", "fix", [], False)], ops=[("fill", 1, 8, 0xFF)], resealed=True)  # an id counter of 2**64-1
@given(moves=MOVES, ops=DAMAGE, resealed=st.booleans())
def test_a_damaged_snapshot_is_malformed_or_restores_to_exactly_itself_and_steps_a_turn(
    core: Core, moves: list[tuple[str, str, list[Call], bool]], ops: list[tuple[Any, ...]], resealed: bool
) -> None:
    state = snapshot_of(core, moves)
    data = seal(damage(state[12:-4], ops)) if resealed else damage(state, ops)
    event(f"{'resealed' if resealed else 'damaged'}{'' if data != state else ', yet unchanged'}")
    if not resealed and data != state:
        with pytest.raises(MalformedError):
            core.restore(data)
        return
    restored = restore_or_refuse(core, data)
    if restored is not None:
        try:
            decode_actions(restored.step_raw(encode(turn(2**64 - 1, FIX))))  # never a trap
        finally:
            restored.close()


@fuzz(200)
@given(moves=MOVES)
def test_a_snapshot_restores_to_a_session_that_steps_a_turn_as_the_original_does(
    core: Core, moves: list[tuple[str, str, list[Call], bool]]
) -> None:
    original = core.new()
    try:
        drive(original, moves)
        state = original.snapshot()
        restored = core.restore(state)
        try:
            assert (restored.snapshot(), restored.pending()) == (state, original.pending())
            next_turn = encode(turn(1000, FIX))
            assert restored.step_raw(next_turn) == original.step_raw(next_turn)
        finally:
            restored.close()
    finally:
        original.close()
