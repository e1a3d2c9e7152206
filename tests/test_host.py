"""The core and its host, test by test as seed 000 (dev_test.go) states them, plus the rules it does not show."""

from __future__ import annotations

import sys
import threading
import time
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devd.errors import (
    AbiError,
    BusyError,
    DeadlineError,
    HandleError,
    MalformedError,
    MethodNotFoundError,
    NullError,
    PanicError,
    PoisonError,
)
from devd.host import Core, Instance
from devd.messages import (
    Action,
    Browse,
    Call,
    Cancel,
    Config,
    Dispatch,
    Event,
    Exec,
    Git,
    Message,
    Op,
    Output,
    Read,
    Summarize,
    Summary,
    ToolCall,
    Write,
    answer,
    ask,
    done,
    encode,
    turn,
)
from tests import modules
from tests.helpers import FIX, agent, finish, tool, user


def test_a_turn_runs_to_done(session: Instance) -> None:
    """The whole loop once: a prompt, a model that asks for two tools, their results, and an answer in words."""
    assert session.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]
    build, lib = Call(Exec=Exec(argv=["cargo", "build"])), Call(Read=Read(path="src/lib.rs"))
    assert session.step(answer(1, "Let me look.", [build, lib])) == [
        Action(id=2, op=Op(Exec=build.Exec)),
        Action(id=3, op=Op(Read=lib.Read)),
    ]
    failed = "error[E0425]: cannot find value `x` in this scope"
    assert session.step(Event(Exec=Output(id=2, text=failed, failed=True))) == []
    assert session.step(Event(File=Output(id=3, text="pub fn f() -> u8 { x }"))) == [
        Action(
            id=4,
            op=ask(
                user(FIX),
                agent("Let me look.", [Dispatch(id=2, call=build), Dispatch(id=3, call=lib)]),
                tool(2, failed, failed=True),
                tool(3, "pub fn f() -> u8 { x }"),
            ),
        )
    ]
    assert session.step(answer(4, "`x` was never declared.")) == finish(5, 1, "`x` was never declared.")


def test_the_core_answers_in_the_exact_bytes_of_the_protocol(session: Instance) -> None:
    session.step(turn(1, FIX))
    raw = session.step_raw(b'{"Model":{"id":1,"reply":{"text":"ok"}}}')
    assert raw == (
        b'[{"id":2,"op":{"Emit":"ok"}},{"id":3,"op":{"Save":true}},'
        b'{"id":4,"op":{"Done":{"turn":1,"outcome":{"Complete":true}}}}]'
    )


def test_a_redelivered_turn_asks_for_nothing(session: Instance) -> None:
    session.step(turn(7, FIX))
    assert [session.step(turn(id, FIX)) for id in (7, 6, 1)] == [[], [], []]
    makefile = Call(Read=Read(path="Makefile"))
    session.step(answer(1, calls=[makefile]))
    assert session.step(Event(File=Output(id=2, text="all: build"))) == [
        Action(id=3, op=ask(user(FIX), agent(calls=[Dispatch(id=2, call=makefile)]), tool(2, "all: build")))
    ]


def test_a_result_no_one_awaits_changes_nothing(session: Instance) -> None:
    session.step(turn(1, FIX))
    build, file = Call(Exec=Exec(argv=["make"])), Call(Read=Read(path="Makefile"))
    session.step(answer(1, calls=[build, file]))
    forged = [
        Event(File=Output(id=2, text="forged")),
        Event(Git=Output(id=2, text="forged")),
        Event(Exec=Output(id=3, text="forged")),
        Event(Browse=Output(id=3, text="forged")),
        Event(Exec=Output(id=99, text="forged")),
        answer(1, "forged"),
        answer(2, "forged"),
    ]
    assert [session.step(e) for e in forged] == [[]] * len(forged)
    assert session.step(Event(Exec=Output(id=2, text="made"))) == []
    assert session.step(Event(File=Output(id=3, text="all: build"))) == [
        Action(
            id=4,
            op=ask(
                user(FIX),
                agent(calls=[Dispatch(id=2, call=build), Dispatch(id=3, call=file)]),
                tool(2, "made"),
                tool(3, "all: build"),
            ),
        )
    ]
    assert session.step(Event(File=Output(id=3, text="all: build"))) == []


def test_a_path_out_of_the_workspace_is_refused(session: Instance) -> None:
    session.step(turn(1, "read the password file"))
    passwd, lib = Call(Read=Read(path="../../etc/passwd")), Call(Read=Read(path="src/lib.rs"))
    assert session.step(answer(1, calls=[passwd, lib])) == [Action(id=3, op=Op(Read=lib.Read))]
    told = [
        user("read the password file"),
        agent(calls=[Dispatch(id=2, call=passwd), Dispatch(id=3, call=lib)]),
        tool(2, "refused: ../../etc/passwd is not inside the workspace", failed=True),
        tool(3, "fn main() {}"),
    ]
    assert session.step(Event(File=Output(id=3, text="fn main() {}"))) == [Action(id=4, op=ask(*told))]

    hosts = Call(Write=Write(path="/etc/hosts", text="127.0.0.1 hanzo.ai"))
    told += [
        agent(calls=[Dispatch(id=5, call=hosts)]),
        tool(5, "refused: /etc/hosts is not inside the workspace", failed=True),
    ]
    assert session.step(answer(4, calls=[hosts])) == [Action(id=6, op=ask(*told))]


# -- the generic Tool call (ABI 2) -----------------------------------------------------------------------------------

SEARCH_INPUT = b'{ "q" : ["caf\\u00e9", 2.50e3], "z":{}, "a":null }'


def test_a_tool_call_round_trips_in_the_exact_bytes_the_model_wrote(session: Instance) -> None:
    """Its input byte for byte in the action, in what is pending, and in the ask that carries its result."""
    session.step(turn(1, FIX))
    call = b'{"Tool":{"name":"mcp:docs/search.v2-x_y","input":' + SEARCH_INPUT + b"}}"
    reply = b'{"Model":{"id":1,"reply":{"calls":[{"Tool":{"input":' + SEARCH_INPUT
    reply += b',"name":"mcp:docs/search.v2-x_y"}}]}}}'
    dispatched = b'[{"id":2,"op":' + call + b"}]"
    assert (session.step_raw(reply), session.pending()) == (dispatched, dispatched)
    assert session.step_raw(b'{"Tool":{"id":2,"text":"3 pages","failed":false}}') == (
        b'[{"id":3,"op":{"Model":{"messages":[{"User":"fix the build"},{"Agent":{"calls":[{"id":2,"call":'
        + call
        + b'}]}},{"Tool":{"id":2,"text":"3 pages"}}]}}}]'
    )


def test_a_tool_call_decodes_to_its_types_and_encodes_back_to_the_same_bytes(session: Instance) -> None:
    session.step(turn(1, FIX))
    search = Call(Tool=ToolCall(name="search", input=msgspec.Raw(SEARCH_INPUT)))
    assert session.step(answer(1, calls=[search])) == [Action(id=2, op=Op(Tool=search.Tool))]
    assert session.step(Event(Tool=Output(id=2, text="none", failed=True))) == [
        Action(id=3, op=ask(user(FIX), agent(calls=[Dispatch(id=2, call=search)]), tool(2, "none", failed=True)))
    ]


def test_a_result_of_another_family_or_a_closed_id_changes_nothing_for_a_tool_call(session: Instance) -> None:
    session.step(turn(1, FIX))
    search, build = Call(Tool=ToolCall(name="search", input=msgspec.Raw(b"{}"))), Call(Exec=Exec(argv=["make"]))
    session.step(answer(1, calls=[search, build]))
    # 2 went out as a Tool and 3 as an Exec; 1 is answered; 99 never went out.
    forged = [
        *(Event(**{kind: Output(id=2, text="forged")}) for kind in ("Exec", "File", "Git", "Browse")),
        Event(Tool=Output(id=3, text="forged")),
        Event(Tool=Output(id=1, text="forged")),
        Event(Tool=Output(id=99, text="forged")),
    ]
    assert [(session.step(e), session.ignored()) for e in forged] == [([], 2)] * 4 + [([], 3), ([], 1), ([], 99)]
    assert session.step(Event(Tool=Output(id=2, text="found"))) == []
    assert (session.step(Event(Tool=Output(id=2, text="again"))), session.ignored()) == ([], 2)
    assert session.step(Event(Exec=Output(id=3, text="made"))) == [
        Action(
            id=4,
            op=ask(
                user(FIX),
                agent(calls=[Dispatch(id=2, call=search), Dispatch(id=3, call=build)]),
                tool(2, "found"),
                tool(3, "made"),
            ),
        )
    ]


@pytest.mark.parametrize(
    ("name", "input", "why"),
    [
        ("", b"{}", 'refused: "" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)'),
        ("a b", b"{}", 'refused: "a b" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)'),
        ("caf\u00e9", b"{}", 'refused: "caf\u00e9" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)'),
        ("x" * 129, b"{}", "refused: a tool name is at most 128 bytes, and this one is 129"),
        ("search", b"[1]", "refused: the input of search is not a JSON object"),
        ("search", b'"{}"', "refused: the input of search is not a JSON object"),
        ("search", b"null", "refused: the input of search is not a JSON object"),
    ],
)
def test_a_malformed_tool_call_is_refused_to_the_model(session: Instance, name: str, input: bytes, why: str) -> None:
    """Never dispatched: the model is told why under the call's id, and asked again at once when nothing else runs."""
    session.step(turn(1, FIX))
    bad = Call(Tool=ToolCall(name=name, input=msgspec.Raw(input)))
    assert session.step(answer(1, calls=[bad])) == [
        Action(id=3, op=ask(user(FIX), agent(calls=[Dispatch(id=2, call=bad)]), tool(2, why, failed=True)))
    ]


def test_a_tool_name_of_128_bytes_is_dispatched(session: Instance) -> None:
    session.step(turn(1, FIX))
    longest = Call(Tool=ToolCall(name="a.b:c/d-e_" + "x" * 118, input=msgspec.Raw(b"{}")))
    assert session.step(answer(1, calls=[longest])) == [Action(id=2, op=Op(Tool=longest.Tool))]


@pytest.mark.parametrize(
    "call",
    [
        b'{"Tool":{"name":"t"}}',
        b'{"Tool":{"input":{}}}',
        b'{"Tool":{"name":"t","input":{},"x":1}}',
        b'{"Tool":{"name":1,"input":{}}}',
        b'{"Tool":{"name":"t","input":{"a":}}}',
    ],
)
def test_a_tool_call_of_the_wrong_shape_is_malformed_and_changes_nothing(session: Instance, call: bytes) -> None:
    session.step(turn(1, FIX))
    with pytest.raises(MalformedError):
        session.step_raw(b'{"Model":{"id":1,"reply":{"calls":[' + call + b"]}}}")
    assert session.step(answer(1, "ok")) == finish(2, 1, "ok")


@pytest.mark.parametrize(
    ("path", "dispatched"),
    [
        ("a/../../x", False),
        ("/abs", False),
        ("..", False),
        ("a/b/../../../x", False),
        ("nul\x00byte", False),
        ("./a", True),
        ("a/..", True),
        ("a/./b/../c", True),
        ("src/lib.rs", True),
    ],
)
def test_a_path_is_dispatched_only_inside_the_workspace(session: Instance, path: str, dispatched: bool) -> None:
    session.step(turn(1, FIX))
    read = Call(Read=Read(path=path))
    refused = [
        Action(
            id=3,
            op=ask(
                user(FIX),
                agent(calls=[Dispatch(id=2, call=read)]),
                tool(2, f"refused: {path} is not inside the workspace", failed=True),
            ),
        )
    ]
    assert session.step(answer(1, calls=[read])) == ([Action(id=2, op=Op(Read=read.Read))] if dispatched else refused)


def test_exec_git_and_browse_calls_are_dispatched_in_order(session: Instance) -> None:
    session.step(turn(1, FIX))
    calls = [
        Call(Git=Git(argv=["status"])),
        Call(Browse=Browse(url="https://example.com/../x")),
        Call(Write=Write(path="notes/a.md", text="hi")),
    ]
    assert session.step(answer(1, calls=calls)) == [
        Action(id=2, op=Op(Git=calls[0].Git)),
        Action(id=3, op=Op(Browse=calls[1].Browse)),
        Action(id=4, op=Op(Write=calls[2].Write)),
    ]


def test_a_turn_that_arrives_mid_turn_is_queued_and_starts_after_done(session: Instance) -> None:
    session.step(turn(1, FIX))
    assert session.step(turn(2, "and the tests")) == [Action(id=2, op=Op(Save=True))]
    assert session.step(answer(1, "fixed")) == [
        *finish(3, 1, "fixed"),
        Action(id=6, op=ask(user(FIX), agent("fixed"), user("and the tests"))),
    ]


def test_queued_turns_start_first_in_first_out(session: Instance) -> None:
    session.step(turn(1, "one"))
    session.step(turn(3, "three"))
    session.step(turn(5, "five"))
    assert session.step(turn(4, "four")) == []
    first = session.step(answer(1, "1"))
    assert first[-1] == Action(id=7, op=ask(user("one"), agent("1"), user("three")))
    assert session.step(answer(7, "3"))[-1] == Action(
        id=11, op=ask(user("one"), agent("1"), user("three"), agent("3"), user("five"))
    )


def test_cancel_of_a_queued_turn_removes_it(session: Instance) -> None:
    session.step(turn(1, FIX))
    session.step(turn(2, "and the tests"))
    assert session.step(Event(Cancel=Cancel(turn=2))) == [
        Action(id=3, op=Op(Save=True)),
        Action(id=4, op=done(2, cancelled=True)),
    ]
    assert session.step(answer(1, "fixed")) == finish(5, 1, "fixed")


def test_cancel_of_the_running_turn_closes_its_calls_and_starts_the_next(session: Instance) -> None:
    session.step(turn(1, FIX))
    build, lib = Call(Exec=Exec(argv=["make"])), Call(Read=Read(path="src/lib.rs"))
    session.step(answer(1, calls=[build, lib]))
    session.step(turn(2, "and the tests"))  # Save, id 4
    assert session.step(Event(Exec=Output(id=2, text="made"))) == []
    assert session.step(Event(Cancel=Cancel(turn=1))) == [
        Action(id=5, op=Op(Save=True)),
        Action(id=6, op=done(1, cancelled=True)),
        Action(
            id=7,
            op=ask(
                user(FIX),
                agent(calls=[Dispatch(id=2, call=build), Dispatch(id=3, call=lib)]),
                tool(2, "made"),
                tool(3, "cancelled", failed=True),
                user("and the tests"),
            ),
        ),
    ]
    assert session.step(Event(File=Output(id=3, text="late"))) == []
    assert session.step(Event(Cancel=Cancel(turn=1))) == []


def test_cancel_while_the_model_is_asked_ends_the_turn_and_its_answer_changes_nothing(session: Instance) -> None:
    session.step(turn(1, FIX))
    assert session.step(Event(Cancel=Cancel(turn=1))) == [
        Action(id=2, op=Op(Save=True)),
        Action(id=3, op=done(1, cancelled=True)),
    ]
    assert session.step(answer(1, "too late")) == []
    assert session.step(turn(2, "next")) == [Action(id=4, op=ask(user(FIX), user("next")))]


def test_cancel_of_an_unknown_turn_and_a_timer_answer_nothing(session: Instance) -> None:
    assert session.step(Event(Cancel=Cancel(turn=9))) == []
    assert session.step(Event(Timer=True)) == []
    assert session.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]


def test_the_configured_model_is_named_in_every_ask(core: Core) -> None:
    s = core.new(Config(model="zen5"))
    try:
        assert s.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX), model="zen5"))]
    finally:
        s.close()


@pytest.mark.parametrize(
    "event",
    [
        b'{"Tick":true}',
        b'{"Timer":true,"Turn":{"id":1,"prompt":"x"}}',
        b'{"Turn":{"id":"one","prompt":"x"}}',
        b'{"Turn":{"id":-1,"prompt":"x"}}',
        b'{"Turn":{"id":1,"prompt":"x","extra":1}}',
        b'{"Turn":{"id":1}}',
        b'{"Turn":{"id":1,"prompt":"\xff"}}',
        b'{"Timer":false}',
        b"{}",
        b"[]",
        b'{"Timer":true} trailing',
        b"",
    ],
)
def test_an_event_the_core_cannot_read_is_malformed_and_changes_nothing(session: Instance, event: bytes) -> None:
    with pytest.raises(MalformedError):
        session.step_raw(event)
    assert session.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]


def test_a_snapshot_restores_into_a_new_core(core: Core) -> None:
    first = Core.open()
    s = first.new(Config(model="zen5"))
    test = Call(Exec=Exec(argv=["cargo", "test"]))
    s.step(turn(1, "run the tests"))
    assert s.step(answer(1, calls=[test])) == [Action(id=2, op=Op(Exec=test.Exec))]
    state = s.snapshot()
    s.close()
    first.close()

    restored = core.restore(state)
    try:
        assert restored.step(Event(Exec=Output(id=2, text="test result: ok"))) == [
            Action(
                id=3,
                op=ask(
                    user("run the tests"),
                    agent(calls=[Dispatch(id=2, call=test)]),
                    tool(2, "test result: ok"),
                    model="zen5",
                ),
            )
        ]
        assert restored.step(answer(3, "green")) == finish(4, 1, "green")
    finally:
        restored.close()


@pytest.mark.parametrize("how", ["restore", "resume"])
def test_a_damaged_snapshot_is_malformed(core: Core, session: Instance, how: str) -> None:
    """No truncation and no single flipped bit of a snapshot restores, nor resumes (which trusts only the messages
    of a snapshot whose frame and checksum hold)."""
    session.step(turn(1, FIX))
    state = session.snapshot()
    restore = getattr(core, how)
    restored_damaged = []
    for cut in range(len(state)):
        try:
            restore(state[:cut]).close()
            restored_damaged.append(f"first {cut} bytes")
        except MalformedError:
            pass
    for i in range(len(state)):
        for bit in range(8):
            flipped = bytearray(state)
            flipped[i] ^= 1 << bit
            try:
                restore(bytes(flipped)).close()
                restored_damaged.append(f"bit {bit} of byte {i}")
            except MalformedError:
                pass
    assert restored_damaged == []
    restored = restore(state)
    try:
        assert restored.step(answer(1, "done")) == finish(2, 1, "done")
    finally:
        restored.close()


def test_a_closed_session_answers_handle(core: Core) -> None:
    s = core.new()
    s.step(turn(1, FIX))
    s.close()
    assert s.memory_bytes() == 0
    with pytest.raises(HandleError):
        s.step(turn(2, FIX))
    with pytest.raises(HandleError):
        s.snapshot()
    s.close()


def test_a_closed_core_ends_its_sessions() -> None:
    c = Core.open()
    s = c.new()
    s.step(turn(1, FIX))
    state = s.snapshot()
    c.close()
    for _ in range(2):
        with pytest.raises(HandleError):
            s.step(turn(2, FIX))
        with pytest.raises(HandleError):
            s.snapshot()
    s.close()
    with pytest.raises(HandleError):
        c.new()
    with pytest.raises(HandleError):
        c.restore(state)


@pytest.mark.parametrize("timeout", [0.0, -3600.0])
def test_a_step_whose_deadline_has_passed_ends_the_session(core: Core, timeout: float) -> None:
    s = core.new()
    s.step(turn(1, FIX))
    state = s.snapshot()
    with pytest.raises(DeadlineError) as ended:
        s.step(answer(1, "done"), timeout=timeout)
    assert isinstance(ended.value, HandleError) and isinstance(ended.value, TimeoutError)
    with pytest.raises(HandleError):
        s.step(answer(1, "done"))
    with pytest.raises(HandleError):
        s.snapshot()
    with pytest.raises(DeadlineError):
        core.new(timeout=timeout)
    restored = core.restore(state)
    try:
        assert restored.step(answer(1, "done")) == finish(2, 1, "done")
    finally:
        restored.close()
        s.close()


def test_a_step_that_runs_past_its_deadline_is_stopped_there() -> None:
    c = Core.open(modules.SPIN_STEP)
    try:
        s = c.new()
        started = time.monotonic()
        with pytest.raises(DeadlineError):
            s.step(Event(Timer=True), timeout=0.05)
        stopped_after = time.monotonic() - started
        with pytest.raises(HandleError):
            s.step(Event(Timer=True))
        assert stopped_after < 1.0
    finally:
        c.close()


def test_the_epoch_stands_still_once_every_deadline_has_passed() -> None:
    c = Core.open(timeout=0.05, call_timeout=0.05)
    try:
        s = c.new()
        s.step(turn(1, FIX))
        time.sleep(0.5)  # well past the step's deadline: nothing can be running under one
        before = c._ticker._epoch
        time.sleep(0.3)
        assert c._ticker._epoch == before
    finally:
        c.close()


def test_a_deadline_armed_after_the_ticker_slept_fires_on_time() -> None:
    c = Core.open(modules.SPIN_STEP, timeout=0.05, call_timeout=0.05)
    try:
        s = c.new()
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(DeadlineError):
            s.step(Event(Timer=True), timeout=0.05)
        assert time.monotonic() - started < 1.0
    finally:
        c.close()


def test_every_call_after_interrupt_all_ends_at_once() -> None:
    c = Core.open(modules.SPIN_STEP, timeout=0.05, call_timeout=0.05)
    try:
        s = c.new()
        time.sleep(0.5)  # the ticker asleep when the interrupt comes
        c.interrupt_all(60.0)
        started = time.monotonic()
        with pytest.raises(DeadlineError):
            s.step(Event(Timer=True), timeout=30.0)
        assert time.monotonic() - started < 1.0
    finally:
        c.close()


def test_open_stops_a_module_that_never_answers() -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineError):
        Core.open(modules.SPIN_ABI, timeout=0.1)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (modules.ABI_3, "speaks ABI 3, and devd speaks ABI 2 \\(or 1\\)"),
        (modules.IMPORTS, "import nothing"),
        (modules.WRONG_TYPE, "dev_step has type"),
        (modules.MEMORY_NOT_MEMORY, "memory export is not a memory"),
    ],
)
def test_open_refuses_a_module_that_does_not_speak_abi_2(module: bytes, why: str) -> None:
    with pytest.raises(AbiError, match=why):
        Core.open(module)


def test_the_packaged_core_speaks_abi_2_and_a_module_of_abi_1_still_opens() -> None:
    """ABI 2 extends ABI 1 (the Tool call): a module built for ABI 1 runs, and says which it speaks."""
    opened = [Core.open(), Core.open(modules.ABI_1)]
    try:
        assert [c.abi for c in opened] == [2, 1]
    finally:
        for c in opened:
            c.close()


def test_a_session_answers_one_call_at_a_time(session: Instance) -> None:
    session._busy.acquire()
    with pytest.raises(BusyError):
        session.step(turn(1, FIX))
    with pytest.raises(BusyError):
        session.snapshot()
    with pytest.raises(BusyError):
        session.close()
    session._busy.release()
    assert session.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]


def test_a_gone_session_stepped_and_closed_at_once() -> None:
    c = Core.open()
    sessions = [c.new() for _ in range(16)]
    c.close()
    wrong: list[BaseException] = []
    for s in sessions:
        with pytest.raises(HandleError):
            s.step(turn(1, FIX))
        stepped = threading.Event()

        def hammer(s: Instance = s, stepped: threading.Event = stepped) -> None:
            for i in range(200):
                try:
                    s.step(turn(1, FIX))
                except (HandleError, BusyError):
                    pass
                except BaseException as e:
                    wrong.append(e)
                if i == 0:
                    stepped.set()

        t = threading.Thread(target=hammer)
        t.start()
        stepped.wait()
        while True:
            try:
                s.close()
                break
            except BusyError:
                continue
        t.join()
    assert wrong == []


def converse(core: Core, i: int) -> None:
    """Three turns on a session of its own, each reading a file named for it, checked against what it alone sees."""
    model = f"model-{i}"
    s = core.new(Config(model=model))
    try:
        transcript: list[Message] = []
        next_id = 1
        for n in range(3):
            prompt = f"session {i}, turn {n}"
            read = Call(Read=Read(path=f"session-{i}/turn-{n}.go"))
            transcript.append(user(prompt))
            assert s.step(turn(n + 1, prompt)) == [Action(id=next_id, op=ask(*transcript, model=model))]
            transcript.append(agent(calls=[Dispatch(id=next_id + 1, call=read)]))
            assert s.step(answer(next_id, calls=[read])) == [Action(id=next_id + 1, op=Op(Read=read.Read))]
            transcript.append(tool(next_id + 1, read.Read.path))  # type: ignore[union-attr]
            assert s.step(Event(File=Output(id=next_id + 1, text=read.Read.path))) == [  # type: ignore[union-attr]
                Action(id=next_id + 2, op=ask(*transcript, model=model))
            ]
            transcript.append(agent(prompt))
            assert s.step(answer(next_id + 2, prompt)) == finish(next_id + 3, n + 1, prompt)
            next_id += 6
    finally:
        s.close()


def test_sessions_stepped_at_once_stay_apart(core: Core) -> None:
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            converse(core, i)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_ten_thousand_steps_do_not_grow_memory(session: Instance) -> None:
    session.step(turn(1, "fix the build " * 64))
    next_turn = 1

    def pair() -> None:
        nonlocal next_turn
        next_turn += 1
        k = next_turn
        assert session.step(turn(k, "and the tests")) == [Action(id=3 * k - 4, op=Op(Save=True))]
        assert session.step(Event(Cancel=Cancel(turn=k))) == [
            Action(id=3 * k - 3, op=Op(Save=True)),
            Action(id=3 * k - 2, op=done(k, cancelled=True)),
        ]
        session.snapshot()

    for _ in range(100):
        pair()
    before = session.memory_bytes()
    for _ in range(5000):
        pair()
    assert session.memory_bytes() == before


# -- the bounded conversation (ABI 2) -------------------------------------------------------------------------------


def summary(upto: int, text: str) -> Event:
    return Event(Summary=Summarize(upto=upto, text=text))


def test_a_summary_replaces_the_start_and_a_turn_waiting_on_its_ask_is_asked_again(session: Instance) -> None:
    session.step(turn(1, "p"))
    session.step(answer(1, "a"))
    session.step(turn(2, "q"))
    summarised = Message(Summary=Summary(text="p, then a", replaced=2))
    assert session.step(summary(2, "p, then a")) == [Action(id=6, op=ask(summarised, user("q")))]
    assert (session.step(answer(5, "late")), session.ignored()) == ([], 5)
    assert session.step(answer(6, "b")) == finish(7, 2, "b")
    assert session.transcript(0) == (
        b'[{"Summary":{"text":"p, then a","replaced":2}},{"User":"q"},{"Agent":{"text":"b"}}]'
    )


@pytest.mark.parametrize("upto", [0, 2, 3, 5])
def test_a_summary_that_would_part_a_call_from_its_result_is_malformed_and_changes_nothing(
    session: Instance, upto: int
) -> None:
    """0 User, 1 Agent dispatching two calls, 2 and 3 their results: a cut at 2 or 3 would keep a result without its
    call; 0 replaces nothing; 5 is past the end."""
    session.step(turn(1, FIX))
    session.step(answer(1, calls=[Call(Read=Read(path="a")), Call(Read=Read(path="b"))]))
    session.step(Event(File=Output(id=2, text="A")))
    session.step(Event(File=Output(id=3, text="B")))
    before = session.snapshot()
    with pytest.raises(MalformedError, match="the session refuses this Summary as it stands"):
        session.step(summary(upto, "x"))
    assert session.snapshot() == before


def test_the_call_waited_for_keeps_the_message_that_dispatched_it(session: Instance) -> None:
    session.step(turn(1, FIX))
    read = Call(Read=Read(path="a"))
    session.step(answer(1, calls=[read]))
    with pytest.raises(MalformedError):
        session.step(summary(2, "x"))
    assert session.step(summary(1, "asked")) == []
    assert session.pending() == b'[{"id":2,"op":{"Read":{"path":"a"}}}]'
    assert session.step(Event(File=Output(id=2, text="A"))) == [
        Action(
            id=3,
            op=ask(
                Message(Summary=Summary(text="asked", replaced=1)),
                agent(calls=[Dispatch(id=2, call=read)]),
                tool(2, "A"),
            ),
        )
    ]


def test_with_a_summary_every_ten_turns_asks_and_memory_stay_flat_over_2000_turns(session: Instance) -> None:
    """Each turn reads a 2 KB file; every tenth a Summary replaces the whole conversation so far."""
    largest: dict[str, int] = {}
    memory: dict[str, int] = {}
    next_id = 1
    for n in range(1, 2001):
        read = Call(Read=Read(path=f"f{n}"))
        asks = [
            session.step_raw(encode(turn(n, f"turn {n}: read the file"))),
            session.step_raw(encode(answer(next_id, calls=[read]))),
            session.step_raw(encode(Event(File=Output(id=next_id + 1, text="x" * 2048)))),
            session.step_raw(encode(answer(next_id + 2, f"read f{n}"))),
        ]
        next_id += 6
        if n % 10 == 0:
            assert session.step(summary(len(session_messages(session)), f"turns up to {n}")) == []
        era = "early" if 100 <= n < 200 else "late" if 1900 <= n < 2000 else None
        if era is not None:
            largest[era] = max(largest.get(era, 0), *map(len, asks))
            memory[era] = session.memory_bytes()
    # Ids and turn numbers grow by a digit or two: a few bytes, never another turn's messages.
    assert (largest["late"] - largest["early"] < 64, memory["late"]) == (True, memory["early"])


def session_messages(session: Instance) -> list[Message]:
    return msgspec.json.decode(session.transcript(0), type=list[Message])


def test_refused_calls_do_not_grow_memory(session: Instance) -> None:
    prompt = "fix the build " * 1024
    session.step(turn(1, prompt))
    unreadable = b'{"Turn":{"id":2,"prompt":"' + prompt.encode() + b'"}'
    for _ in range(10):
        with pytest.raises(MalformedError):
            session.step_raw(unreadable)
    before = session.memory_bytes()
    for _ in range(1000):
        with pytest.raises(MalformedError):
            session.step_raw(unreadable)
    assert session.memory_bytes() == before


def test_an_answer_step_cannot_read_ends_the_session() -> None:
    c = Core.open(modules.AHEAD)
    try:
        s = c.new()
        with pytest.raises(HandleError) as lost:
            s.step(turn(1, FIX))
        assert not isinstance(lost.value, MalformedError)
        for _ in range(2):
            with pytest.raises(HandleError):
                s.step(Event(Timer=True))
    finally:
        c.close()


def test_an_answer_the_host_does_not_take_ends_the_session(core: Core, session: Instance) -> None:
    state = session.snapshot()
    refused = RuntimeError("the host refuses the answer")

    def refuse(_: bytes) -> None:
        raise refused

    with pytest.raises(HandleError) as lost:
        session._step(encode(turn(1, FIX)), refuse, None)
    assert lost.value.__cause__ is refused
    with pytest.raises(HandleError):
        session.step(turn(1, FIX))
    restored = core.restore(state)
    try:
        assert restored.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]
    finally:
        restored.close()


def test_a_trap_poisons_only_its_session(core: Core) -> None:
    s, beside = core.new(), core.new()
    try:
        beside.step(turn(1, FIX))
        with pytest.raises(PanicError):
            s.step(turn(1, "x" * (24 << 20)))
        with pytest.raises(PoisonError):
            s.step(turn(2, FIX))
        with pytest.raises(PoisonError):
            s.snapshot()
        s.close()
        assert beside.step(answer(1, "fixed")) == finish(2, 1, "fixed")
    finally:
        beside.close()


def test_a_panic_in_the_core_is_panic_then_poison() -> None:
    c = Core.open(modules.PANIC_STEP)
    try:
        s = c.new()
        with pytest.raises(PanicError):
            s.step(Event(Timer=True))
        with pytest.raises(PoisonError):
            s.step(Event(Timer=True))
    finally:
        c.close()


def test_a_length_the_core_cannot_take_is_null(session: Instance) -> None:
    for n in (2**31, 2**32 + 16):
        with pytest.raises(NullError):
            session._alloc(n)
    assert session.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]


def test_an_event_too_large_to_lend_is_null(session: Instance) -> None:
    with pytest.raises(NullError):
        session.step(turn(1, "x" * (65 << 20)))
    assert session.step(turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]


def test_the_memory_cap_is_configurable() -> None:
    c = Core.open(memory_bytes=8 << 20)
    try:
        s = c.new()
        with pytest.raises(NullError):
            s.step(turn(1, "x" * (9 << 20)))
        with pytest.raises(PanicError):
            s.step(turn(1, "x" * (3 << 20)))
    finally:
        c.close()


def test_a_4_mib_prompt_leaves_its_instance_at_most_three_times_as_large(core: Core) -> None:
    # The input the host keeps lent, the message the session keeps, and its ask (freed, but linear memory keeps its
    # high-water mark), each in the pages it needs: std's allocator rounded each up to a power of two (25 MiB before).
    s = core.new()
    s.step(turn(1, "x" * (4 << 20)))
    assert s.memory_bytes() <= (3 * 4 + 1) << 20


def test_reading_a_2_mib_tool_output_full_of_escapes_grows_its_instance_at_most_10_mib(core: Core) -> None:
    # The 3 MiB event lent, its text unescaped into room taken once, and the copy the session keeps: std's reader
    # grew the text piece by piece, every old copy kept in the call's arena (18 MiB before).
    s = core.new()
    s.step(turn(1, FIX))
    s.step(answer(1, calls=[BUILD, LIB]))
    before = s.memory_bytes()
    s.step(Event(Exec=Output(id=2, text="z\n" * (1 << 20))))
    assert s.memory_bytes() - before <= 10 << 20


def test_a_turn_whose_ask_grows_by_a_20_kb_result_at_every_call_runs_250_calls_in_32_mib() -> None:
    # bench long --big-turn's turn, smaller: each ask is freed and the next is a little larger. Slots whose pages were
    # grown at the end of memory walled in each freed ask, so every ask took new pages (out of memory by call 90).
    c = Core.open(memory_bytes=32 << 20)
    s = c.new()
    s.step(turn(1, FIX))
    for k in range(250):
        s.step(answer(1 + 2 * k, calls=[Call(Exec=Exec(argv=["cat", str(k)]))]))
        s.step(Event(Exec=Output(id=2 + 2 * k, text="r" * 20480)))
    assert s.memory_bytes() <= 24 << 20
    c.close()


# Texts from nothing to a few 64 KiB pages, plain or full of escapes: each size class of the core's allocator, and
# its runs of pages taken, grown, shrunk, freed and merged in every order.
TEXTS = st.builds(lambda n, escaped: ("z\n" if escaped else "y") * n, st.integers(0, 200_000), st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(TEXTS, st.lists(TEXTS, min_size=1, max_size=4)), min_size=1, max_size=4))
def test_a_session_fed_texts_of_every_size_asks_with_every_byte_and_resumes_the_same(
    core: Core, turns: list[tuple[str, list[str]]]
) -> None:
    s, transcript, next_id = core.new(), [], 1
    for n, (prompt, outputs) in enumerate(turns, start=1):
        transcript.append(user(prompt))
        s.step(turn(n, prompt))
        calls = [Call(Exec=Exec(argv=["cat", str(k)])) for k in range(len(outputs))]
        s.step(answer(next_id, calls=calls))
        transcript.append(agent(calls=[Dispatch(id=next_id + 1 + k, call=c) for k, c in enumerate(calls)]))
        for k, text in enumerate(outputs):
            actions = s.step(Event(Exec=Output(id=next_id + 1 + k, text=text)))
            transcript.append(tool(next_id + 1 + k, text))
        assert actions == [Action(id=next_id + 1 + len(outputs), op=ask(*transcript))]
        next_id += 2 + len(outputs)
        s.step(answer(next_id - 1, "done"))
        transcript.append(agent("done"))
        next_id += 3  # its Emit, Save and Done
    snapshot = s.snapshot()
    s.close()
    resumed = core.resume(snapshot)
    assert resumed.snapshot() == snapshot
    resumed.close()


def test_a_session_resumed_from_a_4_mib_snapshot_holds_at_most_twice_as_much(core: Core) -> None:
    # The snapshot lent in and the session decoded from it (17 MiB before).
    source = core.new()
    source.step(turn(1, "x" * (4 << 20)))
    assert core.resume(source.snapshot()).memory_bytes() <= (2 * 4 + 1) << 20


BUILD, LIB = Call(Exec=Exec(argv=["cargo", "build"])), Call(Read=Read(path="src/lib.rs"))
LIB_PENDING = b'[{"id":3,"op":{"Read":{"path":"src/lib.rs"}}}]'


def test_nothing_is_pending_on_a_fresh_session(session: Instance) -> None:
    assert session.pending() == b"[]"


def test_pending_while_the_model_is_asked_is_the_ask_in_the_bytes_it_was_dispatched(session: Instance) -> None:
    asked = session.step_raw(encode(turn(1, FIX)))
    assert session.pending() == asked


def test_pending_while_calls_run_is_every_call_in_the_bytes_it_was_dispatched(session: Instance) -> None:
    session.step(turn(1, FIX))
    dispatched = session.step_raw(encode(answer(1, "Let me look.", [BUILD, LIB])))
    assert session.pending() == dispatched


def test_pending_after_one_result_is_the_other_call(session: Instance) -> None:
    session.step(turn(1, FIX))
    session.step(answer(1, "Let me look.", [BUILD, LIB]))
    session.step(Event(Exec=Output(id=2, text="error", failed=True)))
    assert session.pending() == LIB_PENDING


def test_pending_after_every_result_is_the_new_ask(session: Instance) -> None:
    session.step(turn(1, FIX))
    session.step(answer(1, "Let me look.", [BUILD, LIB]))
    session.step(Event(Exec=Output(id=2, text="error", failed=True)))
    asked = session.step_raw(encode(Event(File=Output(id=3, text="pub fn f() -> u8 { x }"))))
    assert session.pending() == asked


def test_a_refused_call_is_never_pending(session: Instance) -> None:
    session.step(turn(1, "read the password file"))
    session.step(answer(1, calls=[Call(Read=Read(path="../../etc/passwd")), LIB]))
    assert session.pending() == LIB_PENDING


def test_nothing_is_pending_after_the_running_turn_is_cancelled(session: Instance) -> None:
    session.step(turn(1, FIX))
    session.step(answer(1, calls=[BUILD, LIB]))
    session.step(Event(Cancel=Cancel(turn=1)))
    assert session.pending() == b"[]"


@pytest.mark.parametrize(
    "events",
    [
        [],
        [turn(1, FIX), turn(2, "and the tests")],
        [turn(1, FIX), answer(1, "Let me look.", [BUILD, Call(Read=Read(path="/etc/hosts")), LIB])],
        [turn(1, FIX), answer(1, calls=[BUILD, LIB]), Event(File=Output(id=3, text="fn main() {}"))],
    ],
    ids=["idle", "asking", "calls", "one-result"],
)
def test_pending_is_the_same_after_a_snapshot_restores(core: Core, session: Instance, events: list[Event]) -> None:
    for event in events:
        session.step(event)
    restored = core.restore(session.snapshot())
    try:
        assert restored.pending() == session.pending()
    finally:
        restored.close()


# Written by the core before dev_pending existed: turn 1 waits for Read src/lib.rs (id 4), its Exec (id 2) answered
# and its Read ../x (id 3) refused.
SNAPSHOT_BEFORE_PENDING = bytes.fromhex(
    "4445564401000000430100000004000000000000000100000000000000010100000000000000010300000002000000000000000000010500"
    "00006572726f72030000000000000001000129000000726566757365643a202e2e2f78206973206e6f7420696e736964652074686520776f"
    "726b73706163650400000000000000010100000000000000000002000000180000007b2255736572223a2266697820746865206275696c64"
    "227da10000007b224167656e74223a7b2263616c6c73223a5b7b226964223a322c2263616c6c223a7b2245786563223a7b2261726776223a"
    "5b22636172676f222c226275696c64225d7d7d7d2c7b226964223a332c2263616c6c223a7b2252656164223a7b2270617468223a222e2e2f"
    "78227d7d7d2c7b226964223a342c2263616c6c223a7b2252656164223a7b2270617468223a227372632f6c69622e7273227d7d7d5d7d7db1"
    "c6cf27"
)


def test_a_snapshot_from_before_dev_pending_reports_its_pending_call(core: Core) -> None:
    restored = core.restore(SNAPSHOT_BEFORE_PENDING)
    try:
        assert restored.pending() == b'[{"id":4,"op":{"Read":{"path":"src/lib.rs"}}}]'
    finally:
        restored.close()


def test_pending_on_a_closed_session_answers_handle(core: Core) -> None:
    s = core.new()
    s.close()
    with pytest.raises(HandleError):
        s.pending()


def test_a_core_without_dev_pending_says_it_does_not_report_pending_actions() -> None:
    c = Core.open(modules.core_with("i32.const 0"))
    try:
        with pytest.raises(MethodNotFoundError, match=r"does not report pending actions \(no dev_pending export\)"):
            c.new().pending()
    finally:
        c.close()


def _with_counter(snapshot: bytes, counter: int) -> bytes:
    """The snapshot of a session without a model, its id counter set to `counter`, checksummed again."""
    body = snapshot[:13] + counter.to_bytes(8, "little") + snapshot[21:-4]
    return body + zlib.crc32(body).to_bytes(4, "little")


def test_a_snapshot_whose_id_counter_no_session_can_reach_is_malformed(core: Core, session: Instance) -> None:
    session.step(turn(1, "x"))
    snapshot = session.snapshot()
    restored = core.restore(_with_counter(snapshot, 1 << 53))
    restored.close()
    with pytest.raises(MalformedError):
        core.restore(_with_counter(snapshot, (1 << 53) + 1))


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (b'{"Turn":{"id":"1","prompt":"x"}}', "Expected `int`, got `str` - at `$.Turn.id`"),
        (b'{"turn":{"id":1,"prompt":"x"}}', "Object contains unknown field `turn`"),
        (b'{"Turn":{"prompt":"x"}}', "Object missing required field `id` - at `$.Turn`"),
        (b'{"Exec":{"id":1,"text":"x","failed":null}}', "Expected `bool`, got `null` - at `$.Exec.failed`"),
    ],
)
def test_a_malformed_event_is_answered_with_the_member_at_fault_and_why(
    session: Instance, event: bytes, why: str
) -> None:
    with pytest.raises(MalformedError) as refused:
        session.step_raw(event)
    assert str(refused.value) == (
        f"the event is not a message of protocol 1: {why}; nothing changed, fix it and send it again"
    )


# -- applying: a replay's step, with no answer written --------------------------------------------------------------

SEED_EVENTS = [
    turn(1, FIX),
    answer(1, "Let me look.", [BUILD, LIB]),
    Event(Exec=Output(id=2, text="error", failed=True)),
    Event(File=Output(id=3, text="pub fn f() -> u8 { x }")),
    answer(4, "fixed"),
]


def test_the_packaged_core_applies_events_without_answering() -> None:
    core = Core.open()
    try:
        assert core.has_apply is True
    finally:
        core.close()


def test_applying_events_leaves_the_state_stepping_them_leaves(core: Core) -> None:
    stepped, applied = core.new(), core.new()
    try:
        for event in SEED_EVENTS:
            stepped.step(event)
            applied.apply(encode(event))
        assert applied.snapshot() == stepped.snapshot()
    finally:
        stepped.close()
        applied.close()


def test_applying_a_malformed_event_is_refused_and_changes_nothing(session: Instance) -> None:
    session.step(turn(1, FIX))
    before = session.snapshot()
    with pytest.raises(MalformedError):
        session.apply(b'{"Turn":{"id":"2","prompt":"p"}}')
    assert session.snapshot() == before


def test_the_packaged_core_resumes_its_own_snapshots_to_the_state_restoring_gives(core: Core) -> None:
    source = core.new()
    try:
        for event in SEED_EVENTS[:3]:
            source.step(event)
        state = source.snapshot()
    finally:
        source.close()
    restored, resumed = core.restore(state), core.resume(state)
    try:
        assert (core.has_resume, resumed.snapshot(), resumed.step(SEED_EVENTS[3])) == (
            True,
            restored.snapshot(),
            restored.step(SEED_EVENTS[3]),
        )
    finally:
        restored.close()
        resumed.close()


def test_a_result_for_an_action_never_dispatched_is_ignored_and_says_which(session: Instance) -> None:
    session.step(turn(1, FIX))
    session.step(answer(1, "Let me look.", [BUILD, LIB]))
    answered = session.step_raw(encode(Event(Exec=Output(id=9, text="stray"))))
    assert (answered, session.ignored()) == (b"[]", 9)


def test_a_result_already_answered_is_ignored_and_one_awaited_is_not(session: Instance) -> None:
    session.step(turn(1, FIX))
    session.step(answer(1, "Let me look.", [BUILD, LIB]))
    session.step(Event(Exec=Output(id=2, text="error", failed=True)))
    first = session.ignored()
    session.step(Event(Exec=Output(id=2, text="error again", failed=True)))
    assert (first, session.ignored()) == (None, 2)


def test_a_session_memory_cap_past_what_the_core_can_grow_to_is_refused_at_start() -> None:
    with pytest.raises(AbiError, match="memory cap of 2048 MiB is more than this core can grow to \\(1024 MiB\\)"):
        Core.open(memory_bytes=2 << 30)


def test_a_clients_12_mb_snapshot_restores_within_the_default_memory_cap(core: Core) -> None:
    # Each message is checked in scratch that is let go before the next, so a restore holds the transcript about
    # twice (its input and the session), not four times (before: out of memory past about 9 MB).
    roomy = Core.open(memory_bytes=256 << 20)
    source = roomy.new()
    source.step(turn(1, "go"))
    source.step(answer(1, calls=[Call(Exec=Exec(argv=["cat", str(k)])) for k in range(12)]))
    for k in range(12):
        source.step(Event(Exec=Output(id=2 + k, text="z" * (1 << 20))))
    snapshot = source.snapshot()
    roomy.close()
    assert core.restore(snapshot).snapshot() == snapshot


def test_a_ticker_starved_past_a_deadline_still_brings_the_epoch_to_it() -> None:
    """The epoch ticker, kept from the GIL until the deadline has passed (a loaded daemon), catches the epoch up to it
    before it sleeps: it slept with the clock past the deadline and the epoch short of it, and a spinning call ran for
    ever (test_open_stops_a_module_that_never_answers hung a CI run)."""
    c = Core.open(timeout=0.05, call_timeout=0.05)
    interval = sys.getswitchinterval()
    try:
        time.sleep(0.2)  # the open's deadline has passed: the ticker sleeps
        sys.setswitchinterval(5.0)  # the spin below keeps the GIL from the ticker's thread
        ticks = c._ticker.ticks_until(time.monotonic() + 0.02)
        armed = c._ticker._epoch
        spin_until = time.monotonic() + 0.2
        while time.monotonic() < spin_until:
            pass
        sys.setswitchinterval(interval)
        time.sleep(0.1)
        assert c._ticker._epoch - armed > ticks
    finally:
        sys.setswitchinterval(interval)
        c.close()
