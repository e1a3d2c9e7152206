"""devd.driver against the real daemon: a turn carried out through handlers, one keyed step per result, a turn that
outlives a daemon restart and a lost answer, the scenarios both drivers play (tests/driver_scenarios.json), and the
worked example; the retry policy with small fakes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from devd import errors
from devd.client import ActionsNotice, AsyncClient, Client
from devd.driver import (
    Handlers,
    NamedTool,
    Retry,
    ToolOutput,
    TurnError,
    result_key,
    resume_turn,
    run_turn,
    run_turn_blocking,
)
from devd.messages import (
    Action,
    Ask,
    Browse,
    Call,
    Dispatch,
    Done,
    Event,
    Exec,
    Message,
    Op,
    Outcome,
    Output,
    Read,
    Reply,
    ToolCall,
    answer,
    turn,
)
from tests.daemon import ROOT, Daemon, daemon_env
from tests.harness import InProcess
from tests.helpers import FIX, agent, tool, user
from tests.postgres import postgres, postgres_url  # noqa: F401  (the fixtures: the fleet scenario's store)
from tests.test_fleet import fleet_process

CALLS = [Call(Exec=Exec(argv=["make"])), Call(Read=Read(path="build.log"))]
SEED = [Reply(calls=CALLS), Reply(text="Declare x.")]  # the seed turn's model: two calls, then its answer
COMPLETE = Done(turn=1, outcome=Outcome(Complete=True))
QUICK = Retry(attempts=4, first_delay_s=0.001)
PATIENT = Retry(attempts=30, max_delay_s=1.0)  # about 25 s for a daemon to come back, on a loaded machine


class Script:
    """Handlers that record each call in order, and a model that answers from a script: after n answers, the
    (n+1)th, whichever connection or retry asks."""

    def __init__(self, replies: list[Reply], on_read: Callable[[], None] = lambda: None) -> None:
        self.replies = replies
        self.on_read = on_read
        self.calls: list[tuple[str, object]] = []

    def model(self, ask: Ask) -> Reply:
        self.calls.append(("model", ask.messages))
        return self.replies[sum(m.Agent is not None for m in ask.messages)]

    def exec(self, op: Exec) -> ToolOutput:
        self.calls.append(("exec", op.argv))
        return ToolOutput("main.c:3: error: x undeclared", failed=True)

    def read(self, op: Read) -> str:
        self.calls.append(("read", op.path))
        self.on_read()
        return "cc -c main.c"

    def emit(self, text: str) -> None:
        self.calls.append(("emit", text))

    def handlers(self) -> Handlers:
        return Handlers(model=self.model, exec=self.exec, read=self.read, emit=self.emit)


# What the seed turn's handlers see, in order.
SEED_CALLS: list[tuple[str, object]] = [
    ("model", [user(FIX)]),
    ("exec", ["make"]),
    ("read", "build.log"),
    (
        "model",
        [
            user(FIX),
            agent(calls=[Dispatch(id=2, call=CALLS[0]), Dispatch(id=3, call=CALLS[1])]),
            tool(2, "main.c:3: error: x undeclared", True),
            tool(3, "cc -c main.c"),
        ],
    ),
    ("emit", "Declare x."),
]

# The seed turn's steps, as the journal keeps them.
SEED_JOURNAL = [
    (1, turn(1, FIX)),
    (2, answer(1, calls=CALLS)),
    (3, Event(Exec=Output(id=2, text="main.c:3: error: x undeclared", failed=True))),
    (4, Event(File=Output(id=3, text="cc -c main.c"))),
    (5, answer(4, "Declare x.")),
]


def journal(c: Client, session: str) -> tuple[list[tuple[int, Event]], int]:
    """Every step of session (from `watch` since 0), and its last step number (from `session/list`)."""
    notices = itertools.islice(c.watch(session, since=0, timeout=10), 5)
    steps = [(n.seq, n.event) for n in notices if isinstance(n, ActionsNotice)]
    return steps, c.list().sessions[0].seq


# -- a turn, through its handlers ------------------------------------------------------------------------------------


async def test_run_turn_carries_out_the_seed_turn_through_each_handler_in_order(daemon: InProcess) -> None:
    script = Script(SEED)
    async with AsyncClient.connect(daemon.socket) as c:
        done = await run_turn(c, await c.new(session="s"), FIX, script.handlers())
    assert (done, script.calls) == (COMPLETE, SEED_CALLS)


async def test_run_turn_reports_each_result_in_a_step_of_its_own(daemon: InProcess, client: Client) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, Script(SEED).handlers())
    assert journal(client, "s") == (SEED_JOURNAL, 5)


class Crash(Exception):
    """What a handler raises to stand for the client dying half-way through a turn."""


def crash() -> None:
    raise Crash


async def crashed_after_exec(c: AsyncClient) -> str:
    """Session "s" whose seed turn's client died while reading, after its Exec result was stepped."""
    with pytest.raises(Crash):
        await run_turn(c, await c.new(session="s"), FIX, Script(SEED, on_read=crash).handlers())
    return "s"


async def test_run_turn_started_again_with_the_same_turn_carries_out_only_what_has_no_result(daemon: InProcess) -> None:
    script = Script(SEED)
    async with AsyncClient.connect(daemon.socket) as c:
        done = await run_turn(c, await crashed_after_exec(c), FIX, script.handlers(), turn=1)
    assert (done, script.calls) == (COMPLETE, SEED_CALLS[2:])


async def test_resume_turn_carries_out_what_the_session_waits_for_and_nothing_twice(daemon: InProcess) -> None:
    script = Script(SEED)
    async with AsyncClient.connect(daemon.socket) as c:
        done = await resume_turn(c, await crashed_after_exec(c), script.handlers())
    assert (done, script.calls) == (COMPLETE, SEED_CALLS[2:])


async def test_resume_turn_of_a_session_with_no_turn_running_is_none(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, Script(SEED).handlers())
        assert await resume_turn(c, "s", Script(SEED).handlers()) is None


async def test_each_handler_that_takes_two_arguments_gets_the_action_too(daemon: InProcess) -> None:
    seen: list[int] = []

    def model(ask: Ask, action: Action) -> Reply:
        seen.append(action.id)
        return SEED[sum(m.Agent is not None for m in ask.messages)]

    def read(op: Read, action: Action) -> str:
        seen.append(action.id)
        return "cc -c main.c"

    def exec(op: Exec, action: Action) -> str:
        seen.append(action.id)
        return ""

    handlers = Handlers(model=model, exec=exec, read=read)
    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, handlers)
    assert seen == [1, 2, 3, 4]


async def test_a_result_sent_again_under_its_derived_key_is_replayed_not_stepped(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, Script(SEED).handlers())
        again = await c.step_answer("s", SEED_JOURNAL[2][1], key=result_key("s", 2))
    assert again.replayed is True


async def test_turn_ids_default_to_the_sessions_last_step_plus_one(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        session = await c.new(session="s")
        first = await run_turn(c, session, FIX, Script(SEED).handlers())
        second = await run_turn(c, session, "again", Script([Reply(text="ok")] * 3).handlers())
    assert (first.turn, second.turn) == (1, 6)


async def test_the_default_turn_id_is_read_from_the_named_session_not_its_neighbours(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        for name in ("r", "rzz", "s", "s-", "sa"):
            await c.new(session=name)
        for _ in range(3):
            await c.step("rzz", Event(Timer=True))
        done = await run_turn(c, "s", FIX, Script(SEED).handlers())
    assert done.turn == 1


async def test_a_turn_left_running_is_carried_out_before_the_new_one(daemon: InProcess) -> None:
    script = Script([Reply(text="one"), Reply(text="two")])
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        await c.step("s", turn(1, "first"))  # a UI that stopped here
        done = await run_turn(c, "s", "second", script.handlers())
    kinds = [(kind, value if kind == "emit" else len(value)) for kind, value in script.calls]  # type: ignore[arg-type]
    assert (done.turn, kinds) == (2, [("model", 1), ("emit", "one"), ("model", 3), ("emit", "two")])


async def test_a_turn_id_not_above_the_sessions_highest_raises_turn_error(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        await c.step("s", turn(5, "first"))
        with pytest.raises(TurnError, match="turn 3 was ignored"):
            await run_turn(c, "s", "second", Script(SEED).handlers(), turn=3)


async def test_a_call_of_a_kind_without_a_handler_is_answered_as_failed(daemon: InProcess) -> None:
    script = Script([Reply(calls=[Call(Browse=Browse(url="https://example.com"))]), Reply(text="ok")])
    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, script.handlers())
    last_ask: list[Message] = script.calls[1][1]  # type: ignore[assignment]
    assert last_ask[-1] == tool(2, "this client cannot browse the web", True)


# A reply calling two tools by name: one the tests' handlers know, one they do not.
SEARCH = Call(Tool=ToolCall(name="code.search", input=msgspec.Raw(b'{"q": "x undeclared", "in": ["main.c"]}')))
DEPLOY = Call(Tool=ToolCall(name="deploy", input=msgspec.Raw(b"{}")))


async def named_turn(daemon: InProcess, tools: dict[str, NamedTool]) -> list[Message]:
    """The results the model hears of a turn whose reply calls SEARCH and DEPLOY, carried out with `tools`."""
    script = Script([Reply(calls=[SEARCH, DEPLOY]), Reply(text="ok")])
    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, Handlers(model=script.model, tools=tools))
    last_ask: list[Message] = script.calls[1][1]  # type: ignore[assignment]
    return last_ask[2:]


async def test_a_tool_action_is_carried_out_by_the_handler_of_its_name_given_its_input_parsed(
    daemon: InProcess,
) -> None:
    given: list[tuple[int, dict[str, Any], msgspec.Raw]] = []

    def search(input: dict[str, Any], action: Action) -> str:
        assert action.op.Tool is not None
        given.append((action.id, input, action.op.Tool.input))
        return "main.c:3: return x;"

    heard = await named_turn(daemon, {"code.search": search, "lint": lambda input: "not called"})
    assert (given, heard) == (
        [(2, {"q": "x undeclared", "in": ["main.c"]}, msgspec.Raw(b'{"q": "x undeclared", "in": ["main.c"]}'))],
        [tool(2, "main.c:3: return x;"), tool(3, "this client has no tool named deploy", True)],
    )


async def test_a_named_tools_failed_output_is_stepped_as_a_failed_tool_result(daemon: InProcess) -> None:
    async def search(input: dict[str, Any]) -> ToolOutput:
        await anyio.sleep(0)
        return ToolOutput("the index is stale", failed=True)

    heard = await named_turn(daemon, {"code.search": search})
    assert heard[0] == tool(2, "the index is stale", True)


async def test_a_driver_without_tools_answers_every_named_call_failed_naming_it(daemon: InProcess) -> None:
    assert await named_turn(daemon, {}) == [
        tool(2, "this client has no tool named code.search", True),
        tool(3, "this client has no tool named deploy", True),
    ]


async def test_a_named_tools_handler_that_raises_stops_the_loop_and_its_call_stays_owed(daemon: InProcess) -> None:
    def search(input: dict[str, Any]) -> str:
        raise Crash

    script = Script([Reply(calls=[SEARCH, DEPLOY]), Reply(text="ok")])
    async with AsyncClient.connect(daemon.socket) as c:
        with pytest.raises(Crash):
            await run_turn(
                c, await c.new(session="s"), FIX, Handlers(model=script.model, tools={"code.search": search})
            )
        owed = await c.pending("s")
    assert owed == [Action(id=2, op=Op(Tool=SEARCH.Tool)), Action(id=3, op=Op(Tool=DEPLOY.Tool))]


async def test_coroutine_handlers_are_awaited(daemon: InProcess) -> None:
    async def model(ask: Ask) -> Reply:
        await anyio.sleep(0)
        return Reply(text="awaited")

    shown: list[str] = []

    async def emit(text: str) -> None:
        shown.append(text)

    async with AsyncClient.connect(daemon.socket) as c:
        await run_turn(c, await c.new(session="s"), FIX, Handlers(model=model, emit=emit))
    assert shown == ["awaited"]


def test_run_turn_blocking_runs_a_turn_without_an_event_loop(daemon: InProcess, client: Client) -> None:
    session = client.new(session="s")
    assert run_turn_blocking(session, FIX, Script(SEED).handlers(), address=daemon.socket) == COMPLETE


# -- a turn that outlives its daemon ---------------------------------------------------------------------------------


async def test_run_turn_survives_a_daemon_restart_mid_turn_and_steps_each_result_once(daemon: InProcess) -> None:
    """SIGTERM after the first tool result, the daemon back 0.5 s later on the same state directory."""
    restart = threading.Timer(0.5, daemon.start)
    exits: list[int] = []

    def stop_and_restart() -> None:
        if not exits:
            exits.append(daemon.stop())
            restart.start()

    script = Script(SEED, on_read=stop_and_restart)
    async with AsyncClient.connect(daemon.socket) as c:
        done = await run_turn(c, await c.new(session="s"), FIX, script.handlers(), retry=PATIENT)
    restart.join()
    with daemon.client() as c2:
        steps = journal(c2, "s")
    assert (done, exits, script.calls, steps) == (COMPLETE, [0], SEED_CALLS, (SEED_JOURNAL, 5))


async def test_a_result_whose_answer_died_with_the_daemon_is_replayed_not_stepped_twice(tmp_path: Path) -> None:
    """SIGKILL after the Exec result is durable and before it is answered (the daemon's 4th commit); the driver
    reconnects, sends it again under its key, and goes on from `session/pending`."""
    d = Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.after=kill@4"})
    script = Script(SEED)
    killed: list[tuple[int, int]] = []  # the daemon's exit status, and how many handler calls came before

    def restart_when_killed() -> None:
        assert d.proc is not None
        killed.append((d.proc.wait(60), len(script.calls)))
        d.env = {}
        d.start()

    with d:
        restart = threading.Thread(target=restart_when_killed)
        restart.start()
        async with AsyncClient.connect(d.socket) as c:
            done = await run_turn(c, await c.new(session="s"), FIX, script.handlers(), retry=PATIENT)
        restart.join()
        with d.client() as c2:
            steps = journal(c2, "s")
    assert (killed, done, script.calls, steps) == ([(-9, 2)], COMPLETE, SEED_CALLS, (SEED_JOURNAL, 5))


# -- the scenarios both drivers play -------------------------------------------------------------------------------

SCENARIOS: dict[str, Any] = json.loads((ROOT / "tests" / "driver_scenarios.json").read_text())


class Scenario:
    """One scenario of tests/driver_scenarios.json (its `about` says how they are played) on its daemons: what the
    drivers carried out, and how each driver call ended, in the order they ended."""

    def __init__(self, spec: dict[str, Any], daemons: dict[str, Daemon]) -> None:
        self.session: str = spec["session"]
        self.daemons = daemons
        # Through JSON, not convert: a Tool call's input is a msgspec.Raw, which convert does not make from a dict.
        model = msgspec.json.encode(SCENARIOS["models"][spec.get("model", "build")])
        self.replies = msgspec.json.decode(model, type=list[Reply])
        self.carried: list[list[object]] = []
        self.ended: list[list[object]] = []

    async def run(self, spec: dict[str, Any]) -> None:
        """Make one driver call on a connection of its own, and note how it ended."""
        handlers = self.handlers(spec["driver"], spec.get("at", {}))
        ended: object
        async with AsyncClient.connect(self.daemons[spec.get("via", "a")].socket) as c:
            try:
                if spec["call"] == "run_turn":
                    prompt, turn = spec["prompt"], spec.get("turn")
                    ended = msgspec.to_builtins(
                        await run_turn(c, self.session, prompt, handlers, turn=turn, retry=PATIENT)
                    )
                else:
                    ended = msgspec.to_builtins(await resume_turn(c, self.session, handlers, retry=PATIENT))
            except Crash:
                ended = "crash"
            except TurnError:
                ended = "TurnError"
        self.ended.append([spec["driver"], ended])

    def handlers(self, driver: str, at: dict[str, Any]) -> Handlers:
        """Handlers that answer as the file says, note what they carry out, and meet the hooks of `at`."""

        async def hook(point: str) -> None:
            what = at.get(point)
            if what == "crash":
                raise Crash
            if what is not None:
                await self.run(what)

        async def carry(kind: str, action: Action) -> None:
            await hook(f"before {action.id}")
            self.carried.append([driver, kind, action.id])
            await hook(f"after {action.id}")

        async def model(ask: Ask, action: Action) -> Reply:
            last_user = max(i for i, m in enumerate(ask.messages) if m.User is not None)
            await carry("model", action)
            return self.replies[sum(m.Agent is not None for m in ask.messages[last_user:])]

        async def exec(op: Exec, action: Action) -> ToolOutput:
            await carry("exec", action)
            return msgspec.convert(SCENARIOS["exec"], ToolOutput)

        async def read(op: Read, action: Action) -> ToolOutput:
            await carry("read", action)
            return msgspec.convert(SCENARIOS["read"], ToolOutput)

        async def emit(text: str, action: Action) -> None:
            await carry("emit", action)

        def named(name: str, said: dict[str, Any]) -> NamedTool:
            async def handle(input: dict[str, Any], action: Action) -> ToolOutput:
                assert input == said["input"], f"the handler of {name} was given {input}"
                await carry(f"tool {name}", action)
                return msgspec.convert(said["answer"], ToolOutput)

            return handle

        tools = {name: named(name, said) for name, said in SCENARIOS["tools"].items()}
        return Handlers(model=model, exec=exec, read=read, tools=tools, emit=emit)


def watched(c: Client, session: str, steps: int) -> list[dict[str, Any]]:
    """The first `steps` steps of session as `session/watch` from 0 gives them: each one's event and actions (JSON)."""
    notices = itertools.islice(c.watch(session, since=0, timeout=10), steps)
    return [
        msgspec.json.decode(msgspec.json.encode({"event": n.event, "actions": n.actions}))
        for n in notices
        if isinstance(n, ActionsNotice)
    ]


def ends(runs: list[dict[str, Any]]) -> list[list[object]]:
    """How each driver call of runs should end, in the order they end: a call made in a hook before its caller."""
    order: list[list[object]] = []
    for run in runs:
        order += ends([hooked for hooked in run.get("at", {}).values() if hooked != "crash"])
        order.append([run["driver"], run["ends"]])
    return order


@pytest.mark.parametrize("spec", SCENARIOS["scenarios"], ids=[s["name"] for s in SCENARIOS["scenarios"]])
async def test_the_shared_driver_scenario_carries_out_each_action_as_written(
    spec: dict[str, Any], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if spec.get("fleet"):
        url: str = request.getfixturevalue("postgres_url")
        a, b = fleet_process(tmp_path, url, "a"), fleet_process(tmp_path, url, "b")
    else:
        a, b = Daemon(tmp_path / "a", env={"DEVD_FAILPOINTS": spec["failpoints"]} if "failpoints" in spec else {}), None
    restarts: list[int] = []
    with a:
        with a.client() as c:
            c.new(session=spec["session"])
        if b is not None:
            b.start()

        def restart_each_death() -> None:  # the daemon armed with failpoints, started again without them
            assert a.proc is not None
            while "failpoints" in spec and a.proc.wait() == -9 and not stopped.is_set():
                restarts.append(1)
                a.env = {}
                a.start()

        stopped = threading.Event()
        supervisor = threading.Thread(target=restart_each_death, daemon=True)
        supervisor.start()
        try:
            scenario = Scenario(spec, {"a": a} if b is None else {"a": a, "b": b})
            for run in spec["runs"]:
                await scenario.run(run)
            with a.client() as c:
                seq = c.info(spec["session"]).seq
                steps = watched(c, spec["session"], seq) if "journal" in spec else None
        finally:
            stopped.set()
            if b is not None:
                b.stop()
    supervisor.join(timeout=30)
    assert (scenario.ended, scenario.carried, len(restarts), seq, steps) == (
        ends(spec["runs"]),
        spec["carried"],
        spec.get("restarts", 0),
        spec["seq"],
        spec.get("journal"),
    )


# -- the retry policy, with fakes: a real BUSY cannot be had on cue --------------------------------------------------


def answers(*outcomes: object) -> tuple[Callable[[], Awaitable[object]], list[object]]:
    """An attempt that raises or answers each outcome in turn, and the list of the tries made."""
    tries: list[object] = []
    left = iter(outcomes)

    async def attempt() -> object:
        outcome = next(left)
        tries.append(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return attempt, tries


async def no_reconnect() -> None:
    raise AssertionError("nothing should reconnect")


def test_retry_waits_twice_as_long_each_time_up_to_its_bound() -> None:
    assert Retry(attempts=5, first_delay_s=0.1, max_delay_s=0.3).delays() == [0.1, 0.2, 0.3, 0.3]


async def test_retry_tries_a_busy_call_again_until_it_answers() -> None:
    attempt, tries = answers(errors.BusyError("busy"), errors.BusyError("busy"), "answered")
    assert (await QUICK.call(attempt, no_reconnect), len(tries)) == (("answered", False), 3)


async def test_retry_gives_up_on_busy_after_its_attempts_with_the_busy_error() -> None:
    attempt, tries = answers(*[errors.BusyError("busy")] * 5)
    with pytest.raises(errors.BusyError):
        await QUICK.call(attempt, no_reconnect)
    assert len(tries) == 4


async def test_retry_reconnects_a_lost_connection_until_the_daemon_is_back_and_says_so() -> None:
    attempt, _ = answers(ConnectionError("lost"), "answered")
    reconnect, reconnects = answers(ConnectionRefusedError("not yet"), None)
    assert (await QUICK.call(attempt, reconnect), len(reconnects)) == (("answered", True), 2)  # type: ignore[arg-type]


async def test_retry_gives_up_reconnecting_after_its_attempts_with_the_refusal() -> None:
    attempt, _ = answers(ConnectionError("lost"))
    reconnect, reconnects = answers(*[ConnectionRefusedError("not yet")] * 5)
    with pytest.raises(ConnectionRefusedError):
        await QUICK.call(attempt, reconnect)  # type: ignore[arg-type]
    assert len(reconnects) == 4


# -- the worked example ----------------------------------------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "agent_loop.py"


def test_the_example_agent_loop_is_under_40_lines() -> None:
    assert len(EXAMPLE.read_text().splitlines()) < 40


def test_the_readme_shows_the_example_agent_loop_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```\n" in readme


def test_the_example_agent_loop_runs_a_turn_in_its_workspace(daemon: InProcess, tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), str(workspace)],
        env=daemon_env(DEVD_SOCKET=str(daemon.socket)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (run.returncode, run.stdout, run.stderr, (workspace / "todo.txt").read_text()) == (
        0,
        "exec wc -l todo.txt -> 2 todo.txt\ntodo.txt has 2 lines: buy milk, call mom.\nturn 1 complete\n",
        "",
        "buy milk\ncall mom\n",
    )
