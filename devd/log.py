"""structlog, configured once: JSON lines when stderr is not a terminal (journald, containers), console on one."""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec
import structlog


def _json(obj: Any, default: Any) -> bytes:
    return msgspec.json.encode(obj, enc_hook=lambda o: default(o))


def configure(fmt: str | None = None, level: str = "info") -> None:
    if fmt is None:
        fmt = "console" if sys.stderr.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors = [
            *shared,
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(serializer=_json),
        ]
        factory: Any = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        processors = [*shared, structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
