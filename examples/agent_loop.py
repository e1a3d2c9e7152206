"""An agent loop on devd, its model a script (no network). With a daemon up: python examples/agent_loop.py DIR"""

import subprocess
import sys
from pathlib import Path

import anyio

from devd.client import AsyncClient
from devd.driver import Handlers, ToolOutput, run_turn
from devd.messages import Call, Exec, Read, Reply, Write

SCRIPT = [  # the model's answers, in order (the core refuses a path outside the workspace before a handler sees it)
    Reply(calls=[Call(Write=Write(path="todo.txt", text="buy milk\ncall mom\n"))]),
    Reply(calls=[Call(Exec=Exec(argv=["wc", "-l", "todo.txt"])), Call(Read=Read(path="todo.txt"))]),
    Reply(text="todo.txt has 2 lines: buy milk, call mom."),
]


async def main(workspace: Path) -> None:
    def run(op: Exec) -> ToolOutput:
        done = subprocess.run(op.argv, cwd=workspace, capture_output=True, text=True)
        print("exec", *op.argv, "->", done.stdout.strip())
        return ToolOutput(done.stdout + done.stderr, failed=done.returncode != 0)

    handlers = Handlers(
        model=lambda ask: SCRIPT[sum(m.Agent is not None for m in ask.messages)],  # the answer after those given
        exec=run,
        read=lambda op: (workspace / op.path).read_text(),
        write=lambda op: f"wrote {(workspace / op.path).write_text(op.text)} characters",
        emit=print,
    )
    async with AsyncClient.connect() as client:  # at $DEVD_SOCKET, else the daemon's default socket
        done = await run_turn(client, await client.new(), "what is on my list?", handlers)
    print("turn", done.turn, "complete" if done.outcome.Complete else "cancelled")


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
