"""The names the model calls MCP tools by: `SERVER__TOOL`, fitted to the model APIs' rule for a function's name (1-64
of `[A-Za-z0-9_-]`, which the core's rule for a Tool call's name also admits). A tool name with other characters has
them replaced by `_`; one too long keeps its start and a digest of the whole, so distinct tools keep distinct names
as far as a digest can; two tools that still come to one name are a collision, which `Names` refuses (the first one
listed keeps the name)."""

from __future__ import annotations

import hashlib
import re

NAME_CHARS_MAX = 64
SEPARATOR = "__"
_OTHER = re.compile(r"[^A-Za-z0-9_-]")
_DIGEST_CHARS = 8


def model_name(server: str, tool: str) -> str:
    """The model's name for a server's tool."""
    name = f"{server}{SEPARATOR}{_OTHER.sub('_', tool)}"
    if len(name) <= NAME_CHARS_MAX and name == f"{server}{SEPARATOR}{tool}":
        return name
    digest = hashlib.sha256(tool.encode()).hexdigest()[:_DIGEST_CHARS]
    return f"{name[: NAME_CHARS_MAX - _DIGEST_CHARS - 1]}_{digest}"


def server_of(name: str) -> str | None:
    """The server part of a model's name for an MCP tool, or None when it is none."""
    server, separator, tool = name.partition(SEPARATOR)
    return server if separator and server and tool else None


class Names:
    """The model names taken so far in one session's table; `take` refuses a second tool for one name."""

    def __init__(self) -> None:
        self._taken: dict[str, tuple[str, str]] = {}

    def take(self, server: str, tool: str) -> str | tuple[str, tuple[str, str]]:
        """The tool's model name, or (that name, the server and tool that hold it) when it is taken, by another tool
        or by this one listed before (a server may list a name twice; the model API refuses two tools of one name)."""
        name = model_name(server, tool)
        holder = self._taken.get(name)
        if holder is not None:
            return name, holder
        self._taken[name] = (server, tool)
        return name
