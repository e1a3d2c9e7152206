"""What a start loads: a module imported at start is paid for by every start (README, "### Start"). A daemon loads
what its configuration uses and nothing for what it may meet later (an agents file to parse, a Retry-After that is
an HTTP date)."""

from __future__ import annotations

from pathlib import Path

from tests.daemon import Daemon


def imported(log: Path) -> set[str]:
    """The modules named in a process's `-X importtime` lines (PYTHONPROFILEIMPORTTIME) in log."""
    return {line.rpartition("|")[2].strip() for line in log.read_text().splitlines() if line.startswith("import time:")}


def test_a_daemon_without_an_agents_file_loads_no_toml_parser_nor_the_email_package(tmp_path: Path) -> None:
    env = {"PYTHONPROFILEIMPORTTIME": "1", "XDG_CONFIG_HOME": str(tmp_path / "config")}  # no agents.toml there
    with Daemon(tmp_path, env=env) as daemon:
        daemon.stop()
    assert {"tomllib", "email", "email.utils"} & imported(daemon.log) == set()
