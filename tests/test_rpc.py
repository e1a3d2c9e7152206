"""JSON-RPC request decoding and answers, pure: a line's bytes in, requests and errors out (no sockets)."""

from __future__ import annotations

import msgspec
import pytest

from devd import errors
from devd.protocol import StepParams, StepResult
from devd.server.methods import METHODS, resolve
from devd.server.rpc import RequestError, decode_request, error_response, response


def decode_params(request: object) -> object:
    return resolve(METHODS, request)[1]  # type: ignore[arg-type]


def test_a_request_keeps_its_params_raw() -> None:
    request = decode_request(
        b'{"jsonrpc":"2.0","id":3,"method":"session/step","params":{"session":"a","event":{"Timer":true}}}'
    )
    params = decode_params(request)
    assert isinstance(params, StepParams)
    assert (request.id, request.notification, bytes(params.event)) == (3, False, b'{"Timer":true}')


def test_a_request_without_an_id_is_a_notification() -> None:
    assert decode_request(b'{"jsonrpc":"2.0","method":"daemon/status"}').notification is True


@pytest.mark.parametrize(
    ("line", "kind", "id"),
    [
        (b"{", errors.ParseError, None),
        (b'{"jsonrpc":"2.0","id":1,"method":"x","p":"\xc3\x28"}', errors.ParseError, None),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"x","params":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            errors.ParseError,
            None,
        ),
        (b"[]", errors.InvalidRequestError, None),
        (b'"hi"', errors.InvalidRequestError, None),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"x"}', errors.InvalidRequestError, None),
        (b'{"jsonrpc":"2.1","id":"a","method":"x"}', errors.InvalidRequestError, "a"),
        (b'{"id":4,"method":"x"}', errors.InvalidRequestError, 4),
        (b'{"jsonrpc":"2.0","id":5}', errors.InvalidRequestError, 5),
        (b'{"jsonrpc":"2.0","id":42,"method":"x","params":{"prompt":"fix \\ud83d"}}', errors.InvalidRequestError, 42),
        (b'{"jsonrpc":"2.0","id":"\\ud800","method":"x"}', errors.InvalidRequestError, None),
        (b'{"jsonrpc":"2.0","id":7,"method":"x","params":{"p":"\\ud83d","n":NaN}}', errors.ParseError, None),
    ],
)
def test_a_bad_request_names_its_error_and_its_id(line: bytes, kind: type, id: object) -> None:
    with pytest.raises(RequestError) as bad:
        decode_request(line)
    assert (type(bad.value.error), bad.value.id) == (kind, id)


@pytest.mark.parametrize(
    "line", [b"{}", b'{"jsonrpc":"2.0"}', b'{"method":"daemon/status"}', b'{"jsonrpc":"2.0","method":5}']
)
def test_a_line_without_an_id_that_is_not_a_request_is_answered_not_taken_for_a_notification(line: bytes) -> None:
    with pytest.raises(RequestError) as bad:
        decode_request(line)
    assert (type(bad.value.error), bad.value.id, bad.value.notification) == (errors.InvalidRequestError, None, False)


def test_a_line_that_is_not_an_object_says_what_to_send() -> None:
    with pytest.raises(RequestError) as bad:
        decode_request(b"42")
    assert str(bad.value.error) == "the request is not an object (send one JSON-RPC request object per line)"


def test_a_lone_surrogate_is_named_with_what_to_send_instead() -> None:
    with pytest.raises(RequestError) as bad:
        decode_request(b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"prompt":"\\ud83d"}}')
    assert str(bad.value.error) == (
        "a string in the request holds a lone UTF-16 surrogate (an escape such as \\ud83d without its pair), which "
        "no UTF-8 text can carry; send well-formed Unicode (a character past U+FFFF as its whole pair)"
    )


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (b'{"jsonrpc":"2.0","id":1,"method":"nope"}', errors.MethodNotFoundError),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":"a"}}', errors.InvalidParamsError),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":[]}', errors.InvalidParamsError),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":"a/b"}}', errors.InvalidParamsError),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":"' + b"a" * 65 + b'"}}',
            errors.InvalidParamsError,
        ),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":"a","event":{},"timeout_ms":0}}',
            errors.InvalidParamsError,
        ),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":"a","event":{},"key":""}}',
            errors.InvalidParamsError,
        ),
    ],
)
def test_unknown_methods_and_bad_params_stay_distinct(line: bytes, kind: type) -> None:
    with pytest.raises(kind):
        decode_params(decode_request(line))


def test_params_may_be_absent_or_null() -> None:
    assert decode_params(decode_request(b'{"jsonrpc":"2.0","id":1,"method":"session/list","params":null}')) is not None


def test_answers_are_one_line_each() -> None:
    assert response(1, {"ok": True}) == b'{"jsonrpc":"2.0","id":1,"result":{"ok":true}}\n'
    assert error_response(None, errors.BusyError("busy")) == (
        b'{"jsonrpc":"2.0","id":null,"error":{"code":-32006,"message":"busy","data":{"kind":"BUSY"}}}\n'
    )


def test_the_step_result_embeds_the_actions_unchanged() -> None:
    actions = b'[{"id":1,"op":{"Save":true}}]'
    assert (
        response(2, StepResult(msgspec.Raw(actions)))
        == b'{"jsonrpc":"2.0","id":2,"result":{"actions":' + actions + b"}}\n"
    )
