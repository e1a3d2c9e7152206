"""Admission (devd.server.admission), pure and framing-free: first bytes and messages in, what is refused out."""

from __future__ import annotations

import math
from pathlib import Path

from devd.config import Settings
from devd.server.admission import SNIFF_BYTES_MAX, Admission, Close

SETTINGS = Settings(
    state_dir=Path("/nonexistent"), socket_path=None, line_bytes_max=256, auth_line_bytes_max=96, auth_timeout_s=5.0
)
HELLO = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"token":"sekrit"}}'


def tcp(now: float = 0.0) -> Admission:
    return Admission(SETTINGS, authenticated=False, token="sekrit", now=now)


def test_the_first_bytes_are_held_while_they_could_begin_an_http_method_then_given_back_whole() -> None:
    admission = tcp()
    assert [admission.sniff(b"PO"), admission.sniff(b'{"x"'), admission.sniffing] == [None, b'PO{"x"', False]


def test_an_http_request_split_across_reads_is_refused() -> None:
    admission = tcp()
    assert [admission.sniff(b"  GE"), admission.sniff(b"T / HTTP/1.1\r\n")] == [
        None,
        Close("an HTTP request on the JSON-RPC socket"),
    ]


def test_first_bytes_that_are_only_whitespace_are_held_no_longer_than_the_sniff_bound() -> None:
    admission = tcp()
    held = [admission.sniff(b"\n") for _ in range(SNIFF_BYTES_MAX)]
    assert (held.count(None), admission.sniff(b"\n"), admission.sniffing) == (
        SNIFF_BYTES_MAX,
        b"\n" * (SNIFF_BYTES_MAX + 1),
        False,
    )


def test_initialize_with_the_token_admits_and_lifts_the_message_bound() -> None:
    admission = tcp()
    before = admission.message_bytes_max
    assert (before, admission.admit(HELLO), admission.authenticated, admission.message_bytes_max) == (
        96,
        None,
        True,
        256,
    )


def test_a_wrong_token_is_refused_and_leaves_the_connection_unauthenticated() -> None:
    admission = tcp()
    refusal = admission.admit(b'{"jsonrpc":"2.0","method":"initialize","params":{"token":"guess"}}')
    assert (refusal, admission.authenticated) == (Close("unauthorized"), False)


def test_deadlines_are_the_auth_deadline_then_a_partial_message_s_then_none() -> None:
    admission = tcp(now=100.0)
    unauthenticated = [admission.deadline(None), admission.deadline(101.0)]
    admission.admit(HELLO)
    assert (unauthenticated, admission.deadline(102.0), admission.deadline(None)) == ([105.0, 105.0], 132.0, math.inf)
