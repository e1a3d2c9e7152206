"""`devd acp [--agent NAME]`: the command an editor spawns. ACP on stdin/stdout, the daemon at the address every
client uses; logs (JSON lines) on stderr, which editors keep in their agent log.

Exit status: 0 when the editor closes our input; 3 when no daemon answers at the start (stderr says how to start
one); 2 for a local problem (a token file that cannot be read: said by `devd.cli`, which reads it).
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_UNREACHABLE = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--agent",
        metavar="NAME",
        help="the agent profile (an [agent.NAME] table of the daemon's agents.toml) that drives the sessions this "
        "editor starts (default: the daemon's choice)",
    )
    p.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="what goes to stderr"
    )


async def serve(address: str, token: str | None, agent: str | None) -> None:
    """Serve one editor on stdin/stdout until its input ends."""
    from devd.acp.bridge import Bridge, Editor
    from devd.acp.stdio import Stdio
    from devd.client import AsyncClient

    stdio = Stdio()
    async with AsyncClient.connect(address, token=token) as client:
        bridge = Bridge(client, Editor(stdio.write), agent=agent, token=token)
        try:
            await bridge.run(stdio.lines())
        except* BrokenPipeError:
            pass  # the editor went away: nothing more to tell it, and its sessions go on in the daemon


def main(args: argparse.Namespace, address: str, token: str | None) -> int:
    """Serve the editor, against the daemon at `address` (found, with the token, by the rules of every client
    command: `devd.cli`, which calls this); the exit status."""
    # Imported here, not above: `devd --help` builds this command's parser without loading the bridge.
    import anyio

    from devd import log as logging_setup
    from devd.client import NotRunningError

    logging_setup.configure("json" if not sys.stderr.isatty() else None, args.log_level)
    try:
        anyio.run(serve, address, token, args.agent, backend="asyncio")
    except NotRunningError as e:
        print(f"devd acp: {e.strerror}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except PermissionError as e:
        print(f"devd acp: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK
