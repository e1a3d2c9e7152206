"""The slash commands `devd acp` offers an editor (ACP's `available_commands_update`), each carried out on the daemon
when a prompt starts with it, instead of a turn: the answer is told as the agent's message, and the prompt ends
(`end_turn`). What the daemon refuses is told the same way, in its own words: a command typed by a person is not a
protocol error.

- `/rewind [TURN] [force]`: `session/rewind` to before TURN (default: the last turn this editor has seen);
- `/title TEXT`: `session/title`;
- `/effects`: `session/effects`, one line each;
- `/usage`: `session/usage`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from devd import errors
from devd.acp import wire
from devd.render import inline

if TYPE_CHECKING:
    from devd.acp.bridge import Attached, Bridge

Run = Callable[["Bridge", "Attached", str, str], Awaitable[str]]


async def _rewind(bridge: Bridge, attached: Attached, name: str, arg: str) -> str:
    words = arg.split()
    force = "force" in words
    numbers = [w for w in words if w != "force"]
    seen = set(attached.view.outcomes) | attached.view.running
    if len(numbers) > 1 or (numbers and not numbers[0].isdigit()):
        return "usage: /rewind [TURN] [force]: TURN is a turn's number, as /effects shows it"
    if not numbers and not seen:
        return "no turn to rewind: this session has had no turn here; give one: /rewind TURN"
    turn = int(numbers[0]) if numbers else max(seen)
    body = {"session": name, "turn": turn, "force": force}
    try:
        done = await bridge.call("session/rewind", body)
    except errors.ConflictError as e:
        return f"{e}\nType /rewind {turn} force to put every file back regardless."
    attached.view.outcomes = {t: o for t, o in attached.view.outcomes.items() if t < turn}
    lines = [f"Rewound to before turn {turn}."]
    lines += [f"restored {inline(p)}" for p in done["restored"]] + [f"removed {inline(p)}" for p in done["removed"]]
    lines += [f"not undone: {n['kind']} {inline(_subject(n['subject']))}" for n in done["not_undone"]]
    lines.append(f"The conversation before the rewind is kept as session {done['kept_as']}.")
    return "\n".join(lines)


async def _title(bridge: Bridge, attached: Attached, name: str, arg: str) -> str:
    if not arg.strip():
        return "usage: /title TEXT"
    await bridge.call("session/title", {"session": name, "title": arg.strip()})
    return f"The session is called {inline(arg.strip())}."


async def _effects(bridge: Bridge, attached: Attached, name: str, arg: str) -> str:
    found = (await bridge.call("session/effects", {"session": name}))["effects"]
    if not found:
        return "No command, git call or write has run in this session."
    return "\n".join(
        f"turn {e['turn']}: {e['kind']} {inline(_subject(e['subject']))} {e['outcome']}"
        + (" (undoable)" if e["undoable"] else "")
        for e in found
    )


async def _usage(bridge: Bridge, attached: Attached, name: str, arg: str) -> str:
    u = await bridge.call("session/usage", {"session": name})
    return (
        f"{u['input_tokens']} input and {u['output_tokens']} output tokens ({u['cached_tokens']} cached) in "
        f"{u['calls']} model calls; {u['refused']} refused by a spend ceiling."
    )


def _subject(subject: Any) -> str:
    return subject if isinstance(subject, str) else " ".join(str(w) for w in subject)


COMMANDS: dict[str, tuple[wire.AvailableCommand, Run]] = {
    "rewind": (
        wire.AvailableCommand(
            "rewind",
            "Put back the files this session's writes changed since a turn began, and the conversation to before it",
            wire.CommandInput("[TURN] [force]"),
        ),
        _rewind,
    ),
    "title": (wire.AvailableCommand("title", "Name this session", wire.CommandInput("TEXT")), _title),
    "effects": (wire.AvailableCommand("effects", "List the commands, git calls and writes this session ran"), _effects),
    "usage": (wire.AvailableCommand("usage", "Show the tokens this session's model calls used"), _usage),
}

OFFERED = wire.AvailableCommandsUpdate([command for command, _ in COMMANDS.values()])


def parse(text: str) -> tuple[Run, str] | None:
    """The command a prompt is, with what follows its name; None for a prompt that is not one of them."""
    if not text.startswith("/"):
        return None
    head, _, arg = text[1:].partition(" ")
    found = COMMANDS.get(head.strip())
    return None if found is None else (found[1], arg)


async def run(bridge: Bridge, attached: Attached, name: str, command: Run, arg: str) -> str:
    """What to tell the editor: the command's answer, or the daemon's refusal in its words."""
    try:
        return await command(bridge, attached, name, arg)
    except errors.DevdError as e:
        return f"devd: {e}"
