"""`devd doctor`'s checks of a PostgreSQL store (a fleet's): the database answers, is of a format this devd reads,
and which daemons of the fleet hold a live lease. Read only, on one short connection; the URL's password is never
shown."""

from __future__ import annotations

import psycopg
import psycopg.conninfo

from devd.storage.doctor import Check
from devd.storage.postgres import MIGRATIONS

__all__ = ["checks", "shown"]

CONNECT_TIMEOUT_S = 5


def shown(url: str) -> str:
    """The database a URL names, as `user@host:port/db`, without its password."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "the --store URL"
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"{user}{parts.get('host') or 'localhost'}{port}/{parts.get('dbname') or ''}"


def checks(url: str) -> list[Check]:
    """The database check; then, if it answers, its format and its fleet."""
    where = shown(url)
    try:
        conn = psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True, application_name="devd doctor")
    except psycopg.Error as e:
        return [
            Check(
                "database",
                "FAIL",
                f"cannot connect to {where}: {e}; check that PostgreSQL runs there, the URL, and the role's password "
                "or peer setup (docs/fleet.md)",
            )
        ]
    with conn:
        version = conn.execute("SHOW server_version").fetchone()
        database = Check("database", "ok", f"{where} answers (PostgreSQL {version[0] if version else 'unknown'})")
        try:
            return [database, _format(conn, where), _fleet(conn)]
        except psycopg.Error as e:
            return [database, Check("format", "FAIL", f"{where} cannot be read: {e}; see the server's log")]


def _format(conn: psycopg.Connection, where: str) -> Check:
    found = conn.execute("SELECT to_regclass('devd_schema') IS NOT NULL").fetchone()
    if not (found and found[0]):
        return Check(
            "format", "ok", f"{where} holds no devd tables yet; the first `devd serve --store` on it makes them"
        )
    row = conn.execute("SELECT coalesce(max(version), 0) FROM devd_schema").fetchone()
    version, latest = int(row[0]) if row else 0, len(MIGRATIONS)
    if version > latest:
        return Check(
            "format",
            "FAIL",
            f"{where} is format {version}, written by a newer devd (this one reads up to {latest}); run that devd "
            "or a newer one",
        )
    upgrade = f"; this devd migrates it to format {latest} when it starts" if version < latest else ""
    return Check("format", "ok", f"{where} is format {version}{upgrade}")


def _fleet(conn: psycopg.Connection) -> Check:
    if conn.execute("SELECT to_regclass('nodes') IS NULL").fetchone() == (True,):
        return Check("fleet", "skip", "no daemon has joined this database yet")
    nodes = conn.execute("SELECT id, address, lease_until > now() FROM nodes ORDER BY id").fetchall()
    held = conn.execute("SELECT count(*) FROM sessions WHERE owner IS NOT NULL").fetchone()
    live = [f"{node} at {address}" for node, address, alive in nodes if alive]
    if not live:
        return Check(
            "fleet",
            "skip",
            f"no daemon holds a live lease ({len(nodes)} have joined); none is serving this database now",
        )
    return Check(
        "fleet",
        "ok",
        f"{len(live)} of {len(nodes)} daemons hold a live lease ({', '.join(live)}); "
        f"{held[0] if held else 0} sessions have an owner",
    )
