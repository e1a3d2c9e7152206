"""One MCP server connection, owned by one supervisor task: the SDK's client session is entered and left in that task
(its task groups demand it), and callers reach it through a bounded memory stream of requests.

What it promises:
- The server is started at first need (a listing or a call) and stopped after `idle_s` with no request; a process that
  exits (or is ended for what it sent) is started again at its next use, but after a failed start only once a backoff
  has passed (`BACKOFF_FIRST_S`, doubling, at most `BACKOFF_MAX_S`), and after a second end within `STABLE_S` of its
  start in a row only once `CRASH_BACKOFF_FIRST_S` (doubling) has: a request before then fails at once, saying why, so
  a server that crashes at every start never spins.
- A stdio server (`stdio.Process`) speaks the handshake era (`initialize`); a Streamable HTTP one (`http.Endpoint`) is
  first asked `server/discover` (the 2026-07-28 revision) and, when it refuses, spoken to in the handshake era on the
  same connection; the era found is kept for its later lives (`mode`). A server's `protocol` says otherwise: "auto"
  asks a stdio server `server/discover` first too (what lets its questions outlive a daemon restart), "legacy" keeps
  an HTTP one to the handshake.
- A server not through its handshake and first listing within `start_timeout_s` fails the request that needed it;
  its listing is cached, cut at `tools_max` (the rest refused with a log line), and listed again after
  `notifications/tools/list_changed` (in the 2026-07-28 revision, a `ToolsListChanged` on the `subscriptions/listen`
  stream held open for the life); a listing under way is waited for by the next `tools`.
- A call not answered within its timeout is cancelled (the SDK sends MCP's `notifications/cancelled`) and fails
  saying so; a caller cancelled (its turn was) cancels the call the same way; a call in flight when the server exits
  fails saying how it ended, with the tail of its stderr. Every failure is an `Unavailable` with a sentence.
- A server's question (an elicitation) is put to the call's `ask` hook, which answers it (`devd.agent.mcp.broker`
  asks the session's clients): the legacy `elicitation/create` request, sent while the call runs, goes to the one
  call in flight on the connection (with several, which one asked cannot be told over stdio: it is declined, with a
  log line); the 2026-07-28 revision's `input_required` result is the call's own: each of its questions is asked
  (with its round's sealed `request_state`), and the call is sent again with the answers, at most ROUNDS_MAX times.
  A call may start from a kept state and its answers (after a restart). Time waiting for a person is not counted in
  `call_timeout_s`. A question devd cannot put to a person (a URL to open) is declined; a request for the client's
  model (sampling) or roots fails the call, saying so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import anyio.abc
import mcp_types as types
import msgspec
import structlog
from mcp.client.session import ClientRequestContext, ClientSession, IncomingMessage
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost, ToolsListChanged, listen
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from devd.agent.mcp.http import Endpoint
from devd.agent.mcp.stdio import Process
from devd.agent.profiles import McpServer, without_url

log = structlog.get_logger("devd.mcp")

State = Literal["stopped", "starting", "ready", "failed"]
REQUESTS_MAX = 64  # requests waiting for the supervisor; a caller past this waits
PAGES_MAX = 100  # of a tools/list: a server that pages for ever is cut there
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
CRASH_BACKOFF_FIRST_S = 5.0  # a server that ended within STABLE_S of its start, the second time in a row
STABLE_S = 30.0  # a life at least this long was no crash loop
EXIT_WAIT_S = 1.0  # for a server whose output ended to be reaped, so its exit status can be told
ROUNDS_MAX = 10  # of a call's input_required rounds (the SDK's default): a server that asks for ever is cut there


class Round(msgspec.Struct, frozen=True):
    """Where a 2026-07-28 question comes from: its round of the call (from 1), the server's key for it, and the
    round's sealed `request_state`, which lets the call be sent again with the answer."""

    number: int
    key: str
    state: str | None


# A call's hook for its server's questions: the question (and its round; None for a legacy elicitation) to its answer.
Ask = Callable[[types.ElicitRequestFormParams, Round | None], Awaitable[types.ElicitResult]]
# Told before the call is sent with the answers to a round (its state): what keeps it from being sent so twice.
Sending = Callable[[str | None], Awaitable[None]]


class Unavailable(Exception):
    """A request could not be answered; `why` says why in a sentence the model and a person can read."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Request:
    """A listing (`tool` None) or a call, waited for by its caller."""

    def __init__(
        self,
        tool: str | None,
        arguments: dict[str, Any] | None,
        timeout_s: float,
        ask: Ask | None = None,
        state: str | None = None,
        responses: types.InputResponses | None = None,
        sending: Sending | None = None,
    ) -> None:
        self.tool, self.arguments, self.timeout_s = tool, arguments, timeout_s
        self.ask, self.state, self.responses = ask, state, responses  # its questions' hook; a kept state, answers
        self.sending = sending
        self.timer: anyio.CancelScope | None = None  # the round's call_timeout_s (paused while a person is asked)
        self.scope = anyio.CancelScope()  # entered by the supervisor's handler; cancelled by a leaving caller
        self.done = anyio.Event()
        self.result: Any = None
        self.error: str | None = None

    def resolve(self, result: Any) -> None:
        if not self.done.is_set():
            self.result = result
            self.done.set()

    def fail(self, why: str) -> None:
        if not self.done.is_set():
            self.error = why
            self.done.set()


Served = Process | Endpoint  # a connection life's transport: a stdio server's process, or an HTTP server
Launch = Callable[[], Awaitable[Served]]  # makes the server's transport (not started); Unavailable when it cannot
Mode = Literal["2026-07-28", "legacy"]


class Connection:
    """A server configuration's one connection. `run` is its supervisor; `tools` and `call` its callers' side."""

    def __init__(self, key: str, server: McpServer, agent: str | None, launch: Launch, *, line_bytes_max: int) -> None:
        self.key, self.server, self.agent, self._launch = key, server, agent, launch
        self.line_bytes_max = line_bytes_max
        self.state: State = "stopped"
        self.pid: int | None = None
        self.restarts = 0  # starts after the first
        self.last_error: str | None = None
        self.sessions: set[str] = set()
        self.listed: tuple[types.Tool, ...] | None = None  # its last listing, as cut at tools_max
        self.scope = anyio.CancelScope()  # of the supervisor: cancelled when the connection is closed
        self._send, self._receive = anyio.create_memory_object_stream[_Request](REQUESTS_MAX)
        self.mode: Mode | None = None  # the protocol era the server speaks, once found
        self._failures = 0  # failed starts in a row
        self._crashes = 0  # lives in a row that ended within STABLE_S of their start
        self._retry_at = 0.0
        self._started = 0
        self._last_used = time.monotonic()
        self._active = 0
        self._ending: str | None = None  # why the life ends, told to the calls it cuts short
        self._idled = False  # the life ended for want of use (not a failure)
        self._calls: anyio.abc.TaskGroup | None = None
        self._session: ClientSession | None = None
        self._inflight: set[_Request] = set()  # the calls sent and not answered: whose a legacy question can be
        self._relisted: anyio.Event | None = None  # set once a listing asked for by list_changed is in

    # -- the callers' side ------------------------------------------------------------------------------------------

    async def tools(self) -> tuple[types.Tool, ...]:
        """The server's tools: its last listing (kept when it stopped: a call starts it again), else it is started
        (and listed) now."""
        if self._relisted is not None:  # a list_changed came: the new listing is what the next turn is offered
            with anyio.move_on_after(self.server.start_timeout_s):
                await self._relisted.wait()
        if self.listed is not None:
            return self.listed
        listed: tuple[types.Tool, ...] = await self._request(_Request(None, None, self.server.start_timeout_s))
        return listed

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        ask: Ask | None = None,
        state: str | None = None,
        responses: types.InputResponses | None = None,
        sending: Sending | None = None,
    ) -> types.CallToolResult:
        """The server's result of the call (an `isError` one included); Unavailable when it gave none. `ask` answers
        the server's questions (None: each is declined); `state` and `responses` resume a call from a kept round;
        `sending` is told before the call is sent with a round's answers."""
        made = _Request(tool, arguments, self.server.call_timeout_s, ask, state, responses, sending)
        result: types.CallToolResult = await self._request(made)
        return result

    async def _request(self, request: _Request) -> Any:
        self._last_used = time.monotonic()
        try:
            await self._send.send(request)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise Unavailable(f"the MCP server {self.server.name} was closed with its session") from None
        try:
            await request.done.wait()
        except BaseException:
            request.scope.cancel()  # the handler's call is cancelled: the SDK tells the server
            raise
        if request.error is not None:
            raise Unavailable(request.error)
        return request.result

    def close(self) -> None:
        """Stop the supervisor (and the process); requests still waiting fail."""
        self.scope.cancel()

    # -- the supervisor ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve requests until closed: one process life at a time, each started by the request that needs it."""
        with self.scope:
            try:
                async for first in self._receive:
                    if time.monotonic() < self._retry_at:
                        left = self._retry_at - time.monotonic()
                        how = (
                            f"failed to start {self._failures} times in a row"
                            if self._failures
                            else f"ended {self._crashes} times in a row within {STABLE_S:g} s of its start"
                        )
                        first.fail(
                            f"the MCP server {self.server.name} {how} (last: {self.last_error}); it is tried again in "
                            f"{max(left, 1):.0f} s"
                        )
                        continue
                    await self._life(first)
            finally:
                self.state = "stopped"
                self._send.close()
                for waiting in self._drain():
                    waiting.fail(f"the MCP server {self.server.name} was closed")
                self._receive.close()

    def _drain(self) -> list[_Request]:
        drained = []
        while True:
            try:
                drained.append(self._receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return drained

    async def _life(self, first: _Request) -> None:
        name = self.server.name
        self.state, self._ending, self._idled = "starting", None, False
        if self._started:
            self.restarts += 1
        self._started += 1
        try:
            process = await self._launch()
        except Unavailable as e:
            self._failed(e.why)
            first.fail(e.why)
            return
        ready, began = anyio.Event(), time.monotonic()
        async with anyio.create_task_group() as life:

            async def watchdog() -> None:
                await anyio.sleep(self.server.start_timeout_s)
                if not ready.is_set():
                    self._ending = (
                        f"the MCP server {name} did not finish its handshake within {self.server.start_timeout_s:g} "
                        f"s (start_timeout_s); {process.exit_status()}"
                    )
                    life.cancel_scope.cancel()

            life.start_soon(watchdog)
            try:
                async with process.connect() as (read, write):
                    self.pid = process.pid
                    async with ClientSession(
                        read, write, message_handler=self._on_message, elicitation_callback=self._on_elicit
                    ) as session:
                        with anyio.fail_after(self.server.start_timeout_s + 1):  # the watchdog fires first
                            await self._handshake(session, process)
                            self.listed = await self._list(session)
                        ready.set()
                        began = time.monotonic()
                        self.state, self._failures, self._last_used = "ready", 0, time.monotonic()
                        log.info("mcp.ready", server=name, agent=self.agent, pid=self.pid, tools=len(self.listed))
                        await self._serve(session, first, process)
            except Exception as e:  # what the SDK or the transport raised: the life is over, and says why
                leaf = _leaf(e)
                self._ending = self._ending or self._ended_why(process, f"{type(leaf).__name__}: {leaf}")
            finally:
                life.cancel_scope.cancel()
        self.pid = None
        if not ready.is_set():
            self.listed = None
        why = self._ending or self._ended_why(process, None)
        first.fail(why)
        if not ready.is_set():
            self._failed(why)
        elif self._idled:
            self.state, self._crashes = "stopped", 0  # once its process is gone
        else:
            self.state, self.last_error = "failed", why
            log.warning("mcp.ended", server=name, agent=self.agent, why=why[:500])
            self._crashes = self._crashes + 1 if time.monotonic() - began < STABLE_S else 0
            if self._crashes > 1:  # the first is started again at its next use: a call may have ended it
                wait = min(CRASH_BACKOFF_FIRST_S * 2 ** (self._crashes - 2), BACKOFF_MAX_S)
                self._retry_at = time.monotonic() + wait

    async def _handshake(self, session: ClientSession, served: Served) -> None:
        """The protocol era agreed: the handshake (`initialize`) with a stdio server; with an HTTP one (or one whose
        `protocol` is "auto"), `server/discover` first (unless it refused before), falling back to the handshake when
        it is refused."""
        era = self.server.protocol or ("auto" if isinstance(served, Endpoint) else "legacy")
        if era == "auto" and self.mode != "legacy":
            # A server of the handshake era may leave the unknown method unanswered rather than refuse it: half of
            # start_timeout_s is left for the handshake.
            half = self.server.start_timeout_s / 2
            why = f"no answer to server/discover within {half:g} s"
            with anyio.move_on_after(half):
                try:
                    await session.discover()
                except (MCPError, RuntimeError, ValidationError) as e:
                    why = self._hidden(str(e))
                else:
                    self.mode = "2026-07-28"
                    return
            log.info("mcp.legacy", server=self.server.name, agent=self.agent, why=why[:300])
        await session.initialize()
        self.mode = "legacy"

    def _failed(self, why: str) -> None:
        self.state, self.last_error = "failed", why
        self._failures += 1
        self._retry_at = time.monotonic() + min(BACKOFF_FIRST_S * 2 ** (self._failures - 1), BACKOFF_MAX_S)
        log.warning("mcp.start_failed", server=self.server.name, agent=self.agent, why=why[:500])

    def _hidden(self, text: str) -> str:
        """text as it may be shown: an HTTP server's errors may name its URL, whose query may hold a key."""
        return without_url(text, self.server.url) if self.server.url else text

    def _ended_why(self, process: Served, error: str | None) -> str:
        said = process.why or ("it ended" if error is None else f"the connection failed ({error[:300]})")
        return f"the MCP server {self.server.name} stopped: {self._hidden(said)}; {process.exit_status()}"

    async def _serve(self, session: ClientSession, first: _Request, process: Served) -> None:
        """Answer requests until the process ends or has been idle for idle_s."""
        async with anyio.create_task_group() as calls:
            self._calls, self._session = calls, session

            def handle(request: _Request) -> None:
                self._active += 1  # counted from now: the idle watcher must not stop a server a call was given to
                calls.start_soon(self._handle, session, request, process)

            async def receive() -> None:
                handle(first)
                async for request in self._receive:
                    handle(request)

            async def idle() -> None:
                while True:
                    left = self._last_used + self.server.idle_s - time.monotonic()
                    if left <= 0 and self._active == 0:
                        self._idled = True
                        self._ending = f"the MCP server {self.server.name} was stopped after idle_s with no call"
                        log.info("mcp.idle", server=self.server.name, agent=self.agent)
                        calls.cancel_scope.cancel()
                        return
                    await anyio.sleep(max(left, 0.05))

            async def ended() -> None:
                await process.ended.wait()
                await _reaped(process)  # so that the calls it cuts short say how it ended
                self._ending = self._ending or self._ended_why(process, None)
                calls.cancel_scope.cancel()

            calls.start_soon(receive)
            calls.start_soon(idle)
            calls.start_soon(ended)
            if self.mode == "2026-07-28":
                calls.start_soon(self._listen, session)
        self._calls, self._session = None, None
        if not self._idled:
            await _reaped(process)
            self._ending = self._ending or self._ended_why(process, None)

    async def _handle(self, session: ClientSession, request: _Request, process: Served) -> None:
        try:
            with request.scope:
                if request.tool is None:
                    request.resolve(self.listed)
                    return
                self._inflight.add(request)
                result = await self._rounds(session, request)
                if isinstance(result, str):
                    request.fail(result)
                else:
                    request.resolve(result)
        except MCPError as e:
            if process.ended.is_set() or "closed" in e.error.message.lower():
                await _reaped(process)
                request.fail(self._ending or self._ended_why(process, None))
            else:
                said = self._hidden(str(e))
                request.fail(f"the MCP server {self.server.name} answered {request.tool} with an error: {said}")
        except (ValidationError, RuntimeError, ValueError) as e:  # a result the protocol does not allow
            said = self._hidden(str(e))
            name, tool = self.server.name, request.tool
            request.fail(f"the MCP server {name} answered {tool} with what MCP does not allow: {said}")
        finally:
            self._inflight.discard(request)
            self._active -= 1
            self._last_used = time.monotonic()
            if not request.done.is_set():
                request.fail(self._ending or self._ended_why(process, None))

    async def _rounds(self, session: ClientSession, request: _Request) -> types.CallToolResult | str:
        """The call's result, after as many rounds of questions as the server asks (2026-07-28); or why there is
        none (a round not answered within call_timeout_s, a question devd cannot answer, too many rounds)."""
        assert request.tool is not None
        name, state, responses = self.server.name, request.state, request.responses
        for number in range(1, ROUNDS_MAX + 1):
            if responses is not None and request.sending is not None:
                try:
                    await request.sending(state)
                except Exception as e:  # not kept: not sent (a restart could send it twice)
                    return f"devd could not keep that {request.tool} is sent with its answers ({e}); it was not sent"
            with anyio.CancelScope(deadline=anyio.current_time() + request.timeout_s) as request.timer:
                result = await session.call_tool(
                    request.tool,
                    request.arguments,
                    request_state=state,
                    input_responses=responses,
                    allow_input_required=True,
                )
            if request.timer.cancelled_caught:
                return (
                    f"the MCP server {name} did not answer {request.tool} within {request.timeout_s:g} s "
                    "(call_timeout_s); the call was cancelled"
                )
            if not isinstance(result, types.InputRequiredResult):
                return result
            state = result.request_state
            answered = await self._inputs(request, number, result)
            if isinstance(answered, str):
                return answered
            responses = answered
        return f"the MCP server {name} asked more than {ROUNDS_MAX} rounds of questions in {request.tool}; it was cut"

    async def _inputs(
        self, request: _Request, number: int, result: types.InputRequiredResult
    ) -> types.InputResponses | str:
        """The answers to a round's questions, asked all at once; or why the call cannot go on."""
        answers: types.InputResponses = {}
        refused: list[str] = []

        async def one(key: str, asked: types.InputRequest, tg: anyio.abc.TaskGroup) -> None:
            if isinstance(asked, types.ElicitRequest):
                if isinstance(asked.params, types.ElicitRequestFormParams) and request.ask is not None:
                    answers[key] = await request.ask(asked.params, Round(number, key, result.request_state))
                else:  # a URL to open (or no one to ask): declined
                    answers[key] = types.ElicitResult(action="decline")
                return
            what = "its model (sampling)" if isinstance(asked, types.CreateMessageRequest) else "its roots"
            refused.append(
                f"the MCP server {self.server.name} asked devd for {what} in {request.tool}, which devd does not "
                "offer; the call was not completed"
            )
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for key, asked in (result.input_requests or {}).items():
                tg.start_soon(one, key, asked, tg)
        return refused[0] if refused else answers

    async def _on_elicit(
        self, context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        """A legacy question (`elicitation/create`), sent while a call runs: put to that call's hook, while it runs."""
        asking = [r for r in self._inflight if r.ask is not None]
        if not isinstance(params, types.ElicitRequestFormParams) or len(asking) != 1:
            why = "it asks to open a URL" if asking else "no call of devd's is in flight"
            if len(asking) > 1:
                why = f"{len(asking)} calls are in flight on this shared server, and which one asked cannot be told"
            log.warning("mcp.question_declined", server=self.server.name, agent=self.agent, why=why)
            return types.ElicitResult(action="decline")
        request = asking[0]
        timer = request.timer
        if timer is not None:
            timer.deadline = math.inf  # a person's time is not the server's
        answered = types.ElicitResult(action="cancel")
        try:
            async with anyio.create_task_group() as tg:  # the question ends with its call

                async def ended() -> None:
                    await request.done.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(ended)
                assert request.ask is not None
                answered = await request.ask(params, None)
                tg.cancel_scope.cancel()
        finally:
            if timer is not None:
                timer.deadline = anyio.current_time() + request.timeout_s
        return answered

    async def _list(self, session: ClientSession) -> tuple[types.Tool, ...]:
        tools: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(PAGES_MAX):
            params = None if cursor is None else types.PaginatedRequestParams(cursor=cursor)
            page = await session.list_tools(params=params)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None or len(tools) > self.server.tools_max:
                break
        if len(tools) > self.server.tools_max:
            log.warning(
                "mcp.tools_refused",
                server=self.server.name,
                agent=self.agent,
                listed=len(tools),
                kept=self.server.tools_max,
                why="more tools than tools_max",
            )
        return tuple(tools[: self.server.tools_max])

    async def _on_message(self, message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification) and self._calls is not None:
            self._relisted = anyio.Event()
            self._calls.start_soon(self._relist, self._relisted)

    async def _listen(self, session: ClientSession) -> None:
        """In the 2026-07-28 revision a server tells of a changed list only on a `subscriptions/listen` stream: held
        open for the life, each `ToolsListChanged` has the tools listed again. A server that refuses it is logged
        (its list then changes only when it is started again)."""
        try:
            async with listen(session, tools_list_changed=True) as events:
                async for event in events:
                    if isinstance(event, ToolsListChanged) and self._calls is not None:
                        self._relisted = anyio.Event()
                        self._calls.start_soon(self._relist, self._relisted)
        except (MCPError, ListenNotSupportedError, SubscriptionLost, TimeoutError) as e:
            log.info("mcp.listen_refused", server=self.server.name, agent=self.agent, why=self._hidden(str(e))[:300])

    async def _relist(self, relisted: anyio.Event) -> None:
        # Listed again on the supervisor's session, in its task group; a failure keeps the old list.
        try:
            if self._session is not None:
                self.listed = await self._list(self._session)
                log.info("mcp.relisted", server=self.server.name, agent=self.agent, tools=len(self.listed))
        except (MCPError, ValidationError) as e:
            log.warning("mcp.relist_failed", server=self.server.name, error=self._hidden(str(e))[:300])
        finally:
            relisted.set()


def _leaf(error: BaseException) -> BaseException:
    """The first error an exception group holds (a transport's task group wraps what failed in one)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


async def _reaped(process: Served) -> None:
    if process.pid is None:  # no process of ours (an HTTP server): nothing to reap
        return
    with anyio.move_on_after(EXIT_WAIT_S):
        while process.returncode is None:
            await anyio.sleep(0.01)
