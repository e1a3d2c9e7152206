"""The agent runtime in a fleet (a PostgreSQL store shared by daemons): a daemon that takes over a session whose
daemon died during a command finds its claim, and does not run the command again."""

from __future__ import annotations

import time
from pathlib import Path

from devd import errors
from tests.agents import SECRET, agents_toml, conversation, until_done, watch_raw
from tests.daemon import Daemon
from tests.postgres import postgres, postgres_url  # noqa: F401  (the fixtures)
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]

LEASE_TTL_S = 1.0
INTERRUPTED = (
    "interrupted: the daemon stopped while this command ran, so it may have partly run; it was not run again "
    "(check the workspace before you run it again)"
)


def test_a_daemon_that_takes_over_a_session_never_runs_its_claimed_command_again(
    tmp_path: Path,
    standin: Standin,
    postgres_url: str,  # noqa: F811
) -> None:
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    (tmp_path / "agents.toml").write_text(agents_toml(standin.url, tmp_path / "roots"))
    args = ("--store", postgres_url, "--lease-ttl", str(LEASE_TTL_S), "--agents", str(tmp_path / "agents.toml"))
    env = {"DEVD_TEST_KEY": SECRET}
    a = Daemon(tmp_path / "a", *args, "--node", "a", env=env).start()
    b = Daemon(tmp_path / "b", *args, "--node", "b", env=env).start()
    standin.script(
        Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs; sleep 60"]})]), Scripted(text="after")
    )
    with a, b:
        with a.client() as c:
            session = c.new(agent="coder", workspace=workspace)
            c.prompt(session, "run it")
        deadline = time.monotonic() + 20
        while (
            not (workspace / "runs").is_file() or (workspace / "runs").read_text() != "run\n"
        ):  # written, not only opened
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.01)
        a.kill()
        with b.client() as c:
            deadline = time.monotonic() + 20
            while True:
                try:
                    c.resume(session)  # taken over once a's lease has ended
                    break
                except errors.MovedError:
                    assert time.monotonic() < deadline, "the session was never taken over"
                    time.sleep(0.05)
            watch_raw(c, session, since=0)
            until_done(c, 1)
            tools = [m["Tool"] for m in conversation(c, session) if "Tool" in m]
    assert ((workspace / "runs").read_text(), tools) == ("run\n", [{"id": 2, "text": INTERRUPTED, "failed": True}])
