"""Agent profiles: the `[agent.NAME]` tables of agents.toml, checked whole before the daemon starts, and the policy
they set for each call.

A bad file is refused with `FILE:LINE: what is wrong and what to do` (a `ConfigError`). A profile keeps the *name* of
the environment variable holding its API key, never the key: the key is read from the environment each time it is
needed, so it cannot reach a repr, an encoded profile, the journal or a log.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args
from urllib.parse import urlsplit

import msgspec

from devd.agent import wrappers
from devd.config import configuration_dirs
from devd.errors import ConfigError, InvalidParamsError

if TYPE_CHECKING:
    import tomllib

Decision = Literal["allow", "deny", "ask"]
SandboxMode = Literal["auto", "bwrap", "none"]
TokenParam = Literal["max_tokens", "max_completion_tokens"]
EXTRA_TOOLS = ("browse",)  # tools a profile must list in `tools` to enable
_STRICTNESS: dict[str, int] = {"allow": 0, "ask": 1, "deny": 2}


class Rule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An argv prefix rule for Exec and Git (Git's argv is `["git", *argv]`)."""

    prefix: tuple[str, ...]
    decision: Decision


class Budget(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Token budgets (kept for the spend limits; nothing here enforces them)."""

    tokens_per_turn: int | None = None
    tokens_per_session: int | None = None
    tokens_per_day: int | None = None


Share = Literal["profile", "session"]
McpProtocol = Literal["auto", "legacy"]


class McpServer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An MCP server a profile's sessions may call (`[agent.NAME.mcp.SERVER]`): a stdio `command` or a Streamable HTTP
    `url`. `env` maps the server's variable to the *name* of the daemon's variable holding its value (`headers` an
    HTTP header to one), never the value. `tools` is the tools offered (None: every tool it lists); `decision` decides
    its calls, `rules` one tool's by its name. `share`: one process for every session of the profile (and
    workspace), or one per session. `protocol`: "auto" speaks MCP's 2026-07-28 revision where the server
    does (`server/discover`, else the handshake era's `initialize`): its questions outlive a daemon restart; "legacy"
    only the handshake era's; unset, "auto" for an HTTP server and "legacy" for a stdio one."""

    name: str
    command: tuple[str, ...] | None = None
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    tools: tuple[str, ...] | None = None
    decision: Decision = "ask"
    rules: tuple[tuple[str, Decision], ...] = ()
    network: bool = False
    share: Share = "profile"
    idle_s: float = 300.0
    start_timeout_s: float = 10.0
    call_timeout_s: float = 120.0
    tools_max: int = 1000
    trust_read_only: bool = False  # a tool whose annotations say readOnlyHint is decided and carried out as a read
    output_bytes_max: int | None = None  # a result is cut past this (never past the profile's)
    protocol: McpProtocol | None = None  # None: "auto" for an HTTP server, "legacy" for a stdio one


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One agent profile. `api_key_env` is the name of an environment variable, never the secret itself."""

    name: str
    base_url: str
    model: str
    workspace_roots: tuple[str, ...]
    api_key_env: str | None = None
    system: str | None = None
    exec: Decision = "allow"
    write: Decision = "allow"
    rules: tuple[Rule, ...] = ()
    sandbox: SandboxMode = "auto"
    network: bool = False
    exec_timeout_s: float = 120.0
    output_bytes_max: int = 1048576
    run_as: str | int = "nobody"  # under a root daemon, who a command of a root-owned workspace runs as (never root)
    processes_max: int = 256  # a command's processes and threads (its pids cgroup, else RLIMIT_NPROC of its user)
    memory_bytes_max: int = 4 * 1024**3  # a command's memory (its memory cgroup) and each process's data (RLIMIT_DATA)
    tmp_bytes_max: int = 256 * 1024**2  # the size of a command's private /tmp (under bubblewrap)
    tools: tuple[str, ...] = ()
    browse_private: bool = False  # Browse runs in the daemon: only public addresses, unless this says otherwise
    max_tokens: int | None = None
    token_param: TokenParam | None = None  # the limit's name in a request (None: by the server, `token_param()`)
    continuations_max: int = 2  # a reply cut at the token limit: times the model is asked to go on
    context_tokens: int | None = None  # the model's window (None: known by its name, `devd.agent.context.window`)
    compact_at: float = 0.8  # a request past this share of the window compacts the conversation first
    models: tuple[str, ...] = ()  # the models a session may switch between (`session/model`), `model` the default
    send_reasoning: bool = False  # whether the model's streamed reasoning goes back to it in later requests
    max_calls_per_reply: int = 100  # tool calls of one model reply carried out; the rest are answered refused
    budget: Budget | None = None
    reply_bytes_max: int = 8 * 1024 * 1024  # a model reply's body (a line of it too) is dropped past this
    model_timeout_s: float = 600.0  # an attempt of a model call is given up past this, however it trickles
    mcp: tuple[McpServer, ...] = ()  # the MCP servers its sessions may call (devd.agent.mcp)
    session_mcp: bool = False  # whether a session may bring servers of its own (session/new mcp_servers)
    instructions: tuple[str, ...] = ("AGENTS.md",)  # project instruction files' names (devd.agent.instructions)
    delegates: tuple[
        str, ...
    ] = ()  # the agents its sessions may delegate to (the `delegate` tool, devd.agent.children)
    max_depth: int = 2  # how deep a tree of delegated runs may grow under it (its root is depth 0)
    max_children: int | None = None  # delegated runs of one session running at once (None: no limit)
    max_children_per_turn: int | None = None  # delegated runs one turn of a session may start (None: no limit)
    # Not a key of the agents file: the effective profile of the session that delegated to this one, when this is a
    # child's (devd.agent.children): every decision is the stricter of the two, and so on up the tree.
    ceiling: Profile | None = None
    # Not a key of the agents file: the project instructions read for one model call, set by the runner on the
    # profile it asks with, and sent as a system message after `system` (devd.agent.model.request_body).
    project: str | None = None


# -- loading ------------------------------------------------------------------------------------------------------

# The type of each key as a user reads it, for messages.
_FIELDS: dict[str, tuple[Any, str]] = {
    "base_url": (str, "a string, an http:// or https:// URL"),
    "model": (str, "a string"),
    "workspace_roots": (list[str], "a list of absolute directory paths"),
    "api_key_env": (str, "a string, the name of an environment variable"),
    "system": (str, "a string"),
    "exec": (Decision, 'one of "allow", "deny", "ask"'),
    "write": (Decision, 'one of "allow", "deny", "ask"'),
    "rules": (list[dict[str, Any]], 'a list of tables like { prefix = ["rm"], decision = "deny" }'),
    "sandbox": (SandboxMode, 'one of "auto", "bwrap", "none"'),
    "network": (bool, "true or false"),
    "exec_timeout_s": (float, "a number of seconds"),
    "output_bytes_max": (int, "an integer number of bytes"),
    "run_as": (str | int, "a user name or a uid, not root"),
    "processes_max": (int, "an integer number of processes"),
    "memory_bytes_max": (int, "an integer number of bytes"),
    "tmp_bytes_max": (int, "an integer number of bytes"),
    "tools": (list[str], f"a list of tool names ({', '.join(repr(t) for t in EXTRA_TOOLS)})"),
    "browse_private": (bool, "true or false"),
    "max_tokens": (int, "an integer"),
    "token_param": (TokenParam, 'one of "max_tokens", "max_completion_tokens"'),
    "continuations_max": (int, "an integer number of continuations, 0 or more"),
    "context_tokens": (int, "an integer number of tokens"),
    "compact_at": (float, "a share of the context window, above 0 and at most 1"),
    "models": (list[str], "a list of model names"),
    "send_reasoning": (bool, "true or false"),
    "max_calls_per_reply": (int, "an integer number of tool calls"),
    "reply_bytes_max": (int, "an integer number of bytes"),
    "model_timeout_s": (float, "a number of seconds"),
    "budget": (dict[str, Any], "a table with tokens_per_turn, tokens_per_session, tokens_per_day"),
    "mcp": (dict[str, Any], "a table of [agent.NAME.mcp.SERVER] tables"),
    "session_mcp": (bool, "true or false"),
    "instructions": (list[str], 'a list of file names, like ["AGENTS.md"]'),
    "delegates": (list[str], 'a list of agent names, like ["reviewer", "tester"]'),
    "max_depth": (int, "an integer depth, 0 or more (its own sessions are depth 0)"),
    "max_children": (int, "an integer number of delegated runs at once"),
    "max_children_per_turn": (int, "an integer number of delegated runs"),
}
_REQUIRED = ("base_url", "workspace_roots")  # and `model`, or `models`
INSTRUCTION_NAMES_MAX = 16  # file names in a profile's `instructions` (each is looked for in every directory)
_BUDGET_KEYS = ("tokens_per_turn", "tokens_per_session", "tokens_per_day")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def load_profiles(path: Path) -> dict[str, Profile]:
    """Every profile of the file, by name; ConfigError (`FILE:LINE: ...`) on the first thing wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{path}: cannot read the agents file ({why}); fix it or pass another --agents") from None
    return parse_profiles(text, str(path))


def parse_profiles(text: str, filename: str) -> dict[str, Profile]:
    """The profiles of an agents.toml given as text; `filename` names it in messages."""
    import tomllib  # here, not at the top: a daemon without an agents file, and `devd run`, never parse one

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{filename}:{_toml_line(e)}: not valid TOML: {_toml_why(e)}; fix the syntax") from None
    lines = _Lines(text, filename)
    for key in doc:
        if key != "agent":
            raise lines.error((key,), f"unknown key {key!r}; profiles go in [agent.NAME] tables")
    agents = doc.get("agent", {})
    if not isinstance(agents, dict):
        raise lines.error(("agent",), "agent must be a table of [agent.NAME] tables")
    profiles: dict[str, Profile] = {}
    for name, table in agents.items():
        if not isinstance(table, dict):
            raise lines.error(("agent", name), f"agent.{name} must be a table ([agent.{name}]) of its settings")
        profiles[name] = _profile(name, table, lines)
    for name, profile in profiles.items():
        for delegate in profile.delegates:
            if delegate not in profiles:
                raise lines.error(
                    ("agent", name, "delegates"),
                    f"agent.{name}.delegates names {delegate!r}, which is no agent of this file (the agents are "
                    f"{', '.join(sorted(profiles))}); add [agent.{delegate}] or remove it",
                )
    return profiles


def _profile(name: str, table: dict[str, Any], lines: _Lines) -> Profile:
    where = ("agent", name)
    for key in table:
        if key not in _FIELDS:
            raise lines.error(
                (*where, key),
                f"unknown key {key!r} in [agent.{name}]; remove it or fix its name (the keys are {', '.join(_FIELDS)})",
            )
    for key in _REQUIRED:
        if key not in table:
            raise lines.error(where, f"[agent.{name}] has no {key}; add {key} = {_FIELDS[key][1]}")
    if "model" not in table and not table.get("models"):
        raise lines.error(where, f"[agent.{name}] has no model; add model = {_FIELDS['model'][1]} (or models = [...])")
    values: dict[str, Any] = {}
    for key, value in table.items():
        values[key] = _field(name, key, value, lines)
    models = values.get("models", ())
    values.setdefault("model", models[0] if models else None)
    if models and values["model"] not in models:  # the default is one the session may switch back to
        values["models"] = (values["model"], *models)
    return Profile(name=name, **values)


def _field(name: str, key: str, value: Any, lines: _Lines) -> Any:
    where = ("agent", name, key)
    kind, expected = _FIELDS[key]
    if not _fits(value, kind):
        raise lines.error(where, f"agent.{name}.{key} is {_show(value)}; it must be {expected}")
    if key == "base_url":
        split = urlsplit(value)
        if split.scheme not in ("http", "https") or not split.netloc:
            raise lines.error(
                where, f"agent.{name}.base_url {shown_url(value)!r} is not an http:// or https:// URL; give one"
            )
        if "@" in split.netloc:
            # Not sent as Basic auth: a secret in the agents file would reach every message that names the server.
            raise lines.error(
                where,
                f"agent.{name}.base_url holds a user name or password (USER:PASSWORD@ before the host); remove it: "
                "devd keeps no secret in the agents file (the key goes in the variable api_key_env names)",
            )
        if split.query or split.fragment:
            # devd appends the endpoint's path (`/chat/completions`) to the base URL, which would land after a query.
            raise lines.error(
                where,
                f"agent.{name}.base_url {shown_url(value)!r} has a query or fragment (after ? or #), which the "
                "endpoint's path cannot follow; give the server's base URL alone (a key goes in the variable "
                "api_key_env names)",
            )
        return value.rstrip("/")
    if key == "workspace_roots":
        return tuple(_root(name, root, lines) for root in value)
    if key == "api_key_env" and not _ENV_NAME.fullmatch(value):
        raise lines.error(where, f"agent.{name}.api_key_env {value!r} is not an environment variable name")
    if key == "rules":
        return tuple(_rule(name, i, rule, lines) for i, rule in enumerate(value))
    if key == "tools":
        for tool in value:
            if tool not in EXTRA_TOOLS:
                raise lines.error(
                    where, f"agent.{name}.tools names {tool!r}; the tools to enable are: {', '.join(EXTRA_TOOLS)}"
                )
        return tuple(value)
    if key in ("exec_timeout_s", "model_timeout_s"):
        if not value > 0:
            raise lines.error(where, f"agent.{name}.{key} is {value}; it must be above 0")
        return float(value)
    if key == "compact_at" and not 0 < value <= 1:
        raise lines.error(where, f"agent.{name}.compact_at is {value}; it must be above 0 and at most 1 (0.8: 80%)")
    if key == "compact_at":
        return float(value)
    if key == "continuations_max" and value < 0:
        raise lines.error(where, f"agent.{name}.continuations_max is {value}; it must be 0 or more")
    if key == "context_tokens" and value < 256:
        raise lines.error(where, f"agent.{name}.context_tokens is {value}; a model's window is at least 256 tokens")
    if key == "models":
        if not value or len(set(value)) != len(value) or not all(value):
            raise lines.error(where, f"agent.{name}.models must be a non-empty list of distinct model names")
        return tuple(value)
    if key in ("output_bytes_max", "max_tokens", "reply_bytes_max") and value < 1:
        raise lines.error(where, f"agent.{name}.{key} is {value}; it must be at least 1")
    if key == "max_calls_per_reply" and value < 1:
        raise lines.error(where, f"agent.{name}.{key} is {value}; it must be at least 1 (a tool call per reply)")
    if key in ("processes_max", "memory_bytes_max", "tmp_bytes_max") and value < 1:
        raise lines.error(where, f"agent.{name}.{key} is {value}; it must be at least 1")
    if key == "run_as" and value in ("root", 0):
        raise lines.error(
            where, f"agent.{name}.run_as is {_show(value)}; commands never run as root: name an unprivileged user"
        )
    if key == "run_as" and isinstance(value, int) and value < 0:
        raise lines.error(where, f"agent.{name}.run_as is {value}; a uid is at least 1")
    if key == "budget":
        return _budget(name, value, lines)
    if key == "delegates":
        if len(set(value)) != len(value) or not all(value):
            raise lines.error(where, f"agent.{name}.delegates must be a list of distinct agent names")
        return tuple(value)
    if key == "max_depth" and value < 0:
        raise lines.error(where, f"agent.{name}.max_depth is {value}; it must be 0 or more (0: no delegated runs)")
    if key in ("max_children", "max_children_per_turn") and value < 1:
        raise lines.error(where, f"agent.{name}.{key} is {value}; it must be at least 1")
    if key == "mcp":
        return tuple(_mcp_server(name, server, table, lines) for server, table in value.items())
    if key == "instructions":
        for file in value:
            if not file or "/" in file or "\0" in file or file in (".", ".."):
                raise lines.error(
                    where, f"agent.{name}.instructions names {file!r}; give file names (AGENTS.md), not paths"
                )
        if len(value) > INSTRUCTION_NAMES_MAX:
            raise lines.error(where, f"agent.{name}.instructions names more than {INSTRUCTION_NAMES_MAX} files")
        return tuple(value)
    return value


def _root(name: str, root: str, lines: _Lines) -> str:
    where = ("agent", name, "workspace_roots")
    if not os.path.isabs(root):
        raise lines.error(where, f"workspace root {root!r} of agent.{name} is not absolute; give an absolute path")
    if not os.path.isdir(root):
        raise lines.error(where, f"workspace root {root} of agent.{name} is not an existing directory; create it")
    return os.path.normpath(root)


def _rule(name: str, index: int, rule: dict[str, Any], lines: _Lines) -> Rule:
    where = ("agent", name, "rules")
    label = f"agent.{name}.rules[{index}]"
    for key in rule:
        if key not in ("prefix", "decision"):
            raise lines.error(where, f"{label} has an unknown key {key!r}; a rule has prefix and decision")
    prefix, decision = rule.get("prefix"), rule.get("decision")
    if not _fits(prefix, list[str]) or not prefix:
        raise lines.error(where, f'{label}.prefix is {_show(prefix)}; it must be a non-empty list of strings: ["rm"]')
    if decision not in get_args(Decision):
        raise lines.error(where, f'{label}.decision is {_show(decision)}; it must be one of "allow", "deny", "ask"')
    return Rule(prefix=tuple(prefix), decision=cast(Decision, decision))


def _budget(name: str, table: dict[str, Any], lines: _Lines) -> Budget:
    for key, value in table.items():
        where = ("agent", name, "budget", key)
        if key not in _BUDGET_KEYS:
            raise lines.error(
                where, f"unknown key {key!r} in agent.{name}.budget; remove it or use one of {', '.join(_BUDGET_KEYS)}"
            )
        if not _fits(value, int) or value < 1:
            raise lines.error(where, f"agent.{name}.budget.{key} is {_show(value)}; it must be an integer above 0")
    return Budget(**table)


# The keys of an [agent.NAME.mcp.SERVER] table, with their type as a user reads it.
_MCP_FIELDS: dict[str, tuple[Any, str]] = {
    "command": (list[str], 'a non-empty list of strings: ["program", "arg", ...]'),
    "url": (str, "an http:// or https:// URL"),
    "env": (dict[str, str], "a table of the server's variable = the name of the daemon's: { TOKEN = \"GH_TOKEN\" }"),
    "headers": (dict[str, str], "a table of an HTTP header = the name of the daemon's variable holding its value"),
    "tools": (list[str], "a list of the server's tool names"),
    "decision": (Decision, 'one of "allow", "deny", "ask"'),
    "rules": (dict[str, str], 'a table of a tool\'s name = "allow", "deny" or "ask"'),
    "network": (bool, "true or false"),
    "share": (Share, 'one of "profile", "session"'),
    "idle_s": (float, "a number of seconds"),
    "start_timeout_s": (float, "a number of seconds"),
    "call_timeout_s": (float, "a number of seconds"),
    "tools_max": (int, "an integer number of tools"),
    "trust_read_only": (bool, "true or false"),
    "output_bytes_max": (int, "an integer number of bytes"),
    "protocol": (McpProtocol, 'one of "auto", "legacy"'),
}
# A server's name starts the model's name of each of its tools (SERVER__TOOL): letters, digits, - and single _, short
# enough to leave room for the tool's name within the model API's 64 characters.
SERVER_NAME = re.compile(r"[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*")
SERVER_NAME_CHARS_MAX = 32


def server_name_problem(name: str) -> str | None:
    """Why name cannot name an MCP server, or None."""
    if not SERVER_NAME.fullmatch(name) or len(name) > SERVER_NAME_CHARS_MAX:
        return (
            f"an MCP server's name is 1-{SERVER_NAME_CHARS_MAX} letters, digits, - and _ (never two _ in a row, nor "
            "one at either end): the model calls its tools SERVER__TOOL"
        )
    return None


def _mcp_server(agent: str, server: str, table: Any, lines: _Lines) -> McpServer:
    where = ("agent", agent, "mcp", server)
    label = f"agent.{agent}.mcp.{server}"
    if not isinstance(table, dict):
        raise lines.error(where, f"{label} must be a table ([{label}]) of the server's settings")
    why = server_name_problem(server)
    if why is not None:
        raise lines.error(where, f"{label}: {why}; rename it")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _MCP_FIELDS:
            raise lines.error(
                (*where, key),
                f"unknown key {key!r} in [{label}]; remove it or fix its name (the keys are {', '.join(_MCP_FIELDS)})",
            )
        kind, expected = _MCP_FIELDS[key]
        if not _fits(value, kind):
            raise lines.error((*where, key), f"{label}.{key} is {_show(value)}; it must be {expected}")
        values[key] = _mcp_field(label, key, value, lines, (*where, key))
    if ("command" in values) == ("url" in values):
        raise lines.error(
            where, f'[{label}] needs either command = ["program", ...] (a stdio server) or url = "https://..." (HTTP)'
        )
    if "url" in values and values.get("env"):
        raise lines.error((*where, "env"), f"{label}.env is for a stdio server's process; an HTTP server has headers")
    if "command" in values and values.get("headers"):
        raise lines.error((*where, "headers"), f"{label}.headers is for an HTTP server; a stdio server has env")
    return McpServer(name=server, **values)


def _mcp_field(label: str, key: str, value: Any, lines: _Lines, where: tuple[str, ...]) -> Any:
    if key == "command":
        if not value or not value[0]:
            raise lines.error(where, f'{label}.command is empty; give the program and its arguments: ["program", ...]')
        return tuple(value)
    if key == "url":
        split = urlsplit(value)
        if split.scheme not in ("http", "https") or not split.netloc or "@" in split.netloc:
            raise lines.error(
                where, f"{label}.url {shown_url(value)!r} is not an http:// or https:// URL without a user or password"
            )
        return value
    if key in ("env", "headers"):
        for variable, holder in value.items():
            if key == "env" and not _ENV_NAME.fullmatch(variable):
                raise lines.error(where, f"{label}.env names {variable!r}, which is not an environment variable name")
            if not _ENV_NAME.fullmatch(holder):
                raise lines.error(
                    where,
                    f"{label}.{key}.{variable} is not a variable name (it is not shown: it may be a secret); it must "
                    "be the name of the daemon's environment variable holding the value, never the value itself",
                )
        return tuple(value.items())
    if key == "tools":
        return tuple(value)
    if key == "rules":
        for tool, decision in value.items():
            if decision not in get_args(Decision):
                raise lines.error(
                    where, f'{label}.rules.{tool} is {_show(decision)}; it must be one of "allow", "deny", "ask"'
                )
        return tuple(value.items())
    if key in ("idle_s", "start_timeout_s", "call_timeout_s"):
        if not value > 0:
            raise lines.error(where, f"{label}.{key} is {value}; it must be above 0")
        return float(value)
    if key in ("tools_max", "output_bytes_max") and value < 1:
        raise lines.error(where, f"{label}.{key} is {value}; it must be at least 1")
    return value


def _fits(value: Any, kind: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:  # TOML integers are numbers of seconds too
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    try:
        msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError:
        return False
    return True


def _show(value: Any) -> str:
    if value is None:
        return "missing"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return str(value)


def _toml_line(e: tomllib.TOMLDecodeError) -> int:
    lineno = getattr(e, "lineno", None)  # Python 3.14 has it; before, it is only in the message
    if isinstance(lineno, int):
        return lineno
    m = re.search(r"at line (\d+)", str(e))
    return int(m.group(1)) if m else 1


def _toml_why(e: tomllib.TOMLDecodeError) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return re.sub(r"\s*\(at line \d+, column \d+\)|\s*\(at end of document\)", "", str(msg))


class _Lines:
    """Where a key or table is written: tomllib gives values, not lines, so the text is scanned for them."""

    # Compiled by `re` at the first file read (its cache keeps them), not as this module is imported.
    _HEADER = r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$"
    _KEY = r"^\s*((?:\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+)(?:\s*\.\s*(?:\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+))*)\s*="

    def __init__(self, text: str, filename: str) -> None:
        self.filename = filename
        self.entries: list[tuple[int, tuple[str, ...]]] = []  # (line, full dotted path) of each header and key
        table: tuple[str, ...] = ()
        for number, line in enumerate(text.splitlines(), start=1):
            if m := re.match(self._HEADER, line):
                table = _split_dotted(m.group(1))
                self.entries.append((number, table))
            elif m := re.match(self._KEY, line):
                self.entries.append((number, (*table, *_split_dotted(m.group(1)))))

    def line(self, path: tuple[str, ...]) -> int:
        """The first line naming `path`, else the nearest enclosing table's, else 1."""
        for length in range(len(path), 0, -1):
            for number, found in self.entries:
                if found[:length] == path[:length] and len(found) >= length:
                    return number
        return 1

    def error(self, path: tuple[str, ...], why: str) -> ConfigError:
        return ConfigError(f"{self.filename}:{self.line(path)}: {why}")


def _split_dotted(key: str) -> tuple[str, ...]:
    parts = re.findall(r"\"([^\"]*)\"|'([^']*)'|([^.\s\"']+)", key)
    return tuple(next(p for p in part if p) if any(part) else "" for part in parts)


def default_agents_path(environ: Mapping[str, str]) -> Path | None:
    """agents.toml in systemd's configuration directory, else in `$XDG_CONFIG_HOME/devd` (`configuration_dirs`);
    None unless it exists."""
    path = configuration_dirs(environ)[0] / "agents.toml"
    return path if path.is_file() else None


# -- policy -------------------------------------------------------------------------------------------------------


def decide_command(profile: Profile, argv: list[str]) -> tuple[Decision, str]:
    """Whether the profile lets the command argv run (an Exec's, or a Git's as `git ...`), and why in words the model
    is shown (each kind decides its calls, `devd.agent.kinds`: this is how commands are). The rules whose prefix
    matches the command that runs in the end (seen through wrappers, `devd.agent.wrappers`) decide, and a deny or ask
    rule matching a wrapper of it too, the strictest winning (deny over ask over allow); a command no rule matches is
    decided by `exec`. A command that may run what its argv does not show (`sh -c` of more than one simple command,
    `python -c`, a program in the workspace, a program not known to be inert given an argument that names a program a
    deny or ask rule names) is asked about rather than allowed when the profile has a deny or ask rule, unless an
    allow rule matches that very command (a prefix of it when its program is what cannot be seen into,
    `wrappers.blind_by_itself`; else all of it)."""
    decision: Decision = profile.exec
    reason = f'agent {profile.name!r} has exec = "{profile.exec}"'
    stricter = [r for r in profile.rules if r.decision != "allow"]
    seen = wrappers.see(argv, watched(profile))
    last = len(seen.layers) - 1
    # An allow rule counts for the command that runs in the end only: one of a wrapper would allow what it wraps.
    matching = [
        (rule, at)
        for rule in profile.rules
        for at, layer in enumerate(seen.layers)
        if (at == last or rule.decision != "allow") and _matches(rule.prefix, layer)
    ]
    if matching:
        rule, at = max(matching, key=lambda m: _STRICTNESS[m[0].decision])
        decision = rule.decision
        reason = f"the rule prefix = {list(rule.prefix)} of agent {profile.name!r} says {rule.decision}"
        if at > 0:
            reason += f" (the command runs {shlex.join(seen.layers[at])})"
        # An allow rule lets a command it cannot see into run as it is only when it names what makes it so: the
        # program itself (["python3", "-m", "pytest"]), or the whole command; allowing git does not allow `git -c`.
        layer = seen.layers[at]
        names_it = wrappers.blind_by_itself(layer) or len(rule.prefix) == len(layer)
        allowed_as_is = decision == "allow" and at == seen.blind_at and names_it
    else:
        allowed_as_is = False
    if decision == "allow" and seen.blind is not None and stricter and not allowed_as_is:
        decision = "ask"
        reason = (
            f"{seen.blind}, and agent {profile.name!r} has rules that deny or ask (prefix = "
            f"{list(stricter[0].prefix)}) which what it runs could match: a person decides"
        )
    if decision == "deny":
        reason = f"denied by the policy: {reason}"
    return decision, reason


def watched(profile: Profile) -> frozenset[str]:
    """The programs the profile's deny and ask rules name: an argument naming one may be a command that a program
    runs (`ssh-agent rm x`), so `devd.agent.wrappers.see` is blind at it."""
    return frozenset(wrappers.program(r.prefix[0]) for r in profile.rules if r.decision != "allow")


def _matches(prefix: tuple[str, ...], argv: Sequence[str]) -> bool:
    """Whether argv starts with prefix; a bare command name also matches it run by path (["rm"] matches /bin/rm)."""
    if len(argv) < len(prefix) or not prefix:
        return False
    first = argv[0] if "/" in prefix[0] else os.path.basename(argv[0])
    return first == prefix[0] and tuple(argv[1 : len(prefix)]) == prefix[1:]


def api_key(profile: Profile, environ: Mapping[str, str]) -> str | None:
    """The profile's API key, read now from the environment (None when it names none). ValueError, naming the
    variable and never its value, when the variable is unset or empty, or holds what an HTTP header cannot carry
    (whitespace, a control character, non-ASCII): sent, such a key fails in a way whose message holds it whole."""
    name = profile.api_key_env
    if name is None:
        return None
    key = environ.get(name)
    where = f"{name} (api_key_env of agent {profile.name!r})"
    if not key:
        state = "is not set" if key is None else "is empty"
        raise ValueError(
            f"the API key variable {where} {state} in the daemon's environment; set it where the daemon starts and "
            "restart the daemon, or remove api_key_env if the server needs no key"
        )
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        what = _KEY_CHARACTERS.get(bad, "a control character" if bad < "\x80" else "a character outside ASCII")
        hint = " (a file written with Windows line ends adds one)" if bad == "\r" else ""
        raise ValueError(
            f"the API key in {where} holds {what} (the key is not shown); a key is printable ASCII without spaces: "
            f"set the variable again without it{hint} and restart the daemon"
        )
    return key


_KEY_CHARACTERS = {"\r": "a carriage return (CR)", "\n": "a line feed (LF)", " ": "a space", "\t": "a tab"}


OPENAI_HOST = "api.openai.com"


def offered_models(profile: Profile) -> tuple[str, ...]:
    """The models a session of the profile may be set to: its `models`, else its one `model`."""
    return profile.models or (profile.model,)


def token_param(profile: Profile) -> TokenParam:
    """The name the request's token limit is sent under: the profile's `token_param`, else `max_completion_tokens`
    for OpenAI's own endpoint (its current models refuse `max_tokens`) and `max_tokens` for every other server
    (llama.cpp, vLLM, LiteLLM and older servers know only that one)."""
    if profile.token_param is not None:
        return profile.token_param
    host = urlsplit(profile.base_url).hostname or ""
    return "max_completion_tokens" if host == OPENAI_HOST else "max_tokens"


HIDDEN = "***"  # what a URL shows in place of a value that may be a secret


def shown_url(url: str) -> str:
    """url as it may be shown (to a model, in a status, in the log): without a user name or password
    (`user:password@`), and with the values of its query hidden (a server's key is often given as `?token=`), its
    names kept."""
    split = urlsplit(url)
    if "@" not in split.netloc and not split.query:
        return url
    query = "&".join(_shown_part(part) for part in split.query.split("&") if part)
    return split._replace(netloc=split.netloc.rpartition("@")[2], query=query).geturl()


def _shown_part(part: str) -> str:
    """One `NAME=VALUE` of a query with its value hidden; a part without `=` is a value (`?KEY`), hidden whole."""
    name, is_named, _ = part.partition("=")
    return f"{name}={HIDDEN}" if is_named else HIDDEN


def without_url(text: str, url: str) -> str:
    """text with url, wherever it is written in it whole (as an HTTP client's error names it), as `shown_url`
    shows it; and the values of url's query hidden wherever they follow their name (`?token=`, `&token=`): an HTTP
    client writes a URL in its own form (httpx: the host in lower case, the scheme's own port left out), which the
    URL as configured does not match."""
    shown = shown_url(url)
    if shown == url:
        return text
    text = text.replace(url, shown)
    for part in {part for part in urlsplit(url).query.split("&") if part}:
        name, is_named, _ = part.partition("=")
        if is_named:
            text = re.sub(rf"([?&]{re.escape(name)}=)[^&#\s'\"]*", lambda m: m.group(1) + HIDDEN, text)
        else:  # a bare value: hidden where it stands as a part of a query
            text = re.sub(rf"([?&]){re.escape(part)}(?=[&#\s'\"]|$)", lambda m: m.group(1) + HIDDEN, text)
    return text


def check_workspace(profile: Profile, workspace: str) -> Path:
    """The workspace's real path; InvalidParamsError unless it is an absolute, existing directory inside a root."""
    if not os.path.isabs(workspace):
        raise InvalidParamsError(f"workspace {workspace!r} is not an absolute path; give the directory's full path")
    if not os.path.isdir(workspace):
        raise InvalidParamsError(f"workspace {workspace} is not an existing directory; create it or give another")
    real = Path(os.path.realpath(workspace))
    for root in profile.workspace_roots:
        real_root = Path(os.path.realpath(root))
        if real == real_root or real.is_relative_to(real_root):
            return real
    roots = ", ".join(profile.workspace_roots)
    shown = workspace if str(real) == workspace else f"{workspace} (really {real})"
    raise InvalidParamsError(
        f"workspace {shown} is not inside a workspace root of agent {profile.name!r} ({roots}); "
        "use a directory inside one, or add a root to the agent's workspace_roots"
    )


# -- a child's profile, held to its parent's (devd.agent.children) -------------------------------------------------


def stricter(own: tuple[Decision, str], ceiling: tuple[Decision, str]) -> tuple[Decision, str]:
    """Of two decisions on one call (a child's own and its parent's), the stricter: deny over ask over allow; the
    parent's, saying so, when it is stricter."""
    if _STRICTNESS[ceiling[0]] > _STRICTNESS[own[0]]:
        return ceiling[0], f"{ceiling[1]} (a delegated run is held to the session that delegated it)"
    return own


_SANDBOX_STRICTNESS: dict[str, int] = {"none": 0, "auto": 1, "bwrap": 2}


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def narrow(profile: Profile, ceiling: Profile) -> Profile:
    """The profile a child session of `profile` runs with under its parent's effective profile `ceiling`: never wider.
    Each call's decision is the stricter of the two (`ceiling`, read by `devd.agent.kinds.decide`), the network only
    if both allow it, the stricter sandbox, the lesser of every bound, and the limits on delegation the strictest
    along the chain."""
    sandbox = max(profile.sandbox, ceiling.sandbox, key=lambda s: _SANDBOX_STRICTNESS[s])
    return msgspec.structs.replace(
        profile,
        ceiling=ceiling,
        network=profile.network and ceiling.network,
        sandbox=sandbox,
        browse_private=profile.browse_private and ceiling.browse_private,
        exec_timeout_s=min(profile.exec_timeout_s, ceiling.exec_timeout_s),
        output_bytes_max=min(profile.output_bytes_max, ceiling.output_bytes_max),
        processes_max=min(profile.processes_max, ceiling.processes_max),
        memory_bytes_max=min(profile.memory_bytes_max, ceiling.memory_bytes_max),
        tmp_bytes_max=min(profile.tmp_bytes_max, ceiling.tmp_bytes_max),
        max_depth=min(profile.max_depth, ceiling.max_depth),
        max_children=_least(profile.max_children, ceiling.max_children),
        max_children_per_turn=_least(profile.max_children_per_turn, ceiling.max_children_per_turn),
    )
