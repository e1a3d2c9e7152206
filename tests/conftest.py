"""Fixtures shared by the tests: one Core for every test that does not close its own (a compile costs ~0.1 s), a
real daemon (in this process) with a client of it, and a store of each backend of tests/stores.py.

The suite is hermetic: before anything else is imported, the variables by which devd finds a user's configuration,
state and socket (XDG_CONFIG_HOME, XDG_STATE_HOME, XDG_RUNTIME_DIR) point into a directory of this run, and the ones
systemd or the user set for a daemon (CONFIGURATION_DIRECTORY, NOTIFY_SOCKET, LISTEN_FDS, every DEVD_ variable but the
suite's own knobs) are dropped. Every daemon and CLI a test starts as a process inherits this environment, as do
pytest-xdist's workers. HOME is kept: devd reads it only when XDG_CONFIG_HOME or XDG_STATE_HOME is unset (never, here),
and npm keeps its package cache there for tests/test_typescript.py."""

# ruff: noqa: E402  (the environment is made hermetic before devd, or anything that may import it, is imported)
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

SUITE_KNOBS = ("DEVD_FUZZ", "DEVD_PG_BIN")  # read by the tests and benchmarks themselves, never by devd
SYSTEMD_VARIABLES = (
    "CONFIGURATION_DIRECTORY",
    "STATE_DIRECTORY",
    "RUNTIME_DIRECTORY",
    "CREDENTIALS_DIRECTORY",
    "NOTIFY_SOCKET",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
)


def _hermetic_environment() -> None:
    """Point devd's XDG directories into a fresh directory of this run (removed at exit) and drop the variables a
    daemon would otherwise obey. pytest-xdist's workers find the controller's directory already set and keep it."""
    if not os.environ.get("DEVD_SUITE_HOME"):
        home = tempfile.mkdtemp(prefix="devd-suite-")
        atexit.register(shutil.rmtree, home, ignore_errors=True)
        os.environ["DEVD_SUITE_HOME"] = home
    home = os.environ["DEVD_SUITE_HOME"]
    for name in ("config", "state", "run"):
        os.makedirs(os.path.join(home, name), mode=0o700, exist_ok=True)
    os.environ["XDG_CONFIG_HOME"] = os.path.join(home, "config")
    os.environ["XDG_STATE_HOME"] = os.path.join(home, "state")
    os.environ["XDG_RUNTIME_DIR"] = os.path.join(home, "run")
    for name in list(os.environ):
        if name in SYSTEMD_VARIABLES or (name.startswith("DEVD_") and name not in (*SUITE_KNOBS, "DEVD_SUITE_HOME")):
            del os.environ[name]


_hermetic_environment()

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from devd.client import Client
from devd.host import Core, Instance
from devd.messages import Config
from devd.storage.store import Store
from tests.daemon import Daemon
from tests.harness import InProcess
from tests.postgres import postgres, postgres_url  # noqa: F401  (the fixtures, for the postgres backend)
from tests.stores import BACKENDS, Backend

# anyio loads most of its names on first use, and pytest rewrites the asserts of the anyio package (a plugin of its
# own) as it loads: a first `anyio.open_process` on an in-process daemon's thread parsed a module's source into an
# AST while the main thread parsed another, and CPython 3.11's AST constructor is not safe across threads ("SystemError:
# AST constructor recursion depth mismatch", raised in the daemon's agent driver: a full run saw it once). Every name
# is loaded here, on the main thread, before any test starts a thread. A daemon outside pytest is not rewritten.
for _module in (anyio, anyio.abc):
    for _name in dir(_module):
        getattr(_module, _name)


@pytest.fixture
def anyio_backend() -> str:
    """The async tests' backend: asyncio, the one the daemon runs on."""
    return "asyncio"


@pytest.fixture(scope="session")
def core() -> Iterator[Core]:
    c = Core.open()
    yield c
    c.close()


@pytest.fixture
def session(core: Core) -> Iterator[Instance]:
    s = core.new(Config())
    yield s
    try:
        s.close()
    except Exception:
        pass


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[InProcess]:
    """The real daemon, in this process (`tests.harness`), on a socket and state directory in tmp_path."""
    with InProcess(tmp_path) as d:
        yield d


@pytest.fixture
def process_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """The real daemon as a process of its own (`tests.daemon`), for a test that kills it or reads its log."""
    with Daemon(tmp_path) as d:
        yield d


@pytest.fixture
def client(daemon: InProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


@pytest.fixture(params=list(BACKENDS.values()), ids=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend of `tests.stores.BACKENDS` in turn."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def store_factory(backend: Backend, tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., Awaitable[Store]]:
    """Opens a store of the backend, always on the test's own place (so a second one opens the first one's data),
    with the pruning limits given (`tests.stores.LIMITS` otherwise)."""
    place = backend.place(request, tmp_path)

    async def open_store(**limits: int) -> Store:
        return await backend.open(place, **limits)

    return open_store


# The longest tests (10-18 s each, measured with --durations) start first, so that under pytest-xdist the short ones
# fill the workers around them rather than one of them running alone at the end.
LONGEST_FIRST = (
    "test_bench_fleet.py",
    "test_crash.py",
    "test_registry_model.py",
    "test_typescript.py",
    "test_fuzz.py",
)


def pytest_sessionfinish() -> None:
    """Remove the command cgroups that daemons the tests killed mid-command left (devd.agent.cgroups): the next daemon
    to start removes them, and after the last test none starts: the suite would leave them in the cgroup it ran in."""
    from devd.agent import cgroups

    where = cgroups.place()
    if not isinstance(where, str):
        cgroups.sweep(where)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
