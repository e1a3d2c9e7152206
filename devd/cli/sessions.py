"""The session commands (`devd ls`, `new`, `step`, `snapshot`, `restore`, `fork`, `pending`, `recover`, `close`,
`watch`, ...): clients of the daemon, showing its answers for people or as they came (`--json`)."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from devd.protocol import CLIENT_NAME_CHARS_MAX, METHODS, UsageResult
from devd.render import argv, brief, inline, json_safe

if TYPE_CHECKING:
    from devd.client import AsyncClient, Client
    from devd.messages import Action
from devd.cli.common import (
    EXIT_ANSWERED_ERROR,
    EXIT_OK,
    LocalError,
    _emit,
    _params,
    _pretty,
    _token,
    _when,
    table,
)


def _ls(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("session/list", _params(limit=args.limit, cursor=args.cursor))
    if args.json:
        _emit(raw + b"\n")
        return EXIT_OK
    page = msgspec.json.decode(raw)
    described = {s["session"]: described_of(client, s) for s in page["sessions"]}
    _emit(sessions_table(page["sessions"], described).encode())
    if page.get("next") is not None:
        # On stderr, so that the table alone goes down a pipe.
        print(f"devd: more sessions follow: devd ls --limit {args.limit} --cursor {page['next']}", file=sys.stderr)
    return EXIT_OK


def _named(raw: bytes, args: argparse.Namespace) -> int:
    """A result that names a session: the name alone, or the answer as it came."""
    _emit(raw + b"\n" if args.json else msgspec.json.decode(raw)["session"].encode() + b"\n")
    return EXIT_OK


def _new(client: Client, args: argparse.Namespace) -> int:
    config = {"model": args.model} if args.model else None
    return _named(client.call_raw("session/new", _params(config=config, session=args.session)), args)


def _step(client: Client, args: argparse.Namespace) -> int:
    # An empty key and a zero timeout are sent as given: they are the daemon's to refuse, not ours to drop.
    from devd.client import one_line

    try:
        event = msgspec.Raw(one_line(args.event.encode()))
    except ValueError as e:
        raise LocalError(str(e)) from None
    raw = client.call_raw(
        "session/step", _params(session=args.session, event=event, key=args.key, timeout_ms=args.timeout_ms)
    )
    _emit(raw + b"\n" if args.json else _pretty(raw))
    return EXIT_OK


def _restore(client: Client, args: argparse.Namespace) -> int:
    data = sys.stdin.read().strip() if args.snapshot == "-" else args.snapshot
    return _named(client.call_raw("session/restore", _params(snapshot=data, session=args.session)), args)


def _answer(client: Client, args: argparse.Namespace) -> int:
    """`devd answer SESSION ACTION REQUEST [WORDS | --decline]`: answer an MCP server's question."""
    client.initialize(token=_token(args), name=cli_client_name())
    if args.decline == bool(args.words):
        raise LocalError("give the answer (a JSON object, or field=value words) or --decline, not both, not neither")
    answer = None if args.decline else answer_words(args.words)
    client.answer(args.session, args.action, args.request, answer, decline=args.decline)
    if args.json:
        _emit(b"{}\n")
    else:
        said = "declined" if args.decline else "answered"
        _emit(f"question {args.request} of action {args.action} of {args.session}: {said}\n".encode())
    return EXIT_OK


def answer_words(words: list[str]) -> dict[str, Any]:
    """An answer given on a command line: one JSON object, or field=value words (a value read as JSON when it is
    JSON: true, 3, "x"; else taken as text); LocalError saying what is wrong."""
    if len(words) == 1 and words[0].lstrip().startswith("{"):
        try:
            given = msgspec.json.decode(words[0])
        except msgspec.DecodeError as e:
            raise LocalError(f"the answer is not a JSON object: {e}") from None
        if not isinstance(given, dict):
            raise LocalError("the answer is not a JSON object")
        return given
    answer: dict[str, Any] = {}
    for word in words:
        name, equals, value = word.partition("=")
        if not equals or not name:
            raise LocalError(f"{word!r} is not field=value; give field=value words, or one JSON object")
        try:
            answer[name] = msgspec.json.decode(value)
        except msgspec.DecodeError:
            answer[name] = value
    return answer


def _decision(decision: Literal["allow", "deny"]) -> Callable[[Client, argparse.Namespace], int]:
    """`devd approve` / `devd deny`: answer an action that waits for approval, naming it by the digest of the action
    the session shows as pending (the same digest its `session/approval` carried)."""

    def run(client: Client, args: argparse.Namespace) -> int:
        from devd.agent.approvals import action_digest

        client.initialize(token=_token(args), name=cli_client_name())
        found = [a for a in client.pending(args.session) if a.id == args.action and a.awaiting == "approval"]
        # An action no longer waiting is still asked of the daemon, which says why: CONFLICT naming who decided it,
        # or INVALID_PARAMS for one that never waited (no digest can match it).
        digest = action_digest(args.action, msgspec.structs.replace(found[0], awaiting=None).op) if found else "0" * 64
        client.approve(args.session, args.action, digest, decision, remember=args.remember)
        if args.json:
            _emit(b"{}\n")
        else:
            _emit(
                f"action {args.action} of {args.session}: {'allowed' if decision == 'allow' else 'denied'}\n".encode()
            )
        return EXIT_OK

    return run


def cli_client_name() -> str:
    """Who the command decides as (`by` of `session/decided`): the user, through devd's command line, in the
    characters a client's name may hold (`devd.protocol.client_name_problem`: no brackets; the daemon adds the
    peer's uid and pid itself), as `devd acp` names itself `devd acp: EDITOR`."""
    return f"devd cli: {getpass.getuser()}"[:CLIENT_NAME_CHARS_MAX]


def trace_line(r: dict[str, Any]) -> str:
    """One trace record for people: number, start, action, kind, outcome, duration, model and tokens (each `~N` when
    devd estimated it), error."""
    what = r["kind"] if r.get("model") is None else f"{r['kind']} {r['model']}"
    if r.get("attempt"):
        what += f" (attempt {r['attempt']})"
    about = "~" if r.get("estimated") else ""  # devd's estimate, never shown as the server's count
    tokens = (
        f" {about}{r['input_tokens']}+{about}{r['output_tokens']} tokens" if r.get("input_tokens") is not None else ""
    )
    error = f": {inline(r['error'])}" if r.get("error") else ""  # it may quote what a model chose
    took = f"{r['duration_ms']:.1f} ms"
    return f"{r['n']:>4} {r['started']} action {r['action']} {what} {r['outcome']} {took}{tokens}{error}\n"


def _watch(client: Client, args: argparse.Namespace) -> int:
    """Notifications as JSON lines (with or without --json: each is a message of the protocol) until the watch ends."""
    client.call("session/watch", _params(session=args.session, since=args.since))
    while True:
        notice = client.wait_notification()
        line = msgspec.json.encode({"method": notice.method, "params": notice.params})
        _emit(json_safe(line) + b"\n")  # the model's text in it cannot act on a terminal
        if notice.method == "session/unwatched":
            # The session closed (or expired): the watch is over, normally. Dropped for falling behind: exit 1,
            # and watch again with --since to catch up.
            closed = notice.params.get("reason") in ("closed", "expired")
            return EXIT_OK if closed else EXIT_ANSWERED_ERROR


class Plain(msgspec.Struct, frozen=True):
    """A command that is one call of a method of `devd.protocol.METHODS`: its arguments are the method's params (a
    required one positional, an optional one a flag), and for people it prints `show` of the answer (--json: the
    answer as it came)."""

    command: str
    method: str
    help: str
    show: Callable[[bytes], bytes]


def _member(member: str) -> Callable[[bytes], bytes]:
    return lambda raw: str(msgspec.json.decode(raw)[member]).encode() + b"\n"


def _nothing(raw: bytes) -> bytes:
    return b""


def usage_table(u: UsageResult) -> str:
    """`devd usage` and devd chat's /usage: what a session's model calls used, as a table."""
    headers = ["INPUT TOKENS", "OUTPUT TOKENS", "CACHED TOKENS", "CALLS", "REFUSED"]
    cells = [f"{n:,}" for n in (u.input_tokens, u.output_tokens, u.cached_tokens, u.calls, u.refused)]
    return table(headers, [cells], right=frozenset(range(5)))


def attention(session: str, stalled: str | None, pending: list[Action]) -> str:
    """What a session waits on a person for, and the `devd` command that carries it on: a stall and why (`devd
    resume`), each action waiting for approval (`devd approve`, `devd deny`), and each whose MCP server waits for an
    answer (`devd answer`)."""
    from devd.cli.operator import action_summary

    lines = []
    if stalled:
        lines.append(f"stalled: {inline(stalled)}")
        lines.append(
            f"  `{argv(['devd', 'resume', session])}` tries it again (after "
            f"`{argv(['devd', 'budget', session, 'TOKENS'])}` when a spend ceiling refused it)"
        )
    for a in pending:
        if a.awaiting == "approval":
            decide = argv(["devd", "approve", session, str(a.id)])
            lines.append(f"waiting for approval: action {a.id} {action_summary(a)} (`{decide}`, or `devd deny`)")
        elif a.awaiting == "input":
            answer = argv(["devd", "answer", session, str(a.id)])
            lines.append(
                f"waiting for an answer: action {a.id} {action_summary(a)}: its MCP server asks a question "
                f"(`{answer} REQUEST field=value ...`; `devd watch` or `devd attach` shows it)"
            )
    return "".join(line + "\n" for line in lines)


def _info(client: Client, args: argparse.Namespace) -> int:
    """`devd info`: the session's entry and what its turn waits for, its title, and what waits on a person."""
    raw = client.call_raw("session/info", {"session": args.session})
    if args.json:
        _emit(raw + b"\n")
        return EXIT_OK
    entry = msgspec.json.decode(raw)
    title = f"title: {inline(entry['title'])}\n" if entry.get("title") else ""
    pending = client.pending(args.session) if entry["state"] == "live" and entry["waiting"] else []
    _emit(_waits(raw) + (title + attention(args.session, entry.get("stalled"), pending)).encode())
    return EXIT_OK


class Node(msgspec.Struct, frozen=True):
    """A session of `devd tree`: its name, agent, state, usage (its delegated runs' included) and children."""

    session: str
    agent: str | None
    state: str
    why: str | None
    input_tokens: int
    output_tokens: int
    calls: int
    children: list[Node]


def tree_of(client: Client, session: str, root: bool = True) -> Node:
    """The session and its delegated runs, each with its own: a child's state its terminal one once it has ended
    (`session/wait`), else what it does (`describe`: running, waiting for approval, stalled); a child whose session
    is gone (closed) is `disconnected`, as its parent keeps it."""
    from devd.errors import HandleError

    try:
        info = msgspec.json.decode(client.call_raw("session/info", {"session": session}))
    except HandleError:
        if root:
            raise
        return Node(session, None, "disconnected", "its session was closed", 0, 0, 0, [])
    bound = client.agent(session)
    pending = client.pending(session) if info["state"] == "live" and info["waiting"] else []
    state, why = describe(info, bound.agent, bound.workspace, pending).doing, None
    if not root:
        waited = client.wait(session, 1, timeout_ms=0)  # a look: an ended turn is done at once
        if waited.done and waited.outcome is not None:
            state, why = waited.outcome, waited.why
    u = client.usage(session)
    below = u.children
    tokens = (
        u.input_tokens + (below.input_tokens if below else 0),
        u.output_tokens + (below.output_tokens if below else 0),
    )
    calls = u.calls + (below.calls if below else 0)
    kids = [tree_of(client, child, root=False) for child in info.get("children") or []]
    return Node(session, bound.agent, state, why, *tokens, calls, kids)


def tree_lines(node: Node, lead: str = "", last: bool = True, root: bool = True) -> list[str]:
    """`devd tree`: a session a line, each child under its parent (`├──`, `└──`): name, agent, state (and why a child
    did not complete), tokens and calls (its children's included)."""
    why = "" if node.why is None else f": {brief(inline(node.why), STALL_CHARS_MAX)}"
    calls = f"{node.calls:,} call{'' if node.calls == 1 else 's'}"
    about = f"{inline(node.session)}  {inline(node.agent or '-')}  {node.state}{why}  "
    about += f"{node.input_tokens + node.output_tokens:,} tokens in {calls}"
    lines = [about if root else f"{lead}{'└── ' if last else '├── '}{about}"]
    below = lead if root else lead + ("    " if last else "│   ")
    for i, child in enumerate(node.children):
        lines += tree_lines(child, below, i == len(node.children) - 1, root=False)
    return lines


def _tree(client: Client, args: argparse.Namespace) -> int:
    """`devd tree SESSION`: the session and its delegated runs, as a tree."""
    node = tree_of(client, args.session)
    _emit(
        msgspec.json.encode(node) + b"\n" if args.json else "".join(line + "\n" for line in tree_lines(node)).encode()
    )
    return EXIT_OK


def _resume(client: Client, args: argparse.Namespace) -> int:
    """`devd resume`: try a stalled session's action again."""
    client.resume(args.session)
    _emit(b"{}\n" if args.json else f"{args.session}: resumed\n".encode())
    return EXIT_OK


def _budget(client: Client, args: argparse.Namespace) -> int:
    """`devd budget SESSION N`: set (or with `none` remove) the session's spend ceiling."""
    client.set_budget(args.session, args.tokens)
    ceiling = "none" if args.tokens is None else f"{args.tokens:,} tokens"
    advice = f"; `{argv(['devd', 'resume', args.session])}` carries a stall it caused on"
    _emit(b"{}\n" if args.json else f"{args.session}: spend ceiling {ceiling}{advice}\n".encode())
    return EXIT_OK


def budget_tokens(text: str) -> int | None:
    """A ceiling as given: a number of tokens (1 or more; `_` and `,` may group digits), or `none` to remove it.
    ValueError saying so otherwise."""
    if text.strip().lower() == "none":
        return None
    try:
        tokens = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise ValueError(f"a spend ceiling is a number of tokens, or none; not {text!r}") from None
    if tokens < 1:
        raise ValueError(f"a spend ceiling is at least 1 token; not {tokens}")
    return tokens


def _waits(raw: bytes) -> bytes:
    entry = msgspec.json.decode(raw)
    waits = ", ".join(f"{w['kind']} (id {w['id']})" for w in entry["waiting"]) or "nothing"
    shown = sessions_table([entry]) + f"waiting for: {waits}\n"
    if entry.get("instructions") is not None:
        shown += f"instructions: {', '.join(inline(p) for p in entry['instructions']) or 'none'}\n"
    return shown.encode()


def _effect_lines(raw: bytes) -> bytes:
    lines = []
    for e in msgspec.json.decode(raw)["effects"]:
        subject = e["subject"] if isinstance(e["subject"], str) else " ".join(e["subject"])
        undo = " (undoable)" if e["undoable"] else ""
        lines.append(
            f"turn {e['turn']} action {e['action']} {e['at']} {e['kind']} {inline(subject)} {e['outcome']}{undo}\n"
        )
    return "".join(lines).encode()


def _rewound(raw: bytes) -> bytes:
    r = msgspec.json.decode(raw)
    shown = [f"restored {inline(p)}\n" for p in r["restored"]] + [f"removed {inline(p)}\n" for p in r["removed"]]
    for n in r["not_undone"]:
        subject = n["subject"] if isinstance(n["subject"], str) else " ".join(n["subject"])
        shown.append(f"not undone: action {n['action']} {n['kind']} {inline(subject)}\n")
    shown.append(f"the conversation before the rewind is kept as {r['kept_as']}\n")
    return "".join(shown).encode()


def _trace_lines(raw: bytes) -> bytes:
    page = msgspec.json.decode(raw)
    more = "" if page.get("next") is None else f"(more: --since {page['next']})\n"
    return ("".join(trace_line(record) for record in page["records"]) + more).encode()


def _pretty_member(member: str) -> Callable[[bytes], bytes]:
    return lambda raw: _pretty(msgspec.json.encode(msgspec.json.decode(raw)[member]))


PLAIN: tuple[Plain, ...] = (
    Plain("snapshot", "session/snapshot", "print a session's snapshot (base64)", _member("snapshot")),
    Plain("pending", "session/pending", "print the actions a session still waits for (JSON)", _pretty),
    Plain(
        "info",
        "session/info",
        "show one session's entry (as `devd ls` has it) and the actions its turn waits for",
        _waits,
    ),
    Plain(
        "transcript",
        "session/transcript",
        "print a session's conversation (JSON), the whole of it or from message --from on",
        _pretty_member("messages"),
    ),
    Plain(
        "fork",
        "session/fork",
        "start a session from another's history (up to step --at, default its latest) and print its name",
        _member("session"),
    ),
    Plain(
        "recover",
        "session/recover",
        "bring an ended or poisoned session back from its durable state",
        _member("session"),
    ),
    Plain("close", "session/close", "end a session and delete its state", _nothing),
    Plain(
        "usage",
        "session/usage",
        "show what a session's model calls used: tokens, calls, and calls a ceiling refused (a table)",
        lambda raw: usage_table(msgspec.json.decode(raw, type=UsageResult)).encode(),
    ),
    Plain(
        "model",
        "session/model",
        "set the model an agent session's next calls name (one of its profile's models)",
        _pretty,
    ),
    Plain(
        "compact",
        "session/compact",
        "compact an agent session's conversation now: the model summarises its start, which the summary replaces",
        _pretty,
    ),
    Plain(
        "trace",
        "session/trace",
        "show a session's trace: one line per model call attempt and per tool run (--since: after that record)",
        _trace_lines,
    ),
    Plain("title", "session/title", "set what a session is called (shown by devd ls and devd info)", _nothing),
    Plain(
        "effects",
        "session/effects",
        "list the commands, git calls and writes the daemon ran for a session, and its rewinds (--since: a turn)",
        _effect_lines,
    ),
    Plain(
        "rewind",
        "session/rewind",
        "put back the files a session's writes changed since TURN began and its conversation to before it "
        "(--force: even files someone else changed since)",
        _rewound,
    ),
    Plain(
        "drain",
        "daemon/drain",
        "have a fleet daemon give its sessions back to the fleet, so others take them at once",
        lambda raw: f"{msgspec.json.decode(raw)['sessions']} sessions given back\n".encode(),
    ),
)


def _plain_params(plain: Plain, args: argparse.Namespace) -> dict[str, Any]:
    """The method's params from the command's arguments, by the params' own names; a flag left out is not sent."""
    fields = msgspec.structs.fields(METHODS[plain.method].params)
    return _params(**{f.encode_name: getattr(args, f.name) for f in fields})


def _run_plain(plain: Plain) -> Callable[[Client, argparse.Namespace], int]:
    def run(client: Client, args: argparse.Namespace) -> int:
        raw = client.call_raw(plain.method, _plain_params(plain, args))
        _emit(raw + b"\n" if args.json else plain.show(raw))
        return EXIT_OK

    return run


def _plain_arguments(c: argparse.ArgumentParser, plain: Plain) -> None:
    """The method's params as arguments: `session` (and any other required one) positional, the rest flags."""
    for f in msgspec.structs.fields(METHODS[plain.method].params):
        doc = _param_help(f.type)
        if f.required:
            kind = int if _is_int(f.type) else str
            c.add_argument(f.name, type=kind, help="the session's name" if f.name == "session" else doc)
        elif isinstance(_constraint(f.type)[0], msgspec.inspect.BoolType):  # a switch: given, it is true
            flag = f"--{f.encode_name.replace('_', '-')}"
            c.add_argument(flag, dest=f.name, action="store_const", const=True, help=doc)
        else:
            number = _is_int(f.type)
            c.add_argument(
                f"--{f.encode_name.replace('_', '-')}",
                dest=f.name,
                type=int if number else str,
                metavar="N" if number else f.encode_name.upper(),
                help=doc,
            )


def _constraint(t: Any) -> tuple[msgspec.inspect.Type, str | None]:
    """A param's type, `X | None` as its X, and the description its `Meta` gives it."""
    info = msgspec.inspect.type_info(t)
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(i for i in info.types if not isinstance(i, msgspec.inspect.NoneType))
    if isinstance(info, msgspec.inspect.Metadata):
        return info.type, (info.extra_json_schema or {}).get("description")
    return info, None


def _is_int(t: Any) -> bool:
    return isinstance(_constraint(t)[0], msgspec.inspect.IntType)


def _param_help(t: Any) -> str | None:
    return _constraint(t)[1]


class Described(msgspec.Struct, frozen=True):
    """What `devd ls` says of a session the daemon drives: its agent, workspace, and what it does."""

    agent: str | None
    workspace: str | None
    doing: str


STALL_CHARS_MAX = 60  # of why a session is stalled, in `devd ls` (`devd info` shows it whole)


def describe(entry: dict[str, Any], agent: str | None, workspace: str | None, pending: list[Any] | None) -> Described:
    """A session's agent and workspace, and what it does: ended or poisoned; stalled and why; waiting for approval;
    running (its turn waits for actions); idle. `pending`: its pending actions (None: not asked, as for a session
    stored to disk, which is idle unless stalled)."""
    if entry["state"] in ("ended", "poisoned"):
        doing = entry["state"]
    elif entry.get("stalled"):
        doing = "stalled: " + brief(inline(entry["stalled"]), STALL_CHARS_MAX)
    elif any(getattr(a, "awaiting", None) == "approval" for a in pending or []):
        doing = "waiting for approval"
    elif any(getattr(a, "awaiting", None) == "input" for a in pending or []):
        doing = "waiting for an answer"
    elif pending:
        doing = "running"
    else:
        doing = "idle"
    return Described(agent, workspace, doing)


def described_of(client: Client, entry: dict[str, Any]) -> Described | None:
    """`describe` of a session, asked of the daemon (None: a session the daemon does not drive)."""
    if entry["state"] in ("ended", "poisoned"):
        return None
    bound = client.agent(entry["session"])
    if bound.agent is None:
        return None
    pending = client.pending(entry["session"]) if entry["state"] == "live" else None
    return describe(entry, bound.agent, bound.workspace, pending)


async def described_sessions(client: AsyncClient, sessions: list[dict[str, Any]]) -> str:
    """`sessions_table` of sessions with what each does, asked of the daemon (devd chat's /sessions)."""
    described: dict[str, Described | None] = {}
    for entry in sessions:
        bound = await client.agent(entry["session"]) if entry["state"] in ("live", "stored") else None
        if bound is None or bound.agent is None:
            described[entry["session"]] = None
            continue
        pending = await client.pending(entry["session"]) if entry["state"] == "live" else None
        described[entry["session"]] = describe(entry, bound.agent, bound.workspace, pending)
    return sessions_table(sessions, described)


def sessions_table(sessions: list[dict[str, Any]], described: dict[str, Described | None] | None = None) -> str:
    """`devd ls`: a session a line, by name; REASON only when a session has one (why it ended or was poisoned). When
    some are sessions the daemon drives (`described`), their TITLE (when any has one), AGENT, WORKSPACE and what each
    does as its STATE (running, waiting for approval, stalled and why, idle), and when each was last used."""
    if not sessions:
        return "no sessions\n"
    if described and any(d is not None for d in described.values()):
        return _agents_table(sessions, described)
    headers = ["NAME", "STATE", "SEQ", "WATCHERS", "CREATED", "LAST USED"]
    rows = [
        [s["session"], s["state"], str(s["seq"]), str(s.get("watchers", 0)), _when(s["created"]), _when(s["last_used"])]
        for s in sessions
    ]
    if any(s.get("reason") for s in sessions):
        headers.append("REASON")
        for row, s in zip(rows, sessions, strict=True):
            row.append(inline(s.get("reason") or ""))  # it may quote what a model (or its server) said
    return table(headers, rows, right=frozenset({2, 3}))


def _agents_table(sessions: list[dict[str, Any]], described: dict[str, Described | None]) -> str:
    titled = any(s.get("title") for s in sessions)
    headers = ["NAME", *(["TITLE"] if titled else []), "AGENT", "WORKSPACE", "STATE", "WATCHERS", "LAST USED"]
    rows = []
    for s in sessions:
        d = described.get(s["session"]) or Described(None, None, s["state"])
        title = [brief(inline(s.get("title") or "-"), TITLE_CHARS_MAX)] if titled else []
        agent, workspace = inline(d.agent or "-"), inline(d.workspace or "-")
        rows.append([s["session"], *title, agent, workspace, d.doing, str(s.get("watchers", 0)), _when(s["last_used"])])
    return table(headers, rows, right=frozenset({len(headers) - 2}))


TITLE_CHARS_MAX = 60  # a session's title in `devd ls`, as the daemon cuts a first prompt to make one
