"""Context windows: how large a request is against its model's window, where a conversation is cut when it is
compacted, and the request that asks the model for the summary that replaces its start.

Pure (no I/O). What it promises:
- `window` is the profile's `context_tokens`, else the window known for the model's name (`KNOWN_WINDOWS`, the
  longest prefix that matches, a `provider/` prefix as LiteLLM writes it left out), else None: no window is assumed
  for a model devd does not know, and only a refusal from its server (`model.ModelUnavailable.too_long`) compacts.
- `measure` is devd's estimate of a request's tokens (`spend.CHARS_PER_TOKEN` characters of its JSON a token), always
  said as an estimate: no tokenizer ships with devd (see README, "Context windows").
- `cut` chooses the messages a Summary replaces: never zero, never so that a call's result is kept without its call
  (the first message kept is not a Tool message), and never only an earlier summary; the newest messages that fit in
  the tokens asked for are kept.
- `summary_body` is a request without tools whose last message asks for a summary in `SUMMARY_ASK`'s words, the
  conversation to summarise given as one message of text cut to fit the window.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from devd.agent import model, spend
from devd.agent.profiles import Profile, token_param
from devd.messages import Message

# Windows of common models, by the start of their name (tokens, as their makers state them). A profile's
# `context_tokens` overrides these; a model not listed has no window until its profile states one.
KNOWN_WINDOWS: dict[str, int] = {
    "gpt-5": 400_000,
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "deepseek-chat": 128_000,
    "deepseek-reasoner": 128_000,
    "claude": 200_000,
    "gemini-2": 1_048_576,
    "qwen2.5-coder": 32_768,
    "qwen3": 32_768,
    "llama-3.1": 131_072,
    "llama3.1": 131_072,
    "mistral-large": 131_072,
}
SUMMARY_ASK = (
    "Summarise the conversation so far. The summary replaces it: write down the task, what was done and found, the "
    "decisions made and why, the files, commands and facts that matter, and what remains to be done, so that the work "
    "can go on from the summary alone. Answer with the summary only."
)
SUMMARY_OUTPUT_MAX = 4096  # tokens a summary may take, less in a small window (an eighth of it)
_PART_CHARS_MIN = 200  # of a message shown to the summariser, however many there are


def window(profile: Profile, model_name: str | None = None) -> int | None:
    """The window of `model_name` (the profile's model by default): `context_tokens`, else the known one, else
    None."""
    if profile.context_tokens is not None:
        return profile.context_tokens
    name = (model_name or profile.model).lower().rpartition("/")[2]
    known = [prefix for prefix in KNOWN_WINDOWS if name.startswith(prefix)]
    return KNOWN_WINDOWS[max(known, key=len)] if known else None


def measure(body: dict[str, Any]) -> int:
    """devd's estimate of a request's tokens: its JSON's characters over CHARS_PER_TOKEN, rounded up."""
    return spend.tokens_of(len(json.dumps(body, ensure_ascii=False)))


def summary_output(window_tokens: int | None) -> int:
    """The token limit of a summary."""
    return SUMMARY_OUTPUT_MAX if window_tokens is None else max(64, min(SUMMARY_OUTPUT_MAX, window_tokens // 8))


def cut(messages: Sequence[Message], keep_tokens: int, before: int | None = None) -> int | None:
    """How many of the transcript's first messages a Summary replaces (its `upto`) so that the newest messages kept
    measure at most `keep_tokens` (fewer when a Tool message would come first: its call goes with it); at most
    `before` (the Agent message whose calls are waited for must stay). None when nothing but an earlier summary
    could be replaced."""
    if not messages:
        return None
    upto, kept = len(messages), 0
    while upto > 0:
        size = spend.tokens_of(len(json.dumps(model.wire_messages([messages[upto - 1]]), ensure_ascii=False)))
        if kept + size > keep_tokens:
            break
        kept += size
        upto -= 1
    upto = max(upto, 1)
    while upto < len(messages) and messages[upto].Tool is not None:
        upto += 1  # the results go with their call
    if before is not None:
        upto = min(upto, before)  # an Agent message: the first kept is no Tool message
    first_real = 1 if messages and messages[0].Summary is not None else 0
    return upto if upto > first_real else None


def summary_body(profile: Profile, messages: Sequence[Message], window_tokens: int | None) -> dict[str, Any]:
    """The request for a summary of `messages`: the profile's system prompt, the conversation as text (each message
    cut to a fair share of what the window holds past the summary), and SUMMARY_ASK last; no tools; its token limit
    the profile's `max_tokens`, else `summary_output`."""
    output = profile.max_tokens or summary_output(window_tokens)
    parts = [_shown(m) for m in messages]
    if window_tokens is not None:
        room = (window_tokens - output) * spend.CHARS_PER_TOKEN * 3 // 4 - len(profile.system or "") - 1000
        parts = _fitted(parts, max(room, _PART_CHARS_MIN))
    wire: list[dict[str, Any]] = []
    if profile.system is not None:
        wire.append({"role": "system", "content": profile.system})
    wire.append({"role": "user", "content": "The conversation so far:\n\n" + "\n\n".join(parts)})
    wire.append({"role": "user", "content": SUMMARY_ASK})
    body: dict[str, Any] = {"model": profile.model, "messages": wire}
    body |= {"stream": True, "stream_options": {"include_usage": True}, token_param(profile): output}
    return body


def _shown(m: Message) -> str:
    """One message as the summariser reads it."""
    if m.User is not None:
        return f"USER: {m.User}"
    if m.Summary is not None:
        return f"SUMMARY OF WHAT CAME BEFORE: {m.Summary.text}"
    if m.Tool is not None:
        return f"RESULT of call {m.Tool.id}{' (failed)' if m.Tool.failed else ''}: {m.Tool.text}"
    agent = m.Agent
    assert agent is not None, "a Message has one member"
    calls = [f"CALL {d.id}: {model.call_name(d.call)} {model.call_arguments(d.call)}" for d in agent.calls or []]
    return "\n".join([f"ASSISTANT: {agent.text or ''}", *calls])


def _fitted(parts: list[str], room: int) -> list[str]:
    """parts cut so that together they hold at most `room` characters: each longer than its share keeps its start
    and end around a count of what was cut; past that, the oldest go (an earlier summary, first, stays)."""
    if sum(len(p) for p in parts) <= room:
        return parts
    share = max(room // max(len(parts), 1), _PART_CHARS_MIN)
    cut_parts = [p if len(p) <= share else _shortened(p, share) for p in parts]
    while len(cut_parts) > 1 and sum(len(p) for p in cut_parts) > room:
        del cut_parts[1 if cut_parts[0].startswith("SUMMARY OF") and len(cut_parts) > 2 else 0]
    return cut_parts


def _shortened(text: str, chars: int) -> str:
    head, tail = chars * 2 // 3, chars // 4
    return f"{text[:head]} …[{len(text) - head - tail} characters cut]… {text[-tail:]}"
