"""Trace records: one for every model call attempt and every tool run, success or failure, durable in the session's
record log (kind `trace`), so a retried call is one truthful record per attempt, never one relabelled.

A record says what a person needs to see what happened: the action, the kind, when it started, how long it took, the
outcome (`ok`; `error`, with the error; `denied`, by the policy or a person; `refused`, by a spend ceiling, never
sent; `interrupted`, by a cancel or a stop) and, for a model call, the model and its token counts.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import msgspec

from devd.protocol import TraceRecord

TRACE = "trace"  # the record kind


def rfc3339(seconds: float) -> str:
    """Wall-clock seconds as RFC 3339 in UTC, to the millisecond."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def seconds(started: str) -> float:
    """The wall-clock seconds of an RFC 3339 `started`."""
    return datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()


def digest(text: str) -> str:
    """The hex SHA-256 of text a record names without holding it (the project instructions a model call sent)."""
    return hashlib.sha256(text.encode()).hexdigest()


def encode(record: TraceRecord) -> bytes:
    """The record's body in the log (its `n` is its place, given when read)."""
    return _encoder.encode(msgspec.structs.replace(record, n=0))


def decode(body: bytes, n: int) -> TraceRecord:
    return msgspec.structs.replace(_decoder.decode(body), n=n)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TraceRecord)
