"""An MCP tool's result as the model reads it: its text content joined by newlines, every other content summarized
in one line (`[image/png, 12 KB]`, a resource by its URI), structured content as JSON where there is no content, the
whole cut at the profile's `output_bytes_max` with a note saying so; `isError` makes it a failed call."""

from __future__ import annotations

import json

import mcp_types as types

from devd.agent import tools


def size(n: int) -> str:
    """A byte count as a person reads it: 512 B, 12 KB, 3 MB (powers of 1024, rounded)."""
    for unit, scale in (("MB", 1024**2), ("KB", 1024)):
        if n >= scale:
            return f"{round(n / scale)} {unit}"
    return f"{n} B"


def _base64_bytes(data: str) -> int:
    return len(data) * 3 // 4 - data[-2:].count("=")


def _block(block: types.ContentBlock) -> str:
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.ImageContent | types.AudioContent):
        return f"[{block.mime_type}, {size(_base64_bytes(block.data))}]"
    if isinstance(block, types.ResourceLink):
        return f"[resource {block.uri}]"
    resource = block.resource
    if isinstance(resource, types.TextResourceContents):
        return resource.text
    return f"[{resource.mime_type or 'application/octet-stream'}, {size(_base64_bytes(resource.blob))}, {resource.uri}]"


def result_text(result: types.CallToolResult, limit_bytes: int) -> tools.Result:
    """The result as a call's Result, its text at most limit_bytes (UTF-8)."""
    parts = [_block(block) for block in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    data = "\n".join(parts).encode()
    text = data[:limit_bytes].decode("utf-8", "ignore")
    if len(data) > limit_bytes:
        text += f"\n[cut: the result was {len(data)} bytes; output_bytes_max is {limit_bytes}]"
    failed = bool(result.is_error)
    return tools.Result(text, failed=failed, why="the MCP tool reported an error" if failed else None)
