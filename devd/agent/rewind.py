"""Rewind: put back what a session's Writes changed since a turn began, and move its conversation back to before it.

What it promises (`session/rewind`):
- It works from the effect ledger (`devd.agent.effects`): of the effects since the turn began (those a rewind before
  already undid left out), every file a Write changed is put back to what it was before the first of them, newest
  first (the file the latest Write changed first); a file no Write found there is removed. Commands and git calls
  cannot be undone: they are answered in `not_undone`, as is a Write whose previous content was not kept.
- Before anything is done, each of those files is checked to hold what the session's last Write of it left (for one
  cut short, that or what it replaced; a Write that failed changed nothing and is left out): where someone else
  changed it since, nothing is done and the answer is CONFLICT naming every such file; `force` puts them back
  regardless.
- The plan (`Plan`, kind `rewind`) is durable before anything changes. Then the conversation as it is is kept as a
  fork (`kept_as`), the files are put back, the session moves back to the step before the turn's `Turn` step (the
  records that belong to the steps dropped go with them: claims, inserted exchanges, reasoning, what summaries
  replaced; its ledger, trace, approvals, spend, model and title stay), and a `rewound` record (`Rewound`) says it
  is done. Each part can be done again: a rewind a stopped daemon left unfinished is finished at its next start
  (`finish_left`), or by the session's next `session/rewind`; until then `session/effects` shows it as an interrupted
  rewind.
- A turn running (not stalled) is BUSY: it would change the files under the rewind.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import anyio.to_thread
import msgspec
import structlog

from devd import failpoints
from devd.agent import effects, records, tools
from devd.agent.effects import EffectRecord
from devd.agent.records import Before
from devd.errors import BusyError, ConflictError, InternalError, InvalidParamsError
from devd.messages import Cancel, Event
from devd.protocol import NotUndone, RewindResult
from devd.sessions import summaries
from devd.storage.store import Record

if TYPE_CHECKING:
    from devd.agent.runner import Runtime

log = structlog.get_logger("devd.agent.rewind")

REWIND = "rewind"  # the record kinds: a plan, journalled before it starts
REWOUND = "rewound"  # and its end
# Records that go with the steps they follow: a claim, an exchange or a reasoning at a place of the conversation, what
# a Summary replaced.
CONVERSATION = (records.CLAIM, records.INSERTED, records.REASONING, summaries.REPLACED)
SCAN_ROWS = 256  # journal rows read at a time looking for a turn's step


class Put(msgspec.Struct, frozen=True):
    """One file to put back: `target` (relative to the workspace) as the Write of action `source` found it."""

    target: str
    source: int
    remove: bool


class Plan(msgspec.Struct, frozen=True):
    """A rewind of `session` to before turn `turn` (its step `at`, from step `head`): the files to put back, newest
    first, what cannot be undone, and the fork that keeps the conversation as it was. A fork made after the plan was
    journalled carries it too, for another session: only the session it names finishes it."""

    session: str
    turn: int
    at: int
    head: int
    kept_as: str
    files: list[Put]
    not_undone: list[NotUndone]


class Rewound(msgspec.Struct, frozen=True):
    """A rewind done: `started` is its plan's record number."""

    started: int
    turn: int
    restored: list[str]
    removed: list[str]
    not_undone: list[NotUndone]
    kept_as: str


class _Write(msgspec.Struct, frozen=True):
    action: int
    entry: EffectRecord


async def rewind(runtime: Runtime, session: str, turn: int, *, force: bool = False) -> RewindResult:
    """See the module's docstring. Raises HandleError (no such session), InvalidParamsError (not an agent's, no such
    turn, its history no longer kept), BusyError (a turn is running) and ConflictError (files changed since)."""
    binding = await runtime._bound(session)
    async with runtime.table.get(session).lock:
        if runtime.driving(session) and runtime.stalled(session) is None:
            raise BusyError(
                f"a turn of session {session!r} is running; cancel it (session/step with a Cancel) or wait for it to "
                "end, then rewind"
            )
        left = await _unfinished(runtime, session)
        for n, plan in left:
            done = await _finish(runtime, n, plan)
            if plan.turn == turn:
                return done
        plan = await _plan(runtime, session, turn, force)
        await runtime.sessions.add_record(Record(session, plan.head, REWIND, turn, records.encode(plan)))
        n = (await runtime.sessions.records(session, (REWIND,)))[-1].n
        log.info(
            "agent.rewinding",
            session=session,
            turn=turn,
            at=plan.at,
            files=len(plan.files),
            workspace=binding.workspace,
        )
        return await _finish(runtime, n, plan)


async def _plan(runtime: Runtime, session: str, turn: int, force: bool) -> Plan:
    """What a rewind of the session to before `turn` does, checked (see `rewind` for what it raises)."""
    at = await _step_before(runtime, session, turn)
    try:
        workspace = await runtime.workspace(session, runtime.table.get(session))
    except tools.Refused as e:
        raise InvalidParamsError(f"session {session!r} cannot be rewound: {e.why}") from None
    found = await runtime.sessions.records(session, (effects.EFFECT, REWOUND))
    writes, not_undone = _since(found, turn)
    files, kept_out = _files(writes)
    if not force:
        changed = await anyio.to_thread.run_sync(_changed, workspace, writes)
        if changed:
            raise ConflictError(
                f"not rewound: {', '.join(changed)} changed since session {session!r} last wrote "
                f"{'it' if len(changed) == 1 else 'them'} (someone else wrote there); nothing was put back: look at "
                "the changes, then rewind with force: true to put every file back regardless"
            )
    head = runtime.sessions.seq(session) or 0
    kept_as = f"{session[:32]}.t{turn}.{secrets.token_hex(4)}"
    return Plan(session, turn, at, head, kept_as, files, [*not_undone, *kept_out])


async def finish_left(runtime: Runtime) -> None:
    """At start: finish every rewind a stopped daemon left unfinished. One that cannot be finished stalls its session,
    saying why (its next `session/rewind` tries again)."""
    for session in await runtime.sessions.recorded(REWIND):
        if runtime.sessions.seq(session) is None:
            continue
        for n, plan in await _unfinished(runtime, session):
            try:
                await _finish(runtime, n, plan)
            except (tools.Refused, InternalError, InvalidParamsError) as e:
                why = e.why if isinstance(e, tools.Refused) else str(e)
                runtime.stall(
                    session,
                    runtime.table.get(session),
                    0,
                    f"a rewind to turn {plan.turn} left unfinished cannot be finished ({why}); "
                    "`session/rewind` tries again",
                )


async def _unfinished(runtime: Runtime, session: str) -> list[tuple[int, Plan]]:
    found = await runtime.sessions.records(session, (REWIND, REWOUND))
    done = {records.decode(r.body, Rewound).started for r in found if r.kind == REWOUND}
    plans = [(r.n, records.decode(r.body, Plan)) for r in found if r.kind == REWIND and r.n not in done]
    return [(n, p) for n, p in plans if p.session == session]


async def _finish(runtime: Runtime, n: int, plan: Plan) -> RewindResult:
    """Carry the plan out; each part is done again safely (a fork already made, a file already put back, a session
    already moved back)."""
    sessions, session = runtime.sessions, plan.session
    if sessions.seq(plan.kept_as) is None:
        await sessions.fork(session, plan.head, plan.kept_as)
        runtime.titles.made(plan.kept_as)
        await _settled(runtime, plan)
    data = await _contents(runtime, session, plan.files)
    restored: list[str] = []
    removed: list[str] = []
    for put in plan.files:
        try:
            await _put(runtime, plan, put, data.get(put.source))
        except (tools.Refused, OSError) as e:
            why = e.why if isinstance(e, tools.Refused) else e.strerror or str(e)
            raise InternalError(
                f"the rewind of session {session!r} to before turn {plan.turn} stopped at {put.target} ({why}); it is "
                "journalled: put right what is in the way, then session/rewind again (or restart the daemon) to "
                "finish it"
            ) from None
        (removed if put.remove else restored).append(put.target)
        failpoints.hit("agent.rewinding")
    if (sessions.seq(session) or 0) > plan.at:
        await sessions.back(session, plan.at, CONVERSATION)
    done = Rewound(n, plan.turn, restored, removed, plan.not_undone, plan.kept_as)
    await sessions.add_record(Record(session, plan.at, REWOUND, plan.turn, records.encode(done)))
    log.info("agent.rewound", session=session, turn=plan.turn, restored=len(restored), removed=len(removed))
    return RewindResult(restored, removed, plan.not_undone, plan.kept_as)


async def _put(runtime: Runtime, plan: Plan, put: Put, content: bytes | None) -> None:
    if content is None and not put.remove:  # never a removal in its place
        raise tools.Refused(f"what {put.target} held before turn {plan.turn} is no longer kept")
    workspace = await runtime.workspace(plan.session, runtime.table.get(plan.session))
    await anyio.to_thread.run_sync(tools.put_back, workspace, put.target, content)


async def _settled(runtime: Runtime, plan: Plan) -> None:
    """The fork keeps the conversation, never a turn to carry on: one still running there (the session was stalled)
    is cancelled in the fork, so that no daemon drives it in the workspace the rewind puts back."""
    if not await runtime.sessions.pending(plan.kept_as):
        return
    latest = await _last_turn(runtime, plan.kept_as, plan.at)
    if latest is not None:
        cancel = Event(Cancel=Cancel(turn=latest))
        await runtime.sessions.step(plan.kept_as, cancel, f"rewind:{plan.turn}:cancel")


async def _last_turn(runtime: Runtime, session: str, since: int) -> int | None:
    """The id of the last `Turn` step of the session after step `since`."""
    last = None
    while True:
        rows = await runtime.sessions.steps(session, since, SCAN_ROWS)
        last = next((_turn(e) for _, e in reversed(rows) if e.startswith(b'{"Turn"')), last)
        if len(rows) < SCAN_ROWS:
            return last
        since = rows[-1][0]


async def _contents(runtime: Runtime, session: str, files: list[Put]) -> dict[int, bytes]:
    """What each file is put back to, by the action that found it (a file to remove has none)."""
    wanted = {p.source for p in files if not p.remove}
    found = await runtime.sessions.records(session, (effects.EFFECT,))
    inline: dict[int, bytes] = {}
    for r in found:
        if r.action in wanted:
            before = records.decode(r.body, EffectRecord).before
            if before is not None and before.content is not None:
                inline[r.action] = before.content
    apart = await effects.contents(runtime.sessions, session, [a for a in wanted if a not in inline])
    return inline | apart


async def _step_before(runtime: Runtime, session: str, turn: int) -> int:
    """The step before the session's `Turn` step of id `turn`; INVALID_PARAMS when its conversation has none."""
    since = 0
    while True:
        rows = await runtime.sessions.steps(session, since, SCAN_ROWS)
        for seq, event in rows:
            if event.startswith(b'{"Turn"') and _turn(event) == turn:
                return seq - 1
        if len(rows) < SCAN_ROWS:
            raise InvalidParamsError(
                f"session {session!r} has no turn {turn} in its conversation (turn ids are what session/prompt "
                "answered; session/effects lists each effect's turn); name one of its turns"
            )
        since = rows[-1][0]


def _turn(event: bytes) -> int:
    try:
        found = _events.decode(event).Turn
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return 0 if found is None else found.id


def _since(found: list[Record], turn: int) -> tuple[list[_Write], list[NotUndone]]:
    """The Writes since `turn` began, in order, and the effects that cannot be undone; effects a rewind already
    undid (recorded before it, of its turn or later) are left out."""
    ran: list[tuple[int, EffectRecord]] = []
    for r in found:
        if r.kind == REWOUND:
            back = records.decode(r.body, Rewound).turn
            ran = [(a, e) for a, e in ran if e.turn < back]
        else:
            ran.append((r.action, records.decode(r.body, EffectRecord)))
    # A Write that failed changed nothing: what there is to put back is what the others found.
    writes = [
        _Write(a, e)
        for a, e in ran
        if e.turn >= turn and e.kind == "Write" and e.before is not None and e.outcome != "error"
    ]
    not_undone = [NotUndone(a, e.kind, e.subject) for a, e in ran if e.turn >= turn and e.kind != "Write"]
    return writes, not_undone


def _files(writes: list[_Write]) -> tuple[list[Put], list[NotUndone]]:
    """Each file the Writes changed, put back as the first of them found it, newest first; and those whose previous
    content was not kept."""
    first: dict[str, _Write] = {}
    last: dict[str, int] = {}
    for i, w in enumerate(writes):
        before = w.entry.before
        assert before is not None
        first.setdefault(before.target, w)
        last[before.target] = i
    puts: list[Put] = []
    kept_out: list[NotUndone] = []
    for target in sorted(last, key=last.__getitem__, reverse=True):
        w = first[target]
        before = w.entry.before
        assert before is not None
        if before.kept:
            puts.append(Put(target, w.action, not before.existed))
        else:
            kept_out.append(NotUndone(w.action, "Write", w.entry.subject))
    return puts, kept_out


def _changed(workspace: tools.Workspace, writes: list[_Write]) -> list[str]:
    """The files that hold neither what the session's last Write of each left nor (for a Write that failed or was cut
    short) what it found: someone else changed them since. On a worker thread."""
    last: dict[str, _Write] = {}
    for w in writes:
        assert w.entry.before is not None
        last[w.entry.before.target] = w
    changed = []
    for target, w in last.items():
        try:
            now = tools.fingerprint(workspace, target)
        except tools.Refused:
            changed.append(target)
            continue
        if now not in _expected(w.entry):
            changed.append(target)
    return changed


def _expected(entry: EffectRecord) -> set[str | None]:
    """What a file may hold after the Write (None: no file): what it wrote, and for one cut short, what it found."""
    before: Before | None = entry.before
    assert before is not None
    if entry.outcome == "ok":
        return {entry.wrote}
    return {entry.wrote, before.digest if before.existed else None}


_events = msgspec.json.Decoder(Event)
