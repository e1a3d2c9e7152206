"""The core's messages (ABI 2) as msgspec Structs: Config, Event, Call, Action, Op, Message.

A union on the wire is an object with exactly one member, so each union here is a Struct whose members are all
optional and whose `__post_init__` insists that exactly one is set. Optional members are omitted, never null, and
`encode` writes members in the order the core does, so a Struct round-trips to the core's exact bytes. A Tool call's
`input` is `msgspec.Raw`: the JSON the model wrote, kept byte for byte through the core and the daemon.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class _Wire(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Common options of every message."""


class _OneOf(_Wire, frozen=True):
    """A union: exactly one member is set."""

    def __post_init__(self) -> None:
        set_members = [f for f in self.__struct_fields__ if getattr(self, f) is not None]
        if len(set_members) != 1:
            raise ValueError(
                f"{type(self).__name__} needs exactly one member of {', '.join(self.__struct_fields__)}; "
                f"got {len(set_members)}"
            )


class Config(_Wire, frozen=True):
    """A session's configuration, given to `session/new`: the `model` its asks name (omitted: none is named), and what
    its asks carry: `"full"` (omitted: the default), the whole transcript in every `Model` ask; `"delta"`, only the
    messages added since the previous ask, from message `from` on (`session/transcript` gives the whole)."""

    model: str | None = None
    asks: Literal["full", "delta"] | None = None


class Exec(_Wire, frozen=True):
    """Run a command, `argv[0]` with its arguments. An action's Exec is answered by an `Exec` event with its id."""

    argv: list[str]


class Read(_Wire, frozen=True):
    """Read the file at `path`, relative to the workspace. Answered by a `File` event with the action's id."""

    path: str


class Write(_Wire, frozen=True):
    """Write `text` to the file at `path`, relative to the workspace. Answered by a `File` event with its id."""

    path: str
    text: str


class Git(_Wire, frozen=True):
    """Run git with the arguments `argv`. Answered by a `Git` event with the action's id."""

    argv: list[str]


class Browse(_Wire, frozen=True):
    """Fetch the page at `url`. Answered by a `Browse` event with the action's id."""

    url: str


# A Tool call's input: any JSON value as the model wrote it (the core dispatches only an object), kept byte for byte.
ToolInput = Annotated[msgspec.Raw, msgspec.Meta(description="The tool's input, a JSON object, byte for byte.")]


class ToolCall(_Wire, frozen=True):
    """Call the tool named `name` (1-128 bytes of `[A-Za-z0-9_.:/-]`) with `input`, a JSON object kept byte for byte as
    the model wrote it. Answered by a `Tool` event with the action's id."""

    name: str
    input: ToolInput


class Call(_OneOf, frozen=True):
    """A call the model asks for; exactly one member: `Exec`, `Read`, `Write`, `Git`, `Browse` or `Tool`.

    A `Read` or `Write` whose path leaves the workspace (absolute, or climbing out with `..`) is never dispatched: the
    core records it as failed ("refused: ... is not inside the workspace") and the model sees that. So is a `Tool`
    whose name is not one or whose input is not a JSON object (`refused: ...`, saying which).
    """

    Exec: Exec | None = None
    Read: Read | None = None
    Write: Write | None = None
    Git: Git | None = None
    Browse: Browse | None = None
    Tool: ToolCall | None = None


class Turn(_Wire, frozen=True):
    """Start a turn with the user's `prompt`. Its `id` must be above every turn id the session has had (a lower one is
    ignored); while another turn runs, it waits behind it.
    """

    id: int
    prompt: str


class Reply(_Wire, frozen=True):
    """What the model answered: `text`, and the `calls` it wants carried out (none: the turn ends with the text)."""

    text: str | None = None
    calls: list[Call] | None = None


class Answer(_Wire, frozen=True):
    """The model's `reply` to the `Model` action numbered `id`."""

    id: int
    reply: Reply


class Output(_Wire, frozen=True):
    """The result of the call action numbered `id`: its `text` (output, or what went wrong) and whether it `failed`."""

    id: int
    text: str
    failed: bool = False


class Cancel(_Wire, frozen=True):
    """Cancel the turn numbered `turn`, running or waiting; its `Done` says `Cancelled`."""

    turn: int


class Summarize(_Wire, frozen=True):
    """Replace the conversation's first `upto` messages (as `session/transcript` numbers them) with one `Summary`
    message holding `text`. Refused (`MALFORMED`, nothing changes) when `upto` is 0 or past the end, when it would keep
    a call's result without its call (message `upto` is a `Tool` message), or when it would replace the `Agent`
    message whose calls are still waited for. A turn waiting on its ask is asked again with what is left."""

    upto: int
    text: str


class Event(_OneOf, frozen=True):
    """What a session is stepped with; exactly one member.

    `Turn` starts a turn; `Model` answers a `Model` action; `Exec`, `File` (for `Read` and `Write`), `Git`, `Browse`
    and `Tool` answer those calls, each with the action's id; `Cancel` cancels a turn; `Timer` is a timer tick;
    `Summary` bounds the conversation.
    """

    Turn: Turn | None = None
    Model: Answer | None = None
    Exec: Output | None = None
    File: Output | None = None
    Git: Output | None = None
    Browse: Output | None = None
    Tool: Output | None = None
    Cancel: Cancel | None = None
    Timer: Literal[True] | None = None
    Summary: Summarize | None = None


class Dispatch(_Wire, frozen=True):
    """A call the model asked for, under the action id it was dispatched with."""

    id: int
    call: Call


class Agent(_Wire, frozen=True):
    """The model's part of the conversation: its `text`, and the `calls` it dispatched."""

    text: str | None = None
    calls: list[Dispatch] | None = None


class Tool(_Wire, frozen=True):
    """A call's result in the conversation, under the call's action id."""

    id: int
    text: str
    failed: bool = False


class Summary(_Wire, frozen=True):
    """What stands for the start of the conversation once a `Summary` event replaced it: its `text`, and how many
    messages of the whole conversation it `replaced` (earlier summaries' included). Only ever the first message."""

    text: str
    replaced: int


class Message(_OneOf, frozen=True):
    """One entry of the conversation the model is sent; exactly one member: `User` (a prompt), `Agent` (the model's
    answer), `Tool` (a call's result) or `Summary` (the start of the conversation, summarised; only ever first).
    """

    User: str | None = None
    Agent: Agent | None = None
    Tool: Tool | None = None
    Summary: Summary | None = None


class Ask(_Wire, frozen=True, kw_only=True):
    """Ask the model: the whole conversation so far (`messages`), and the `model` the session's config names. Answered
    by a `Model` event with the action's id. In a session made with `asks: "delta"`, `messages` are only those added
    since the previous ask and `from` is the index of the first of them in the whole conversation (0 at the first
    ask): every ask's messages, in order, are the conversation.
    """

    model: str | None = None
    from_: int | None = msgspec.field(default=None, name="from")
    messages: list[Message]


class Outcome(_OneOf, frozen=True):
    """How a turn ended; exactly one member: `Complete` or `Cancelled`."""

    Complete: Literal[True] | None = None
    Cancelled: Literal[True] | None = None


class Done(_Wire, frozen=True):
    """The turn numbered `turn` is over, with its `outcome`."""

    turn: int
    outcome: Outcome


class Op(_OneOf, frozen=True):
    """What an action asks for; exactly one member.

    `Model`, `Exec`, `Read`, `Write`, `Git`, `Browse` and `Tool`: carry it out, and step its result under the action's
    id.
    `Emit`: text for the user. `Save`: the daemon has saved a snapshot (nothing to do). `Done`: the turn is over.
    """

    Model: Ask | None = None
    Exec: Exec | None = None
    Read: Read | None = None
    Write: Write | None = None
    Git: Git | None = None
    Browse: Browse | None = None
    Tool: ToolCall | None = None
    Emit: str | None = None
    Save: Literal[True] | None = None
    Done: Done | None = None


class Action(_Wire, frozen=True):
    """One thing the core wants done, under its `id` (numbered in the session, increasing, never reused). In
    `session/pending` of a session the daemon drives, an action not started until a client decides carries
    `awaiting: "approval"`, and a tool call whose MCP server waits for a client's answer to its question `awaiting:
    "input"` (the core never writes either)."""

    id: int
    op: Op
    awaiting: Literal["approval", "input"] | None = None


_encoder = msgspec.json.Encoder()
_actions = msgspec.json.Decoder(list[Action])


def encode(message: msgspec.Struct) -> bytes:
    """The message as the core reads and writes it."""
    return _encoder.encode(message)


def encode_actions(actions: list[Action]) -> bytes:
    """Actions as the core writes them (the wire adds `awaiting` to those waiting for a client's decision)."""
    return _encoder.encode(actions)


def decode_actions(data: bytes) -> list[Action]:
    """A core's answer; raises msgspec.ValidationError or msgspec.DecodeError when it is not one."""
    return _actions.decode(data)


_messages = msgspec.json.Decoder(list[Message])


def decode_messages(data: bytes) -> list[Message]:
    """A transcript as the core writes it; raises msgspec.ValidationError or msgspec.DecodeError when it is not one."""
    return _messages.decode(data)


_event = msgspec.json.Decoder(Event)

# The Event members that answer a call, each with an Output.
RESULTS = ("Exec", "File", "Git", "Browse", "Tool")


def event_error(data: bytes) -> str | None:
    """What is wrong with an event, in msgspec's words ("Expected `int`, got `str` - at `$.Turn.id`"), or None
    when these types accept it (and only the core's stricter decoder does not)."""
    try:
        _event.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return str(e)
    except RecursionError:
        return "it nests too deeply"
    return None


def without_payload(data: bytes) -> bytes | None:
    """The event with what it carries dropped (a result's text, a Model answer's reply), its kind and id kept: what
    is journalled of an event the session took no notice of, which a replay ignores just the same. None when it
    is not a result or a Model answer (or cannot be read as an event)."""
    try:
        event = _event.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    if event.Model is not None:
        return encode(Event(Model=Answer(id=event.Model.id, reply=Reply(text=""))))
    for kind in RESULTS:
        output: Output | None = getattr(event, kind)
        if output is not None:
            return encode(msgspec.structs.replace(event, **{kind: Output(id=output.id, text="", failed=output.failed)}))
    return None


# Constructors the tests and the demo read best with.
def turn(id: int, prompt: str) -> Event:
    return Event(Turn=Turn(id=id, prompt=prompt))


def answer(id: int, text: str | None = None, calls: list[Call] | None = None) -> Event:
    return Event(Model=Answer(id=id, reply=Reply(text=text, calls=calls)))


def ask(*messages: Message, model: str | None = None) -> Op:
    return Op(Model=Ask(messages=list(messages), model=model))


def done(turn: int, *, cancelled: bool = False) -> Op:
    outcome = Outcome(Cancelled=True) if cancelled else Outcome(Complete=True)
    return Op(Done=Done(turn=turn, outcome=outcome))
