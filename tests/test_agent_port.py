"""The runtime's port onto the sessions (devd.agent.port.RegistryPort): a call the runtime makes on a session another
call holds waits for that call to end, woken as it ends (`Registry.wait_free`), not by polling BUSY. The daemon's
parts as `build` wires them, with no connection."""

from __future__ import annotations

from pathlib import Path

import anyio

from devd.agent.port import RegistryPort
from devd.agent.wire import AgentPort
from devd.config import Settings
from devd.host import Core
from devd.messages import Action
from devd.server.daemon import build
from devd.storage.memory import MemoryStore


async def test_a_call_on_a_held_session_waits_for_its_release_and_is_answered_once_it_comes(
    tmp_path: Path, core: Core
) -> None:
    registry, dispatcher = build(Settings(state_dir=tmp_path, socket_path=None), core, MemoryStore())
    port = dispatcher.app.sessions
    assert isinstance(port, AgentPort) and isinstance(port.runtime.sessions, RegistryPort)
    sessions = port.runtime.sessions
    await registry.new("s", b"{}")
    entry = registry.get("s")
    assert entry is not None
    answered: list[list[Action]] = []
    async with anyio.create_task_group() as tg:
        with registry.held(entry):  # another call is inside the session
            tg.start_soon(lambda: _pending(sessions, answered))
            await anyio.wait_all_tasks_blocked()
            # Parked on the session's release, once: a poller would sleep instead, with no waiter here.
            assert entry.freed is not None
            waiting = entry.freed.statistics().tasks_waiting
            before = list(answered)
    registry.close_all()
    assert (waiting, before, answered) == (1, [], [[]])


async def _pending(sessions: RegistryPort, answered: list[list[Action]]) -> None:
    answered.append(await sessions.pending("s"))


async def test_waiting_for_a_free_session_returns_at_once_when_none_holds_it(tmp_path: Path, core: Core) -> None:
    registry, _ = build(Settings(state_dir=tmp_path, socket_path=None), core, MemoryStore())
    await registry.new("s", b"{}")
    with anyio.fail_after(5):  # a bound on a hang, not a measure
        await registry.wait_free("s")
        await registry.wait_free("no such session")
    entry = registry.get("s")
    registry.close_all()
    assert entry is not None and entry.freed is None
