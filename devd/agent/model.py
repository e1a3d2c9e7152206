"""The model driver: one `Model` ask becomes a streamed OpenAI-compatible chat completion.

Pure parts first (the request body, the stream parser, the reply the core is stepped with), then `complete`, the one
place that talks to a model server: one POST per attempt, each content fragment handed on as it arrives, transport
errors, 408/409/429 and 5xx retried with bounded backoff, each attempt reported with what it is charged, and
cancellation closing the stream.

What it promises at its edges: a reply is bounded (`reply_bytes_max` bytes, a line of it included; `model_timeout_s`
seconds an attempt; the tokens reserved for it, by devd's estimate; never a content encoding, which is refused unread)
and a reply past a bound fails without a retry; a retry is sent only once the spend ceilings admit it again; the API
key is read when sent and refused, naming its variable, when it is missing or holds what a header cannot carry; no
error text it gives out holds the key or the `user:password` of a URL, and no URL it shows holds a user or password;
every attempt the server took is charged (its usage, its output at least the estimate of what streamed; else devd's
estimate of the request and of what streamed), cut short or cancelled as well; what a server sends that cannot be read
(counts past TOKEN_COUNT_MAX, JSON nested past the recursion limit, lone surrogates in arguments) fails the attempt
or is a rejected call, never the driver.

Wire choices: a tool call's id is `call_<action id>` (the Dispatch id); a failed result is sent as
`error: <text>`, so the model sees that the call failed; an assistant turn without text or calls is sent with
content "" (null content is only valid beside tool calls).
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal
from urllib.parse import unquote_plus, urlsplit

import anyio
import msgspec

from devd.agent import http, kinds, spend
from devd.agent.kinds.named import NamedTool
from devd.agent.mcp.names import server_of
from devd.agent.profiles import Profile, api_key, shown_url, token_param
from devd.messages import Call, Message, Reply
from devd.messages import ToolCall as NamedCall


class Inserted(msgspec.Struct, frozen=True):
    """Wire messages that are not in the core's transcript (a rejected reply and its failed results), to be sent
    before message number `before` of the whole conversation (`whole_length`: what a Summary replaced counts), so
    that a Summary replacing the start of the transcript leaves it where it was; one before a message the Summary
    replaced goes with them."""

    before: int
    messages: list[dict[str, Any]]


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call as the model wrote it: its id, the tool's name and the arguments' JSON text."""

    id: str
    name: str
    arguments: str


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None


class Completion(msgspec.Struct, frozen=True):
    """What the model answered: its text (None: none), tool calls, usage (when the server gave it) and why it
    stopped (`stop`, `tool_calls`, `length`, or None when the server did not say)."""

    text: str | None
    tool_calls: list[ToolCall]
    usage: Usage | None = None
    finish_reason: str | None = None
    response_model: str | None = None  # the model the server says answered
    reasoning: str | None = None  # what the model streamed as its reasoning (`reasoning_content`), beside the answer


class Rejected(msgspec.Struct, frozen=True):
    """A tool call the core cannot take, and exactly why (said to the model as the call's failed result)."""

    call_id: str
    name: str
    arguments: str
    why: str


class ModelUnavailable(Exception):
    """No completion could be had: the key cannot be sent (`sent` False: no request went), the attempts are spent,
    the server refused the request (a 4xx), or a reply passed a bound of the profile. `too_long`: the server said the
    request is longer than its context window (OpenAI's `context_length_exceeded`, llama.cpp's error or its empty
    stream), which compacting the conversation may cure."""

    def __init__(self, why: str, *, status: int | None = None, too_long: bool = False, sent: bool = True) -> None:
        super().__init__(why)
        self.why = why
        self.status = status
        self.too_long = too_long
        self.sent = sent


Outcome = Literal["ok", "retry", "failed", "cancelled"]


class Attempt(msgspec.Struct, frozen=True):
    """One POST: when it started (Unix time), how long it took, how it ended, the HTTP status and error if any, and
    what it is charged (`usage`): the server's count when it sent one, else devd's estimate of the request and of
    what streamed (`estimated`). None when the server did not take the request (no connection, or an error status):
    it did no work to pay for."""

    started_at: float
    duration_s: float
    outcome: Outcome
    status: int | None = None
    error: str | None = None
    usage: spend.Usage | None = None


# -- the request --------------------------------------------------------------------------------------------------


def tool_names(profile: Profile, *, exec_available: bool) -> list[str]:
    """The tools the model is offered, in the table's order: those whose kind offers them to this profile (read
    always; exec and git when allowed and a sandbox can run them; write when allowed; browse when listed; delegate
    with delegates), and, in a child session, to its parent's too (the intersection)."""
    return [
        name
        for name, kind in kinds.OFFERED.items()
        if kind.offered(profile, exec_available=exec_available)
        and (not kind.narrowed or profile.ceiling is None or name in tool_names(profile.ceiling, exec_available=True))
    ]


def call_id(action_id: int) -> str:
    return f"call_{action_id}"


def call_name(call: Call) -> str:
    """The tool's name in the model's transcript (a generic call's, the name the model gave it)."""
    kind, member = _kind(call)
    return kind.model_name(member)


def call_arguments(call: Call) -> str:
    """The call's fields as the JSON text of a tool call's `arguments` (a generic call's input as the model wrote
    it)."""
    kind, member = _kind(call)
    return kind.arguments(member)


def _kind(call: Call) -> tuple[kinds.Kind[Any], Any]:
    found = kinds.of(call)
    if found is None:
        raise ValueError("a Call with no member")  # Call's own check forbids this
    return found


def wire_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as chat-completions messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.User is not None:
            out.append({"role": "user", "content": m.User})
        elif m.Agent is not None:
            calls = m.Agent.calls or []
            entry: dict[str, Any] = {"role": "assistant", "content": m.Agent.text if calls else m.Agent.text or ""}
            if calls:
                entry["tool_calls"] = [
                    {
                        "id": call_id(d.id),
                        "type": "function",
                        "function": {"name": call_name(d.call), "arguments": call_arguments(d.call)},
                    }
                    for d in calls
                ]
            out.append(entry)
        elif m.Tool is not None:
            text = f"error: {m.Tool.text}" if m.Tool.failed else m.Tool.text
            out.append({"role": "tool", "tool_call_id": call_id(m.Tool.id), "content": text})
        elif m.Summary is not None:  # the start of the conversation, replaced by what it came to
            summary = f"(A summary of the conversation before this point.)\n{m.Summary.text}"
            out.append({"role": "user", "content": summary})
    return out


def whole_length(messages: Sequence[Message]) -> int:
    """How many messages of the whole conversation `messages` stand for: a first Summary stands for those it
    replaced."""
    first = messages[0].Summary if messages else None
    return len(messages) + (first.replaced - 1 if first is not None else 0)


def rejected_messages(text: str | None, rejected: Sequence[Rejected]) -> list[dict[str, Any]]:
    """The wire messages that tell the model its calls were not taken: its assistant message, then a failed result
    per call. The runner keeps these as an `Inserted`."""
    calls = [
        {"id": r.call_id, "type": "function", "function": {"name": r.name, "arguments": r.arguments}} for r in rejected
    ]
    results = [{"role": "tool", "tool_call_id": r.call_id, "content": f"error: {r.why}"} for r in rejected]
    return [{"role": "assistant", "content": text, "tool_calls": calls}, *results]


def request_body(
    profile: Profile,
    messages: Sequence[Message],
    extra: Iterable[Inserted] = (),
    *,
    exec_available: bool = True,
    thoughts: Mapping[int, str] | None = None,
    named: Sequence[NamedTool] = (),
) -> dict[str, Any]:
    """The chat-completions request for an ask: the system prompt, the conversation (with `extra` inserted where it
    belongs; with `send_reasoning`, each answer's reasoning of `thoughts`, by its place in the whole conversation, as
    its `reasoning_content`), the tools the profile allows and the session's `named` ones (its MCP tools), streamed
    with usage."""
    conversation = wire_messages(messages)
    replaced = whole_length(messages) - len(messages)  # the whole conversation's messages a Summary stands for, less it
    if profile.send_reasoning:
        for at, thought in (thoughts or {}).items():
            if 0 < at - replaced < len(conversation) and conversation[at - replaced]["role"] == "assistant":
                conversation[at - replaced]["reasoning_content"] = thought
    for inserted in sorted(extra, key=lambda i: i.before, reverse=True):
        # From the back, so earlier indices still point where they did.
        if replaced and inserted.before <= replaced:
            continue  # among what the Summary replaced
        at = min(max(inserted.before - replaced, 0), len(conversation))
        conversation[at:at] = inserted.messages
    wire: list[dict[str, Any]] = []
    if profile.system is not None:
        wire.append({"role": "system", "content": profile.system})
    if profile.project is not None:  # the project's instructions (devd.agent.instructions), after the profile's own
        wire.append({"role": "system", "content": profile.project})
    wire.extend(conversation)
    tools = [
        {"type": "function", "function": {"name": name, **(kinds.OFFERED[name].schema or {})}}
        for name in tool_names(profile, exec_available=exec_available)
    ]
    tools += [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in named
    ]
    body: dict[str, Any] = {"model": profile.model, "messages": wire, "tools": tools}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if profile.max_tokens is not None:
        body[token_param(profile)] = profile.max_tokens
    return body


# -- the answer ---------------------------------------------------------------------------------------------------


def to_reply(
    completion: Completion, named: Collection[str] = (), down: Mapping[str, str] | None = None
) -> tuple[Reply, list[Rejected]]:
    """The reply the core is stepped with, and the tool calls it cannot take (with why); `named` are the names of the
    session's named tools (its MCP tools), called as `Tool` calls; `down`, why each MCP server of the session that
    could not list its tools could not (a call of one of its tools is told that, not that no tool has the name)."""
    calls: list[Call] = []
    rejected: list[Rejected] = []
    for tc in completion.tool_calls:
        server = server_of(tc.name)
        if tc.name not in named and down and server is not None and server in down:
            why = f"{tc.name} is a tool of the MCP server {server}, which cannot serve now: {down[server]}"
            rejected.append(Rejected(call_id=tc.id, name=tc.name, arguments=tc.arguments, why=why))
            continue
        call = _named_call(tc) if tc.name in named else _call(tc)
        if isinstance(call, str):
            rejected.append(Rejected(call_id=tc.id, name=tc.name, arguments=tc.arguments, why=call))
        else:
            calls.append(call)
    return Reply(text=completion.text, calls=calls or None), rejected


def _named_call(tc: ToolCall) -> Call | str:
    """The core's Tool call for a call of a named tool (its arguments kept as written), or what is wrong with it."""
    try:
        args = json.loads(tc.arguments or "{}")
        json.dumps(args, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, RecursionError, UnicodeEncodeError) as e:
        return f"the arguments of {tc.name} are not JSON that can be read ({e}); send a JSON object"
    if not isinstance(args, dict):
        return f"the arguments of {tc.name} are not a JSON object; send one"
    raw = msgspec.Raw((tc.arguments or "{}").encode())
    return Call(Tool=NamedCall(name=tc.name, input=raw))


def _call(tc: ToolCall) -> Call | str:
    """The core's Call for a tool call, or what is wrong with it."""
    kind = kinds.OFFERED.get(tc.name)
    if kind is None:
        return f"there is no tool named {json.dumps(tc.name)}; the tools are {', '.join(kinds.OFFERED)}"
    shape = kind.shape
    try:
        args = json.loads(tc.arguments or "{}")
    except json.JSONDecodeError as e:
        return f"the arguments of {tc.name} are not JSON ({e}); {tc.name} expects {shape}"
    except RecursionError:
        return f"the arguments of {tc.name} are nested too deeply to be read; {tc.name} expects {shape}"
    try:
        member = msgspec.convert(args, kind.arguments_type or kind.struct, strict=True)
    except msgspec.ValidationError as e:
        return f"the arguments of {tc.name} do not fit ({e}); {tc.name} expects {shape}"
    try:  # an escaped lone surrogate ("\\udcff") is no character: it cannot be run, written or kept
        json.dumps(args, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        return f"the arguments of {tc.name} are nested too deeply to be read; {tc.name} expects {shape}"
    except UnicodeEncodeError:
        return (
            f"the arguments of {tc.name} hold an escaped lone surrogate (a \\ud800-\\udfff escape not part of a "
            f"pair), which is no character; write the text as it is; {tc.name} expects {shape}"
        )
    invalid = kind.invalid(member)
    if invalid is not None:
        return invalid
    return kind.to_call(args, tc.arguments or "{}")


# -- the stream ---------------------------------------------------------------------------------------------------


class StreamError(Exception):
    """The server sent something that is not a chat-completions stream, or an error inside it: `why`, a description,
    and `sample`, the start of what it sent (kept apart: a trace record holds the description only, never content)."""

    def __init__(self, why: str, sample: str | None = None) -> None:
        super().__init__(why if sample is None else f"{why}: {sample}")
        self.why, self.sample = why, sample


_decode = msgspec.json.decode  # a stream's hundreds of chunks a second: 2-3 times as fast as json.loads


def _decode_slowly(data: str) -> Any:
    """A line msgspec refused, as the standard parser reads it (a lone surrogate escape it takes) or words its error."""
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"a stream line is not JSON ({e})", data[:200]) from None
    except RecursionError:
        raise StreamError("a stream line is JSON nested too deeply to be read", data[:200]) from None


class StreamParser:
    """Server-sent events of a chat-completion stream, a line at a time (sans I/O): `feed` gives the content
    fragments of that line; `done` once `data: [DONE]` came; `completion()` what the whole stream said."""

    def __init__(self) -> None:
        self.done = False
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._usage: Usage | None = None
        self._finish: str | None = None
        self._model: str | None = None
        self._held = ""  # a high surrogate that ended the last content fragment: its low half may start the next
        self.streamed = 0  # characters of text, tool names and arguments so far: what devd's estimate counts
        self.chunks = 0  # data lines read, [DONE] aside: none at all is llama.cpp's answer to a request too long
        self._reasoning: list[str] = []
        self._thoughts: list[str] = []  # reasoning fragments not yet taken (`take_reasoning`)

    def feed(self, line: str) -> list[str]:
        line = line.rstrip("\r")
        if not line.startswith("data:") or self.done:
            return []  # blank separators, comments (": ping"), event: and id: lines
        data = line[5:].removeprefix(" ")
        if data.strip() == "[DONE]":
            self.done = True
            return []
        self.chunks += 1
        try:
            chunk = _decode(data)
        except (msgspec.DecodeError, RecursionError):  # said again by the standard parser: its words, lone surrogates
            chunk = _decode_slowly(data)
        if not isinstance(chunk, dict):
            raise StreamError("a stream chunk is not an object", data[:200])
        return self.chunk(chunk)

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """One decoded chunk; its content fragments. StreamError when it is not a chunk of a chat completion."""
        try:
            return self._chunk(chunk)
        except (AttributeError, TypeError, ValueError, RecursionError) as e:  # a field not of the format's type
            raise StreamError(f"a chunk is not one of a chat completion ({e})", _sample(chunk)) from None

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:
            raise StreamError(f"the server sent an error in the stream: {_well_formed(_error_message(chunk))}")
        self._model = chunk.get("model") or self._model
        if isinstance(usage := chunk.get("usage"), dict):
            self._usage = _usage(usage)
        fragments: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or choice.get("message") or {}
            if isinstance(content := delta.get("content"), str) and content:
                self.streamed += len(content)
                content = self._whole(content)
                if content:
                    self._text.append(content)
                    fragments.append(content)
            for key in ("reasoning_content", "reasoning"):  # DeepSeek, vLLM, llama.cpp; OpenRouter's name
                if isinstance(thought := delta.get(key), str) and thought:
                    self.streamed += len(thought)  # reasoning tokens are output tokens
                    self._reasoning.append(thought := _well_formed(thought))
                    self._thoughts.append(thought)
                    break
            for position, fragment in enumerate(delta.get("tool_calls") or []):
                self._tool_fragment(fragment, position)
            self._finish = choice.get("finish_reason") or self._finish
        return fragments

    def take_reasoning(self) -> list[str]:
        """The reasoning fragments fed since the last take, in order."""
        taken, self._thoughts = self._thoughts, []
        return taken

    def _whole(self, content: str) -> str:
        """A content fragment made fit to carry: a surrogate pair split across two chunks is joined (its high half
        held back until the next), any other lone surrogate becomes U+FFFD."""
        content, self._held = self._held + content, ""
        if "\ud800" <= content[-1] <= "\udbff":
            content, self._held = content[:-1], content[-1]
        return _well_formed(content)

    def _tool_fragment(self, fragment: dict[str, Any], position: int) -> None:
        index = fragment.get("index")
        if index is None:
            index = position  # some servers send whole calls without an index
        elif type(index) is not int or index < 0:
            raise ValueError(f"a tool call's index is {json.dumps(index)}, not a whole number 0 or more")
        call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": []})
        function = fragment.get("function") or {}
        call["id"] = call["id"] or fragment.get("id") or ""
        if not call["name"] and isinstance(name := function.get("name"), str):
            call["name"] = name
            self.streamed += len(name)
        if isinstance(arguments := function.get("arguments"), str):
            call["arguments"].append(arguments)
        elif isinstance(arguments, dict):  # a server that sends the arguments parsed
            call["arguments"].append(arguments := json.dumps(arguments))
        self.streamed += len(arguments) if isinstance(arguments, str) else 0

    def completion(self) -> Completion:
        calls = [
            # A server that gives no id: one that cannot be taken for a `call_<action id>` of the conversation.
            ToolCall(
                id=_well_formed(c["id"]) or f"call_noid_{i}",
                name=_well_formed(c["name"]),
                arguments=_well_formed("".join(c["arguments"])),
            )
            for i, c in sorted(self._calls.items())
        ]
        text = "".join(self._text) + ("\ufffd" if self._held else "") or None
        reasoning = "".join(self._reasoning) or None
        return Completion(text, calls, self._usage, self._finish, self._model, reasoning)


def parse_sse(lines: Iterable[str]) -> Completion:
    """A whole stream's completion; StreamError when it ends before `data: [DONE]`."""
    parser = StreamParser()
    for line in lines:
        parser.feed(line)
    if not parser.done:
        raise StreamError("the stream ended before data: [DONE]")
    return parser.completion()


def _whole(body: bytes, parser: StreamParser) -> Completion:
    """A completion answered as one JSON object (a server that does not stream)."""
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as e:
        raise StreamError(f"the answer is not JSON ({e})") from None
    except RecursionError:
        raise StreamError("the answer is JSON nested too deeply to be read") from None
    if not isinstance(doc, dict):
        raise StreamError("the answer is not a JSON object")
    parser.chunk(doc)
    return parser.completion()


def _sample(chunk: Any) -> str:
    try:
        return json.dumps(chunk)[:200]
    except (RecursionError, ValueError):
        return "(a chunk that cannot be shown)"


# A count past this is no count of one reply (the largest context is some millions of tokens): stored, a count near
# 2**63 would not fit the store's integers, and summed with others it would overflow them.
TOKEN_COUNT_MAX = 10**9


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_count(usage, "prompt_tokens"),
        completion_tokens=_count(usage, "completion_tokens"),
        cached_tokens=_count(details, "cached_tokens") if type(cached) in (int, float) else None,
    )


def _count(usage: dict[str, Any], field: str) -> int:
    """A token count the spend ceilings can trust: a whole number from 0 to TOKEN_COUNT_MAX (absent: 0). A negative
    one would take spend back below a ceiling; an infinite, fractional or larger one is no count."""
    n = usage.get(field)
    if n is None:
        return 0
    if type(n) is float and n.is_integer():  # 12.0 from a server that writes every number as a float
        n = int(n)
    if type(n) is not int or not 0 <= n <= TOKEN_COUNT_MAX:
        shown = json.dumps(n) if type(n) is not int or n < 10**20 else f"a number of {len(str(n))} digits"
        raise ValueError(f"the usage's {field} is {shown}, not a whole number of tokens from 0 to {TOKEN_COUNT_MAX}")
    return n


def _well_formed(text: str) -> str:
    """text with every surrogate that is not half of a pair made U+FFFD: JSON can escape one alone (\\ud800), which
    no UTF-8 can carry, and the two halves of a pair escaped apart are two code points here until joined."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _error_message(doc: Any) -> str:
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(doc.get("message"), str):
            return str(doc["message"])
    return json.dumps(doc)[:500]


# -- the exchange -------------------------------------------------------------------------------------------------

RETRIED = {408, 409, 429}  # with 5xx: the statuses asked again
RETRY_AFTER_MAX_S = 20.0  # a Retry-After longer than this is not waited for (the exponential backoff is)
BACKOFF_MAX_S = 8.0
_ERROR_BODY_MAX = 64 * 1024
REDACTED = "[redacted]"
_SECRET_CHARS_MIN = 4  # a shorter "secret" (a one-letter password) would blank ordinary words of every message


class _Failed(Exception):
    def __init__(
        self,
        why: str,
        *,
        status: int | None = None,
        retry: bool,
        after_s: float | None = None,
        sample: str | None = None,
        too_long: bool = False,
    ) -> None:
        super().__init__(why)
        self.why, self.status, self.retry, self.after_s, self.sample = why, status, retry, after_s, sample
        self.too_long = too_long

    def said(self, server: str, attempts: int | None = None) -> str:
        """What ModelUnavailable says: the description, how many attempts, and what the server sent when it was no
        stream (for a person; the trace record has the description alone)."""
        after = "" if attempts is None else f" after {attempts} attempts"
        sample = "" if self.sample is None else f" (it sent: {self.sample})"
        return f"model server {server}: {self.why}{after}{sample}"


class _Progress:
    """What one attempt got so far: the response's status once its head came, and the stream parsed."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.parser = StreamParser()


TextSink = Callable[[str], Awaitable[None] | None]


class _Sinks:
    """Where an attempt's fragments go as they come: reasoning, then the answer's text."""

    def __init__(self, text: TextSink | None, reasoning: TextSink | None) -> None:
        self.text, self.reasoning = text, reasoning

    async def tell(self, thoughts: list[str], fragments: list[str]) -> None:
        for sink, pieces in ((self.reasoning, thoughts), (self.text, fragments)):
            for piece in pieces:
                if sink is not None and inspect.isawaitable(pending := sink(piece)):
                    await pending


AttemptSink = Callable[[Attempt], None]
Readmit = Callable[[], Awaitable[str | None]]  # before a retry: None when it may be sent, else why not


async def complete(
    client: http.Client,
    profile: Profile,
    messages: Sequence[Message],
    *,
    environ: Mapping[str, str],
    exec_available: bool,
    extra: Iterable[Inserted] = (),
    named: Sequence[NamedTool] = (),
    on_text: TextSink | None = None,
    on_attempt: AttemptSink | None = None,
    output_max: int | None = None,
    readmit: Readmit | None = None,
    attempts: int = 4,
    backoff_s: float = 0.25,
    body: dict[str, Any] | None = None,
    on_reasoning: TextSink | None = None,
) -> Completion:
    """Ask the profile's model server (the request for `messages`, or `body` when given: a summary's);
    `on_text(fragment)` for each content fragment as it arrives (after a failed attempt, the next attempt's fragments
    start the text again: `on_attempt` has said "retry" before), `on_reasoning(fragment)` for each fragment of
    reasoning streamed beside it, and `on_attempt` once per attempt. The API key is
    read from `environ` (the variable the profile names) now.
    ModelUnavailable when the key cannot be sent, the attempts are spent, the server refuses the request, a reply
    passes `reply_bytes_max` or `model_timeout_s`, or what streamed passes `output_max` tokens by devd's estimate
    (the tokens reserved for the reply: a server that ignores max_tokens); those three are not retried, the next
    reply would do the same. Before each retry `readmit()` is awaited (the spend ceilings, again): a retry it
    refuses is not sent, and its why is ModelUnavailable's.

    Every error text leaving here (ModelUnavailable's, each Attempt's) has the key, any `user:password` of
    `base_url` and the values of its query replaced by [redacted]: a server may echo what it was sent."""
    server = shown_url(profile.base_url)
    try:
        key = api_key(profile, environ)
    except ValueError as e:  # its message names the variable, never the key
        raise ModelUnavailable(f"model server {server}: {e}", sent=False) from None
    redact = _redactor(profile.base_url, key)

    def report(attempt: Attempt) -> None:
        if on_attempt is not None:
            on_attempt(msgspec.structs.replace(attempt, error=None if attempt.error is None else redact(attempt.error)))

    try:
        return await _exchange(
            client,
            profile,
            body
            if body is not None
            else request_body(profile, messages, list(extra), exec_available=exec_available, named=named),
            key,
            _Sinks(on_text, on_reasoning),
            report,
            output_max,
            readmit,
            attempts,
            backoff_s,
        )
    except ModelUnavailable as e:
        raise ModelUnavailable(redact(e.why), status=e.status, too_long=e.too_long, sent=e.sent) from None


def _redactor(base_url: str, key: str | None) -> Callable[[str], str]:
    """The one redaction of the model driver: text with the key, the URL's user name and password, and the values of
    its query (a gateway's key is often given as `?key=`; `shown_url` hides them in the server's name) replaced."""
    split = urlsplit(base_url)
    userinfo, _, _ = split.netloc.rpartition("@")
    values = [(part.partition("=")[2] if "=" in part else part) for part in split.query.split("&")]  # `?KEY`: a value
    secrets = [key or "", userinfo, *userinfo.split(":", 1), *values, *(unquote_plus(v) for v in values)]
    # Longest first: the whole `user:password` goes before its parts do.
    kept = sorted({s for s in secrets if len(s) >= _SECRET_CHARS_MIN}, key=len, reverse=True)

    def redact(text: str) -> str:
        for secret in kept:
            text = text.replace(secret, REDACTED)
        return text

    return redact


async def _exchange(
    client: http.Client,
    profile: Profile,
    request: dict[str, Any],
    key: str | None,
    sinks: _Sinks,
    report: AttemptSink,
    output_max: int | None,
    readmit: Readmit | None,
    attempts: int,
    backoff_s: float,
) -> Completion:
    server = shown_url(profile.base_url)
    url = f"{profile.base_url}/chat/completions"
    body = json.dumps(request, ensure_ascii=False).encode()
    request_tokens = spend.estimate_tokens(body)
    # No content encoding: a compressed body would be inflated a read at a time past what `reply_bytes_max` holds.
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "Accept-Encoding": "identity"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    for attempt in range(1, attempts + 1):
        started_at, t0 = time.time(), time.monotonic()
        progress = _Progress()
        try:
            with anyio.move_on_after(profile.model_timeout_s) as deadline:
                completion = await _attempt(client, url, body, headers, sinks, profile, output_max, progress)
            if deadline.cancelled_caught:
                raise _Failed(_too_long(profile), status=progress.status, retry=False)
        except _Failed as failed:
            last = attempt == attempts or not failed.retry
            taken = progress.status == 200 or deadline.cancelled_caught
            usage = _charged(progress, request_tokens) if taken else None
            report(_attempted(started_at, t0, "failed" if last else "retry", failed.status, failed.why, usage))
            if not failed.retry:
                raise ModelUnavailable(failed.said(server), status=failed.status, too_long=failed.too_long) from None
            if last:
                raise ModelUnavailable(failed.said(server, attempts), status=failed.status) from None
            await anyio.sleep(_delay(failed.after_s, backoff_s, attempt))
            if readmit is not None and (refused := await readmit()) is not None:
                raise ModelUnavailable(
                    f"{failed.said(server)}; it was not tried again: {refused}", status=failed.status
                ) from None
        except anyio.get_cancelled_exc_class():
            # The server may be working on it whether or not a byte came back: the request is charged.
            usage = _charged(progress, request_tokens)
            report(_attempted(started_at, t0, "cancelled", progress.status, "cancelled", usage))
            raise
        else:
            report(_attempted(started_at, t0, "ok", 200, None, _charged(progress, request_tokens)))
            return completion
    raise ModelUnavailable(f"model server {server}: no attempt was allowed (attempts = {attempts})")


def _attempted(
    started_at: float, t0: float, outcome: Outcome, status: int | None, error: str | None, usage: spend.Usage | None
) -> Attempt:
    return Attempt(started_at, time.monotonic() - t0, outcome, status, error, usage)


def _charged(progress: _Progress, request_tokens: int) -> spend.Usage:
    """What an attempt the server took is charged: its usage when it sent one, else devd's estimate of the request
    and of what streamed (so a stream cut short, or cancelled, still counts against the ceilings). Its output is at
    least the estimate of what streamed (`estimated` when that was more than the server said): a server's usage is
    its word, what streamed was seen."""
    streamed = spend.tokens_of(progress.parser.streamed)
    given = progress.parser.completion().usage
    if given is None:
        return spend.Usage(request_tokens, streamed, estimated=True)
    output = max(given.completion_tokens, streamed)
    return spend.Usage(given.prompt_tokens, output, given.cached_tokens or 0, output > given.completion_tokens)


def _delay(after_s: float | None, backoff_s: float, attempt: int) -> float:
    if after_s is not None and 0 <= after_s <= RETRY_AFTER_MAX_S:
        return after_s
    return float(min(backoff_s * 2 ** (attempt - 1), BACKOFF_MAX_S))


def _too_large(profile: Profile, line: bool) -> str:
    what = "a line of the reply" if line else "the reply"
    return (
        f"{what} passed reply_bytes_max ({profile.reply_bytes_max} bytes) and was dropped; it is not asked for again: "
        f"if agent {profile.name!r} needs replies this large, raise its reply_bytes_max in the agents file"
    )


def _past_reservation(profile: Profile, output_max: int) -> str:
    return (
        f"the reply passed the {output_max} tokens reserved for it (the max_tokens sent, by devd's estimate of "
        f"{spend.CHARS_PER_TOKEN} characters a token) and was dropped, charged what streamed; it is not asked for "
        f"again: the server may ignore max_tokens; if agent {profile.name!r} needs longer replies, raise its "
        "max_tokens in the agents file"
    )


def _too_long(profile: Profile) -> str:
    return (
        f"the reply took longer than model_timeout_s ({profile.model_timeout_s:g} s) and was dropped; it is not asked "
        f"for again: if agent {profile.name!r} needs longer, raise its model_timeout_s in the agents file"
    )


async def _attempt(
    client: http.Client,
    url: str,
    body: bytes,
    headers: dict[str, str],
    sinks: _Sinks,
    profile: Profile,
    output_max: int | None,
    progress: _Progress,
) -> Completion:
    parser = progress.parser

    def within_reservation() -> None:
        if output_max is not None and spend.tokens_of(parser.streamed) > output_max:
            raise _Failed(_past_reservation(profile, output_max), status=200, retry=False)

    try:
        async with http.post(client, url, body, headers) as response:
            if response.status != 200:
                raise await _refusal(response)
            progress.status = 200
            if response.headers.get("content-type", "").startswith("application/json"):
                data, cut = await response.read(profile.reply_bytes_max)
                if cut:
                    raise _Failed(_too_large(profile, line=False), status=200, retry=False)
                whole = _whole(data, parser)
                within_reservation()
                await sinks.tell(parser.take_reasoning(), [whole.text] if whole.text else [])
                return whole
            async for line in response.lines(profile.reply_bytes_max):
                fragments = parser.feed(line)
                within_reservation()  # before the text goes on: what passes the reservation is not shown
                await sinks.tell(parser.take_reasoning(), fragments)
                if parser.done:
                    break  # the server may keep the connection open after [DONE]
            if parser.chunks == 0:  # not retried: llama.cpp answers the same request the same way
                raise _Failed(EMPTY_STREAM, status=200, retry=False, too_long=True)
            if not parser.done:
                raise _Failed("the stream ended before data: [DONE]", status=200, retry=True)
            return parser.completion()
    except http.TooLarge as e:
        # Most of what came being one unended line: that line is the problem, not the reply's length.
        raise _Failed(_too_large(profile, line=e.line_bytes > e.bytes_max // 2), status=200, retry=False) from None
    except http.Encoded as e:  # refused unread: asking again would be answered the same
        raise _Failed(e.why, status=200, retry=False) from None
    except http.TransportError as e:
        raise _Failed(e.why, retry=True) from None
    except StreamError as e:
        raise _Failed(e.why, status=200, retry=True, sample=e.sample) from None


EMPTY_STREAM = (
    "the server answered 200 with an empty stream, as llama.cpp's server answers a request longer than its context "
    "window"
)
# How servers word a request past the model's window: OpenAI's code, and the messages of llama.cpp, vLLM and others.
_TOO_LONG_CODES = {"context_length_exceeded", "exceed_context_size_error", "string_above_max_length"}
_TOO_LONG_WORDS = re.compile(
    r"context[ _]length|context window|context size|maximum context|exceeds? (the )?(available )?context|too many "
    r"tokens|prompt is too long",
    re.IGNORECASE,
)


async def _refusal(response: http.Response) -> _Failed:
    """What an error status says: the server's own message (a JSON error's, else its body, cut to 500 characters);
    retried for 408, 409, 429 and 5xx only; `too_long` when it says the request passed the model's window."""
    try:
        data, _ = await response.read(_ERROR_BODY_MAX)
    except http.Encoded as e:  # its body is not read, and a server that compresses one will compress the next
        return _Failed(f"{response.status} {e.why}", status=response.status, retry=False)
    try:
        doc = json.loads(data)
        message = _well_formed(_error_message(doc))[:500]
    except (json.JSONDecodeError, RecursionError):
        doc, message = None, data.decode("utf-8", "replace").strip()[:500] or "(no body)"
    status = response.status
    too_long = 400 <= status < 500 and (_error_code(doc) in _TOO_LONG_CODES or bool(_TOO_LONG_WORDS.search(message)))
    retry = (status in RETRIED or status >= 500) and not too_long
    after_s = _retry_after(response.headers)
    return _Failed(f"{status} {message}", status=status, retry=retry, after_s=after_s, too_long=too_long)


def _error_code(doc: Any) -> str | None:
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict):
        return None
    for field in ("code", "type"):
        if isinstance(value := error.get(field), str) and value in _TOO_LONG_CODES:
            return value
    return None


def _retry_after(headers: Any) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date), when given."""
    if ms := headers.get("retry-after-ms"):
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    # Here, not at the top: the email package is about 4 ms of every daemon's start, and an HTTP date in Retry-After is
    # rare (a number of seconds is what services send).
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value).timestamp() - time.time()
    except (TypeError, ValueError):
        return None
