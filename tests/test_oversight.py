"""Oversight over a real SQLite store: approvals, spend and trace are durable, and a store opened again (a restart)
gives the same answers. The only stand-in is the keeper's `tell`, which keeps the notices the watchers would get."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devd.agent import oversight as oversight_module
from devd.agent.oversight import Oversight
from devd.agent.port import StoreRecordLog
from devd.agent.profiles import Budget, Profile
from devd.agent.spend import Usage
from devd.errors import ConflictError
from devd.messages import Exec, Op
from devd.protocol import ApprovalNotice, DecidedNotice, TraceRecord, UsageResult
from devd.storage.sqlite import SQLiteStore

MAKE = Op(Exec=Exec(argv=["make"]))
STARTED = "2026-12-01T09:00:00.000Z"


def profile(**changes: Any) -> Profile:
    base = Profile(name="coder", base_url="http://127.0.0.1:9/v1", model="m", workspace_roots=("/tmp",), exec="ask")
    return msgspec.structs.replace(base, **changes)


class Keeper(StoreRecordLog):
    """The record log of a real store, and the notices told, kept in order."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.told: list[tuple[str, msgspec.Struct]] = []

    def seq(self, session: str) -> int | None:
        return 0

    def tell(self, session: str, method: str, params: msgspec.Struct) -> None:
        self.told.append((method, params))


@asynccontextmanager
async def opened(path: Path, sessions: tuple[str, ...] = ()) -> AsyncIterator[Keeper]:
    store = SQLiteStore(path, keys_kept=1000, steps_kept=1000, prune_every_steps=256)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.run)
            for name in sessions:
                await store.create(name, b"{}")
            yield Keeper(store)
            tg.cancel_scope.cancel()
    finally:
        store.close()


async def first_notice(keeper: Keeper) -> ApprovalNotice:
    while not keeper.told:
        await anyio.sleep(0)
    method, notice = keeper.told[0]
    assert isinstance(notice, ApprovalNotice)
    return notice


async def test_a_call_waits_for_the_first_answer_and_every_watcher_is_told_who_gave_it(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        gates = []
        async with anyio.create_task_group() as tg:

            async def gate() -> None:
                gates.append(await oversight.gate("s", 2, MAKE, profile()))

            tg.start_soon(gate)
            notice = await first_notice(keeper)
            await oversight.answer("s", 2, notice.digest, "allow", "ui-1")
        assert (gates[0].allowed, keeper.told[1]) == (True, ("session/decided", DecidedNotice("s", 2, "allow", "ui-1")))


async def test_a_second_answer_is_a_conflict_naming_the_first(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        async with anyio.create_task_group() as tg:
            tg.start_soon(oversight.gate, "s", 2, MAKE, profile())
            notice = await first_notice(keeper)
            await oversight.answer("s", 2, notice.digest, "deny", "ui-1")
        with pytest.raises(ConflictError, match="already decided: deny by ui-1"):
            await oversight.answer("s", 2, notice.digest, "allow", "ui-2")


async def test_a_pending_approval_is_pending_after_a_restart_with_the_same_digest(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        with anyio.move_on_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(oversight.gate, "s", 2, MAKE, profile())
                notice = await first_notice(keeper)
                tg.cancel_scope.cancel()  # the daemon stops while it waits
    async with opened(tmp_path / "db") as keeper:
        assert [a.digest for a in await Oversight(keeper).awaiting("s")] == [notice.digest]


async def test_a_decision_made_before_a_restart_is_not_asked_again(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        async with anyio.create_task_group() as tg:
            tg.start_soon(oversight.gate, "s", 2, MAKE, profile())
            await oversight.answer("s", 2, (await first_notice(keeper)).digest, "allow", "ui-1")
    async with opened(tmp_path / "db") as keeper:
        assert (await Oversight(keeper).gate("s", 2, MAKE, profile())).reason == "allowed by ui-1"


async def test_an_answer_that_comes_while_the_driver_comes_to_ask_again_is_the_decision(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        with anyio.move_on_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(Oversight(keeper).gate, "s", 2, MAKE, profile())
                notice = await first_notice(keeper)
                tg.cancel_scope.cancel()  # the daemon stops while it waits
    async with opened(tmp_path / "db") as keeper:
        oversight = Oversight(keeper)  # after the restart: the approval is pending, its driver not yet waiting
        await oversight.awaiting("s")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(oversight.answer, "s", 2, notice.digest, "allow", "ui-1")
                await anyio.lowlevel.checkpoint()  # the answer holds the session's lock while it is made durable
                gate = await oversight.gate("s", 2, MAKE, profile())
    assert gate.reason == "allowed by ui-1"


async def test_withdraw_decides_a_pending_approval_cancelled(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        gates = []
        async with anyio.create_task_group() as tg:

            async def gate() -> None:
                gates.append(await oversight.gate("s", 2, MAKE, profile()))

            tg.start_soon(gate)
            await first_notice(keeper)
            await oversight.withdraw("s", [2], "ui-1")
        assert (gates[0].allowed, keeper.told[1][1]) == (False, DecidedNotice("s", 2, "cancelled", "ui-1"))


async def test_usage_and_refusals_are_counted_again_after_a_restart(tmp_path: Path) -> None:
    coder = profile(budget=Budget(tokens_per_session=10_000), max_tokens=100)
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        reservation, _, _ = await oversight.admit("s", coder, 1, 2, b"x" * 400)
        await oversight.settle("s", coder, 1, 2, reservation, Usage(input_tokens=90, output_tokens=20, cached_tokens=4))
        await oversight.set_budget("s", 50)
        await oversight.admit("s", coder, 1, 3, b"x" * 400)
    async with opened(tmp_path / "db") as keeper:
        oversight = Oversight(keeper)
        assert msgspec.to_builtins(await oversight.usage("s")) == {
            "input_tokens": 90,
            "output_tokens": 20,
            "cached_tokens": 4,
            "calls": 1,
            "refused": 1,
        }


async def test_a_refused_call_leaves_a_refused_trace_record_saying_why(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        await oversight.set_budget("s", 10)
        await oversight.admit("s", profile(), 1, 2, b"x" * 400)
        [record], _ = await oversight.traces("s")
        assert (record.outcome, record.error) == (
            "refused",
            "spend ceiling reached: the session's budget is 10 tokens, 0 spent, and the next model call needs up to "
            "101 (~100 for its request, by devd's estimate of 4 characters a token, and 1 for its reply); the call "
            "was not sent: raise it with session/budget, then session/resume",
        )


async def test_a_call_without_max_tokens_is_sent_with_the_headroom_left(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        await oversight.set_budget("s", 1000)
        _, max_tokens, _ = await oversight.admit("s", profile(), 1, 2, b"x" * 400)
        assert max_tokens == 900


def _traced(action: int) -> TraceRecord:
    return TraceRecord(action=action, kind="model", started=STARTED, duration_ms=1.0, outcome="ok")


async def test_trace_records_come_a_page_at_a_time_with_the_since_of_the_next(tmp_path: Path) -> None:
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        await oversight.set_budget("s", 100)  # record 1, not a trace record
        for action in (2, 2, 3, 4):
            await oversight.trace("s", _traced(action))  # records 2 to 5
        pages = [await oversight.traces("s", since, 2) for since in (0, 3, 5)]
    assert [([(r.n, r.action) for r in page], following) for page, following in pages] == [
        ([(2, 2), (3, 2)], 3),
        ([(4, 3), (5, 4)], None),
        ([], None),
    ]


async def test_old_trace_and_usage_records_go_and_the_usage_they_told_of_stays_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(oversight_module, "TRACE_TRIM_EVERY", 4)
    monkeypatch.setattr(oversight_module, "TRACE_RECORDS_KEPT", 2)
    async with opened(tmp_path / "db", ("s",)) as keeper:
        oversight = Oversight(keeper)
        for action in (1, 2, 3, 4):  # a model call's usage, then its trace record
            await oversight.settle("s", profile(), 1, action, None, Usage(10, action))
            await oversight.trace("s", _traced(action))
        kept, _ = await oversight.traces("s")
        kept_usage = await keeper.records("s", ("usage",))
        restarted = await Oversight(keeper).usage("s")
    assert ([r.action for r in kept], [r.action for r in kept_usage], restarted) == (
        [3, 4],
        [3, 4],
        UsageResult(40, 10, 0, 4, 0),
    )


# -- OpenTelemetry, to a stand-in OTLP/HTTP receiver on loopback ---------------------------------------------------


class Receiver(BaseHTTPRequestHandler):
    """Decodes each OTLP/HTTP protobuf export it is sent, as a collector does."""

    got: list[ExportTraceServiceRequest] = []
    arrived = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).got.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
        type(self).arrived.set()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_model_call_record_is_exported_as_a_genai_chat_span() -> None:
    from devd.agent.otel import Exporter

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        exporter = Exporter(f"http://127.0.0.1:{server.server_address[1]}")
        record = TraceRecord(
            action=4, kind="model", started=STARTED, duration_ms=12.0, outcome="ok", model="m", input_tokens=7,
            output_tokens=3, attempt=1,
        )  # fmt: skip
        exporter.export("s", record)
        exporter.shutdown()
        assert Receiver.arrived.wait(10)
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    span = Receiver.got[0].resource_spans[0].scope_spans[0].spans[0]
    attributes = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
    assert (span.name, span.kind, attributes) == (
        "chat m",
        3,  # SPAN_KIND_CLIENT
        {
            "gen_ai.conversation.id": "s",
            "devd.action.id": 4,
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "m",
            "gen_ai.usage.input_tokens": 7,
            "gen_ai.usage.output_tokens": 3,
            "devd.attempt": 1,
        },
    )
