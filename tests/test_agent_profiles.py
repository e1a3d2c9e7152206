"""Agent profiles: agents.toml parsed whole, each mistake named by file and line, the default path, the policy."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import msgspec
import pytest

from devd.agent.kinds import decide
from devd.agent.profiles import (
    Budget,
    McpServer,
    Profile,
    Rule,
    api_key,
    check_workspace,
    default_agents_path,
    load_profiles,
    parse_profiles,
    shown_url,
    without_url,
)
from devd.errors import ConfigError, InvalidParamsError
from devd.messages import Browse, Call, Exec, Git, Read, Write


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "agents.toml"
    path.write_text(body.replace("ROOT", str(tmp_path)))
    return path


GOOD = """\
# my agents
[agent.coder]
base_url = "http://127.0.0.1:11434/v1/"
model = "qwen2.5-coder"
api_key_env = "OPENAI_API_KEY"
system = "You are a careful coding agent."
workspace_roots = ["ROOT"]
exec = "allow"
write = "ask"
rules = [ { prefix = ["rm"], decision = "deny" }, { prefix = ["git", "push"], decision = "ask" } ]
sandbox = "bwrap"
network = true
exec_timeout_s = 30
output_bytes_max = 4096
tools = ["browse"]
browse_private = true
max_tokens = 2000

[agent.coder.budget]
tokens_per_turn = 10000
tokens_per_day = 1000000

[agent.reader]
base_url = "https://api.example.test/v1"
model = "m"
workspace_roots = ["ROOT"]
"""


def error_of(tmp_path: Path, body: str) -> str:
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_profiles(path)
    return str(e.value).replace(str(path), "FILE")


def profile(tmp_path: Path, **fields: object) -> Profile:
    base: dict[str, object] = {
        "name": "p",
        "base_url": "http://h/v1",
        "model": "m",
        "workspace_roots": (str(tmp_path),),
    }
    return Profile(**(base | fields))  # type: ignore[arg-type]


def test_a_url_is_shown_without_its_user_password_or_query_values() -> None:
    shown = shown_url("https://me:pw@models.example:8443/v1/chat?api-version=2024&key=s3cret#frag")
    assert shown == "https://models.example:8443/v1/chat?api-version=***&key=***#frag"


def test_a_urls_query_values_are_hidden_in_an_error_that_names_it_as_the_http_client_writes_it() -> None:
    # httpx writes the host in lower case and leaves out the scheme's own port: the URL as configured is not in it.
    url = "https://MCP.example.com:443?token=s3cret&v=2"
    said = f"Client error '401 Unauthorized' for url '{httpx.URL(url)}'"
    assert without_url(said, url) == "Client error '401 Unauthorized' for url 'https://mcp.example.com?token=***&v=***'"


def test_a_query_part_without_a_name_is_hidden_whole() -> None:
    # `?KEY` (a bare value, as some services take their key): it is the value, not a name to keep.
    url = "https://MCP.example.com/sse?s3cretToken&v=2"
    said = f"Client error '401 Unauthorized' for url '{httpx.URL(url)}'"
    assert (shown_url(url), without_url(said, url)) == (
        "https://MCP.example.com/sse?***&v=***",
        "Client error '401 Unauthorized' for url 'https://mcp.example.com/sse?***&v=***'",
    )


def test_a_good_file_gives_every_setting(tmp_path: Path) -> None:
    profiles = load_profiles(write(tmp_path, GOOD))
    assert profiles["coder"] == Profile(
        name="coder",
        base_url="http://127.0.0.1:11434/v1",
        model="qwen2.5-coder",
        api_key_env="OPENAI_API_KEY",
        system="You are a careful coding agent.",
        workspace_roots=(str(tmp_path),),
        exec="allow",
        write="ask",
        rules=(Rule(prefix=("rm",), decision="deny"), Rule(prefix=("git", "push"), decision="ask")),
        sandbox="bwrap",
        network=True,
        exec_timeout_s=30.0,
        output_bytes_max=4096,
        tools=("browse",),
        browse_private=True,
        max_tokens=2000,
        budget=Budget(tokens_per_turn=10000, tokens_per_day=1000000),
    )


def test_omitted_settings_take_their_defaults(tmp_path: Path) -> None:
    reader = load_profiles(write(tmp_path, GOOD))["reader"]
    assert (reader.exec, reader.write, reader.sandbox, reader.network, reader.exec_timeout_s) == (
        "allow",
        "allow",
        "auto",
        False,
        120.0,
    )


BAD = [
    ("[agent.a]\nmodel = \n", "FILE:2: not valid TOML: Invalid value; fix the syntax"),
    (
        '[agent.a]\nbase_url = "https://me:hunter22@h/v1"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n',
        "FILE:2: agent.a.base_url holds a user name or password (USER:PASSWORD@ before the host); remove it: devd "
        "keeps no secret in the agents file (the key goes in the variable api_key_env names)",
    ),
    (
        '[agent.a]\nbase_url = "https://h/v1?key=s3cret"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n',
        "FILE:2: agent.a.base_url 'https://h/v1?key=***' has a query or fragment (after ? or #), which the endpoint's "
        "path cannot follow; give the server's base URL alone (a key goes in the variable api_key_env names)",
    ),
    (
        '[agent.a]\nbase_url = "ftp://me:hunter22@h/v1"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n',
        "FILE:2: agent.a.base_url 'ftp://h/v1' is not an http:// or https:// URL; give one",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\ncolour = "red"\n',
        "FILE:5: unknown key 'colour' in [agent.a]; remove it or fix its name (the keys are base_url, model, "
        "workspace_roots, api_key_env, system, exec, write, rules, sandbox, network, exec_timeout_s, output_bytes_max, "
        "run_as, processes_max, memory_bytes_max, tmp_bytes_max, tools, browse_private, max_tokens, token_param, "
        "continuations_max, context_tokens, compact_at, models, send_reasoning, max_calls_per_reply, "
        "reply_bytes_max, model_timeout_s, budget, mcp, session_mcp, instructions, delegates, max_depth, max_children, "
        "max_children_per_turn)",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\nrun_as = "root"\n',
        'FILE:5: agent.a.run_as is "root"; commands never run as root: name an unprivileged user',
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\nprocesses_max = 0\n',
        "FILE:5: agent.a.processes_max is 0; it must be at least 1",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = 7\nworkspace_roots = ["ROOT"]\n',
        "FILE:3: agent.a.model is 7; it must be a string",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\nexec = "maybe"\n',
        'FILE:5: agent.a.exec is "maybe"; it must be one of "allow", "deny", "ask"',
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\nnetwork = "yes"\n',
        'FILE:5: agent.a.network is "yes"; it must be true or false',
    ),
    (
        '[agent.a]\nbase_url = "ftp://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n',
        "FILE:2: agent.a.base_url 'ftp://h' is not an http:// or https:// URL; give one",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["src"]\n',
        "FILE:4: workspace root 'src' of agent.a is not absolute; give an absolute path",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT/none"]\n',
        "FILE:4: workspace root ROOT/none of agent.a is not an existing directory; create it",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\n',
        "FILE:1: [agent.a] has no workspace_roots; add workspace_roots = a list of absolute directory paths",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n'
        'rules = [{ prefix = ["rm"], decision = "never" }]\n',
        'FILE:5: agent.a.rules[0].decision is "never"; it must be one of "allow", "deny", "ask"',
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\ntools = ["shell"]\n',
        "FILE:5: agent.a.tools names 'shell'; the tools to enable are: browse",
    ),
    (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n\n[agent.a.budget]\n'
        "tokens_per_week = 5\n",
        "FILE:7: unknown key 'tokens_per_week' in agent.a.budget; remove it or use one of tokens_per_turn, "
        "tokens_per_session, tokens_per_day",
    ),
    ('[agents.a]\nmodel = "m"\n', "FILE:1: unknown key 'agents'; profiles go in [agent.NAME] tables"),
]

A = '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n\n'
BAD_MCP = [
    (
        A + '[agent.a.mcp.git__hub]\ncommand = ["gh"]\n',
        "FILE:6: agent.a.mcp.git__hub: an MCP server's name is 1-32 letters, digits, - and _ (never two _ in a row, "
        "nor one at either end): the model calls its tools SERVER__TOOL; rename it",
    ),
    (
        A + "[agent.a.mcp.gh]\ntools_max = 5\n",
        'FILE:6: [agent.a.mcp.gh] needs either command = ["program", ...] (a stdio server) or url = "https://..." '
        "(HTTP)",
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\nurl = "https://h/mcp"\n',
        'FILE:6: [agent.a.mcp.gh] needs either command = ["program", ...] (a stdio server) or url = "https://..." '
        "(HTTP)",
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\nenv = { GITHUB_TOKEN = "ghp_abc def" }\n',
        "FILE:8: agent.a.mcp.gh.env.GITHUB_TOKEN is not a variable name (it is not shown: it may be a secret); it "
        "must be the name of the daemon's environment variable holding the value, never the value itself",
    ),
    (
        A + '[agent.a.mcp.gh]\nurl = "https://me:pw@h/mcp"\n',
        "FILE:7: agent.a.mcp.gh.url 'https://h/mcp' is not an http:// or https:// URL without a user or password",
    ),
    (
        A + "[agent.a.mcp.gh]\ncommand = []\n",
        'FILE:7: agent.a.mcp.gh.command is empty; give the program and its arguments: ["program", ...]',
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\nshare = "everyone"\n',
        'FILE:8: agent.a.mcp.gh.share is "everyone"; it must be one of "profile", "session"',
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\nprotocol = "2026-07-28"\n',
        'FILE:8: agent.a.mcp.gh.protocol is "2026-07-28"; it must be one of "auto", "legacy"',
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\nrules = { get_issue = "yes" }\n',
        'FILE:8: agent.a.mcp.gh.rules.get_issue is "yes"; it must be one of "allow", "deny", "ask"',
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\nstart_timeout_s = 0\n',
        "FILE:8: agent.a.mcp.gh.start_timeout_s is 0; it must be above 0",
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\ntimeout = 5\n',
        "FILE:8: unknown key 'timeout' in [agent.a.mcp.gh]; remove it or fix its name (the keys are command, url, "
        "env, headers, tools, decision, rules, network, share, idle_s, start_timeout_s, call_timeout_s, "
        "tools_max, trust_read_only, output_bytes_max, protocol)",
    ),
    (
        A + '[agent.a.mcp.gh]\ncommand = ["gh"]\noutput_bytes_max = 0\n',
        "FILE:8: agent.a.mcp.gh.output_bytes_max is 0; it must be at least 1",
    ),
    (
        A + '[agent.a.mcp.gh]\nurl = "https://h/mcp"\nenv = { A = "B" }\n',
        "FILE:8: agent.a.mcp.gh.env is for a stdio server's process; an HTTP server has headers",
    ),
]


@pytest.mark.parametrize(("body", "message"), BAD_MCP)
def test_a_bad_mcp_server_is_refused_with_its_line_and_what_to_do(tmp_path: Path, body: str, message: str) -> None:
    assert error_of(tmp_path, body) == message.replace("ROOT", str(tmp_path))


def test_an_mcp_server_keeps_every_setting_and_the_names_of_variables_only(tmp_path: Path) -> None:
    body = (
        A + "session_mcp = true\n\n[agent.a.mcp.github]\n"
        'command = ["github-mcp-server", "stdio"]\nenv = { GITHUB_TOKEN = "GITHUB_TOKEN" }\n'
        'tools = ["search_issues", "get_issue"]\ndecision = "deny"\nrules = { get_issue = "allow" }\n'
        'network = true\nshare = "session"\nidle_s = 30\n\n[agent.a.mcp.docs]\nurl = "https://h/mcp"\n'
        'headers = { Authorization = "DOCS_AUTH" }\n'
    )
    profile = load_profiles(write(tmp_path, body))["a"]
    assert (profile.session_mcp, profile.mcp) == (
        True,
        (
            McpServer(
                name="github",
                command=("github-mcp-server", "stdio"),
                env=(("GITHUB_TOKEN", "GITHUB_TOKEN"),),
                tools=("search_issues", "get_issue"),
                decision="deny",
                rules=(("get_issue", "allow"),),
                network=True,
                share="session",
                idle_s=30.0,
            ),
            McpServer(name="docs", url="https://h/mcp", headers=(("Authorization", "DOCS_AUTH"),)),
        ),
    )


@pytest.mark.parametrize(("body", "message"), BAD)
def test_a_bad_file_is_refused_with_its_line_and_what_to_do(tmp_path: Path, body: str, message: str) -> None:
    assert error_of(tmp_path, body) == message.replace("ROOT", str(tmp_path))


def test_the_secret_is_never_in_a_profile(tmp_path: Path) -> None:
    p = load_profiles(write(tmp_path, GOOD))["coder"]
    environ = {"OPENAI_API_KEY": "sk-secret-123"}
    assert (api_key(p, environ), "sk-secret" in repr(p) + msgspec.json.encode(p).decode()) == ("sk-secret-123", False)


def test_the_default_path_is_systemds_configuration_directory(tmp_path: Path) -> None:
    (tmp_path / "agents.toml").write_text("")
    environ = {"CONFIGURATION_DIRECTORY": f"{tmp_path}:/etc/other", "XDG_CONFIG_HOME": "/nowhere"}
    assert default_agents_path(environ) == tmp_path / "agents.toml"


def test_the_default_path_is_in_xdg_config_home_else_home(tmp_path: Path) -> None:
    (tmp_path / ".config" / "devd").mkdir(parents=True)
    (tmp_path / ".config" / "devd" / "agents.toml").write_text("")
    assert default_agents_path({"HOME": str(tmp_path), "XDG_CONFIG_HOME": "relative"}) == (
        tmp_path / ".config" / "devd" / "agents.toml"
    )


def test_no_default_path_when_the_file_does_not_exist(tmp_path: Path) -> None:
    assert default_agents_path({"XDG_CONFIG_HOME": str(tmp_path)}) is None


def test_the_strictest_matching_rule_wins(tmp_path: Path) -> None:
    p = profile(tmp_path, rules=(Rule(prefix=("git",), decision="ask"), Rule(prefix=("git", "push"), decision="deny")))
    assert decide(p, Call(Git=Git(argv=["push", "origin"]))) == (
        "deny",
        "denied by the policy: the rule prefix = ['git', 'push'] of agent 'p' says deny",
    )


def test_a_matching_rule_decides_over_exec_so_an_allow_list_can_skip_asking(tmp_path: Path) -> None:
    p = profile(tmp_path, exec="ask", rules=(Rule(prefix=("ls",), decision="allow"),))
    assert [decide(p, Call(Exec=Exec(argv=argv)))[0] for argv in (["ls", "-l"], ["make"])] == ["allow", "ask"]


def test_a_write_the_profile_denies_is_said_to_be_denied_by_the_policy(tmp_path: Path) -> None:
    p = profile(tmp_path, write="deny")
    assert decide(p, Call(Write=Write(path="a", text="b"))) == (
        "deny",
        "denied by the policy: agent 'p' has write = \"deny\"",
    )


def test_a_rule_matches_a_command_run_by_its_path(tmp_path: Path) -> None:
    p = profile(tmp_path, rules=(Rule(prefix=("rm",), decision="deny"),))
    assert decide(p, Call(Exec=Exec(argv=["/bin/rm", "-rf", "/"])))[0] == "deny"


def test_a_prefix_longer_than_the_argv_does_not_match(tmp_path: Path) -> None:
    p = profile(tmp_path, rules=(Rule(prefix=("git", "push"), decision="deny"),))
    assert decide(p, Call(Exec=Exec(argv=["git"]))) == ("allow", "agent 'p' has exec = \"allow\"")


def test_write_follows_write_and_read_is_always_allowed(tmp_path: Path) -> None:
    p = profile(tmp_path, write="deny", exec="deny")
    decisions = [decide(p, Call(Write=Write(path="a", text=""))), decide(p, Call(Read=Read(path="a")))]
    assert [d for d, _ in decisions] == ["deny", "allow"]


def test_browse_is_denied_unless_listed(tmp_path: Path) -> None:
    call = Call(Browse=Browse(url="http://x"))
    assert [decide(profile(tmp_path), call)[0], decide(profile(tmp_path, tools=("browse",)), call)[0]] == [
        "deny",
        "allow",
    ]


def test_a_workspace_inside_a_root_is_its_real_path(tmp_path: Path) -> None:
    (tmp_path / "root" / "proj").mkdir(parents=True)
    os.symlink(tmp_path / "root" / "proj", tmp_path / "root" / "link")
    p = profile(tmp_path, workspace_roots=(str(tmp_path / "root"),))
    assert check_workspace(p, str(tmp_path / "root" / "link")) == tmp_path / "root" / "proj"


def test_a_workspace_linked_out_of_its_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "out")
    p = profile(tmp_path, workspace_roots=(str(tmp_path / "root"),))
    with pytest.raises(InvalidParamsError) as e:
        check_workspace(p, str(tmp_path / "root" / "out"))
    assert str(e.value) == (
        f"workspace {tmp_path}/root/out (really {tmp_path}/elsewhere) is not inside a workspace root of agent 'p' "
        f"({tmp_path}/root); use a directory inside one, or add a root to the agent's workspace_roots"
    )


def test_a_relative_workspace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidParamsError, match="is not an absolute path"):
        check_workspace(profile(tmp_path), "proj")


def test_a_missing_workspace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidParamsError, match="is not an existing directory"):
        check_workspace(profile(tmp_path), str(tmp_path / "none"))


def test_a_missing_file_is_refused_saying_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_profiles(tmp_path / "agents.toml")
    assert str(e.value) == (
        f"{tmp_path}/agents.toml: cannot read the agents file (No such file or directory); "
        "fix it or pass another --agents"
    )


def test_a_rule_in_an_array_of_tables_is_found_by_its_header(tmp_path: Path) -> None:
    body = (
        '[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["ROOT"]\n\n[[agent.a.rules]]\nprefix = []\n'
    )
    assert error_of(tmp_path, body) == (
        'FILE:6: agent.a.rules[0].prefix is an empty list; it must be a non-empty list of strings: ["rm"]'
    )


# -- rules seen through wrappers ------------------------------------------------------------------------------------

DENY_RM = (Rule(prefix=("rm",), decision="deny"),)


@pytest.mark.parametrize(
    ("argv", "decision"),
    [
        (["rm", "x"], "deny"),
        (["/bin/rm", "x"], "deny"),
        (["/usr/bin/rm", "x"], "deny"),
        (["./rm", "x"], "deny"),
        (["env", "rm", "x"], "deny"),
        (["env", "-i", "--", "rm", "x"], "deny"),
        (["env", "-u", "HOME", "rm", "x"], "deny"),
        (["env", "A=1", "rm", "x"], "deny"),
        (["sh", "-c", "rm -rf src"], "deny"),
        (["bash", "-ec", "'rm' -rf src"], "deny"),
        (["nice", "rm", "x"], "deny"),
        (["nice", "-n", "5", "rm", "x"], "deny"),
        (["nice", "-10", "rm", "x"], "deny"),
        (["timeout", "5", "rm", "x"], "deny"),
        (["timeout", "-s", "KILL", "--kill-after=1", "5", "rm", "x"], "deny"),
        (["xargs", "rm"], "deny"),
        (["xargs", "-0", "-I{}", "rm", "{}"], "deny"),
        (["command", "rm", "x"], "deny"),
        (["exec", "-a", "ls", "rm", "x"], "deny"),
        (["nohup", "rm", "x"], "deny"),
        (["stdbuf", "-oL", "rm", "x"], "deny"),
        (["ionice", "-c", "3", "rm", "x"], "deny"),
        (["setsid", "-f", "rm", "x"], "deny"),
        (["busybox", "rm", "x"], "deny"),
        (["nice", "timeout", "5", "env", "busybox", "rm", "x"], "deny"),
        (["sh", "-c", "exec nice rm x"], "deny"),
        (["rm\0", "x"], "deny"),
        (["ls", "x\0-rf"], "deny"),
        (["ls", "-l"], "allow"),
        (["env", "ls"], "allow"),
        (["sh", "-c", "ls -l"], "allow"),
        (["timeout", "5", "make", "test"], "allow"),
        (["xargs"], "allow"),
        (["sh", "-c", "ls; rm x"], "ask"),
        (["sh", "-c", "$(echo rm) x"], "ask"),
        (["sh", "script.sh"], "ask"),
        (["sh", "-c", "A=1 ls"], "ask"),
        (["env", "LD_PRELOAD=./evil.so", "ls"], "ask"),
        (["env", "-S", "rm x"], "ask"),
        (["timeout", "--bogus", "5", "ls"], "ask"),
        (["python3", "-c", "import os; os.remove('x')"], "ask"),
        (["python3.12", "script.py"], "ask"),
        (["perl", "-e", "unlink 'x'"], "ask"),
        (["node", "-e", "x"], "ask"),
        (["./myrm", "x"], "ask"),
        (["/tmp/copy", "x"], "ask"),
        (["sh", "-c", "trap 'rm x' EXIT"], "ask"),
        (["sudo", "ls"], "ask"),
        (["ksh93", "-c", "rm x"], "deny"),
        (["python3.12-dbg", "x.py"], "ask"),
        (["find", ".", "-name", "*.o", "-exec", "rm", "{}", ";"], "deny"),
        (["find", ".", "-exec", "ls", "{}", ";", "-exec", "touch", "{}", "+"], "ask"),
        (["find", ".", "-name", "*.o"], "allow"),
        (["git", "-c", "alias.x=!rm -rf src", "x"], "ask"),
        (["git", "-C", "sub", "-c", "core.pager=rm", "log"], "ask"),
        (["git", "-C", "sub", "status"], "allow"),
        (["zsh", "-c", "ls"], "ask"),
        (["bash", "-lc", "ls"], "ask"),
        (["bash", "--login", "-c", "rm x"], "deny"),
        (["bash", "-o", "pipefail", "-c", "ls"], "allow"),
    ],
)
def test_a_deny_rule_sees_through_wrappers_and_asks_where_it_cannot_see(
    tmp_path: Path, argv: list[str], decision: str
) -> None:
    assert decide(profile(tmp_path, rules=DENY_RM), Call(Exec=Exec(argv=argv)))[0] == decision


DENY_RM_AND_PUSH = (*DENY_RM, Rule(prefix=("git", "push"), decision="deny"))


@pytest.mark.parametrize(
    ("argv", "decision"),
    [
        # runners that take the command as later words: asked about, as they cannot be seen into
        *(
            ([*runner, "rm", "-rf", "src"], "ask")
            for runner in (
                ["setpriv"],
                ["setpriv", "--reuid=65534"],
                ["runcon", "-t", "x"],
                ["setarch", "x86_64"],
                ["linux64"],
                ["linux32"],
                ["x86_64"],
                ["i386"],
                ["i686"],
                ["aarch64"],
                ["logsave", "/dev/null"],
                ["ssh-agent"],
                ["dbus-run-session", "--"],
                ["ld.so"],
                ["ld-linux-x86-64.so.2"],
                ["/lib64/ld-linux-x86-64.so.2"],
                ["chroot", "/"],
                ["unshare", "-r"],
                ["nsenter", "-t", "1"],
                ["flock", "lock"],
                ["taskset", "1"],
                ["chrt", "-o", "0"],
                ["prlimit", "--nofile=10"],
                ["doas"],
                ["pkexec"],
                ["firejail"],
                ["bwrap", "--bind", "/", "/"],
                ["systemd-run"],
                ["strace"],
                ["ltrace"],
                ["gdb", "--args"],
                ["valgrind"],
                ["perf", "stat"],
                ["systemd-inhibit"],
                ["caffeinate"],
                ["eatmydata"],
                ["unknown-runner"],
                ["unknown-runner", "--opt"],
            )
        ),
        (["/usr/bin/time", "rm", "x"], "deny"),
        (["time", "-p", "rm", "x"], "deny"),
        (["script", "-c", "rm -rf src"], "ask"),
        (["su", "-c", "rm -rf src"], "ask"),
        (["sg", "root", "-c", "rm -rf src"], "ask"),
        (["watch", "date", "; rm -rf src"], "ask"),
        (["parallel", "rm", ":::", "x"], "ask"),
        (["unknown-runner", "sh", "-c", "ls"], "ask"),
        (["unknown-runner", "--cmd=rm x"], "ask"),
        (["unknown-runner", "ls; ls"], "ask"),
        (["unknown-runner", "python3"], "ask"),
        # shells: their options read, rbash is a shell, a script that is not one simple command is blind
        (["rbash", "-c", "rm -rf src"], "deny"),
        (["bash", "-oc", "posix", "rm -rf src"], "deny"),
        (["bash", "-co", "posix", "rm -rf src"], "deny"),
        (["bash", "-Oc", "extglob", "rm -rf src"], "deny"),
        (["bash", "-o", "posix", "-o", "errexit", "-c", "rm x"], "deny"),
        (["bash", "-oc", "posix", "ls"], "allow"),
        (["bash", "-Zc", "ls"], "ask"),
        (["bash", "--frobnicate", "-c", "ls"], "ask"),
        (["sh", "-c", "rm *.o"], "deny"),
        (["sh", "-c", "ls *.o"], "allow"),
        (["sh", "-c", "r? x"], "ask"),
        (["sh", "-c", "timeout 5 /usr/bin/r[m] x"], "ask"),
        (["sh", "-c", "env /usr/bin/r* x"], "ask"),
        (["bash", "-c", "coproc rm -rf src"], "ask"),
        (["bash", "-c", "coproc ls"], "ask"),
        (["bash", "-c", "eval rm x"], "ask"),
        (["bash", "-c", "exec rm x"], "deny"),
        (["bash", "-c", "source ./x"], "ask"),
        (["bash", "-c", ". ./x"], "ask"),
        (["bash", "-c", "f() { rm x; }; f"], "ask"),
        (["bash", "-c", "time rm x"], "ask"),
        (["bash", "-c", "! rm x"], "ask"),
        (["bash", "-c", "ls $(echo x)"], "ask"),
        (["bash", "-c", "ls `echo x`"], "ask"),
        (["bash", "-c", "ls > >(rm x)"], "ask"),
        (["bash", "-c", "cat <<EOF\nx\nEOF"], "ask"),
        # xargs: its command gets words from its input
        (["xargs", "-a", "cmds", "-I", "X", "sh", "-c", "X"], "ask"),
        (["xargs", "-a", "prog", "-I", "X", "env", "X", "-rf", "src"], "ask"),
        (["xargs", "-I{}", "{}", "x"], "ask"),
        (["xargs", "ssh-agent"], "ask"),
        (["xargs", "make"], "ask"),
        (["xargs", "-I", "X", "rm", "X"], "deny"),
        (["xargs", "grep", "x"], "allow"),
        # find runs the found file as the program
        (["find", ".", "-exec", "{}", ";"], "ask"),
        (["find", ".", "-execdir", "rm", "{}", ";"], "deny"),
        (["find", ".", "-ok", "rm", "{}", ";"], "deny"),
        (["find", ".", "-okdir", "sh", "-c", "rm x", ";"], "deny"),
        # git's own options skipped; what git runs besides its argv is blind
        (["git", "-C", ".", "push"], "deny"),
        (["git", "--no-pager", "push"], "deny"),
        (["git", "-P", "push"], "deny"),
        (["git", "-Csub", "push", "origin"], "deny"),
        (["git", "--git-dir=.git", "--work-tree", ".", "push"], "deny"),
        (["git", "--bare", "--no-optional-locks", "push"], "deny"),
        (["git", "-C", ".", "status"], "allow"),
        (["git", "--frobnicate", "status"], "ask"),
        (["git", "-c", "core.sshCommand=rm -rf src", "fetch"], "ask"),
        (["git", "-ccore.pager=rm", "log"], "ask"),
        (["git", "--exec-path=.", "status"], "ask"),
        (["git", "rebase", "--exec", "rm -rf src", "HEAD~1"], "ask"),
        (["git", "rebase", "--exec=rm -rf src", "HEAD~1"], "ask"),
        (["git", "rebase", "-x", "rm -rf src", "HEAD~1"], "ask"),
        (["git", "rebase", "-ix", "rm -rf src", "HEAD~1"], "ask"),
        (["git", "bisect", "run", "rm", "-rf", "src"], "ask"),
        (["git", "submodule", "foreach", "rm -rf src"], "ask"),
        (["git", "difftool", "-y", "-x", "rm -rf src"], "ask"),
        (["git", "difftool", "--extcmd=rm -rf src"], "ask"),
        (["git", "mergetool"], "ask"),
        (["git", "filter-branch", "--tree-filter", "rm -rf src"], "ask"),
        (["git", "filter-branch", "--index-filter", "x"], "ask"),
        (["git", "fetch", "--upload-pack=rm -rf src", "origin"], "ask"),
        (["git", "clone", "-u", "rm -rf src", "x", "y"], "ask"),
        (["git", "ls-remote", "--upload-pack", "x", "origin"], "ask"),
        (["git", "push", "--receive-pack=x", "origin"], "deny"),
        (["git", "archive", "--exec=x", "--remote=y", "HEAD"], "ask"),
        (["git", "grep", "-O", "x"], "ask"),
        (["git", "config", "core.pager", "rm -rf src"], "ask"),
        (["git", "config", "alias.st", "!rm -rf src"], "ask"),
        (["git", "config", "user.name", "x"], "allow"),
        (["git", "commit", "-m", "fix; it"], "allow"),
        (["git", "rebase", "-i", "HEAD~2"], "allow"),
        # options that name a command
        (["tar", "--to-command=rm -rf src", "-xf", "a.tar"], "ask"),
        (["tar", "--to-command", "./x", "-xf", "a.tar"], "ask"),
        (["tar", "-I", "./x", "-xf", "a.tar"], "ask"),
        (["tar", "-xIf", "./x", "a.tar"], "ask"),
        (["tar", "xIf", "./x", "a.tar"], "ask"),
        (["tar", "--use-compress-program=./x", "-xf", "a.tar"], "ask"),
        (["tar", "--checkpoint-action=exec=./x", "-xf", "a.tar"], "ask"),
        (["tar", "-xzf", "a.tar.gz"], "allow"),
        (["rsync", "-e", "./x", "a", "b:c"], "ask"),
        (["rsync", "--rsh=./x", "a", "b:c"], "ask"),
        (["rsync", "-avze", "./x", "a", "b:c"], "ask"),
        (["rsync", "-av", "a/", "b/"], "allow"),
        (["man", "-P", "./x", "ls"], "ask"),
        (["man", "-H./x", "ls"], "ask"),
        (["vim", "-c", "!rm -rf src", "-c", "q"], "ask"),
        (["vi", "+!./x"], "ask"),
        (["nvim", "x"], "ask"),
        (["awk", 'BEGIN{system("./x")}'], "ask"),
        (["gawk", "-f", "x.awk"], "ask"),
        (["sed", "-n", "1e rm -rf src", "/etc/hostname"], "ask"),
        (["sed", "1e ./x", "f"], "ask"),
        (["sed", "s/a/./e", "f"], "ask"),
        (["sed", "-i", "-e", "s/a/./e", "f"], "ask"),
        (["sed", "-n", "s/a/b/p", "f"], "allow"),
        (["less", "+!./x", "f"], "ask"),
        (["more", "+!./x", "f"], "ask"),
        (["less", "f"], "allow"),
        (["env", "-S", "./x"], "ask"),
        (["env", "LESSOPEN=|./x %s", "less", "f"], "ask"),
        (["sort", "--compress-program=./x", "f"], "ask"),
        (["make", "--eval=x:;rm -rf src", "x"], "ask"),
        (["make", "SHELL=/bin/bash", "x"], "ask"),
        (["ssh", "-o", "ProxyCommand=./x", "h"], "ask"),
        (["ssh", "h", "rm", "-rf", "src"], "ask"),
        (["cc", "-wrapper", "./x", "a.c"], "ask"),
        (["unknown-tool", "--exec", "rm -rf src"], "ask"),
        # a long option by a prefix of its name (getopt_long's and git's abbreviations), and split --filter
        (["tar", "--to-com=./x", "-xf", "a.tar"], "ask"),
        (["sort", "--compress-prog=./x", "f"], "ask"),
        (["git", "rebase", "--exe", "./x", "HEAD~1"], "ask"),
        (["git", "clone", "-c", "core.sshCommand=./x", "ssh://h/r", "d"], "ask"),
        (["git", "clone", "--template=./t", "/w/r", "d"], "ask"),
        (["split", "--filter=./x", "f"], "ask"),
        (["socat", "-u", "SYSTEM:./x", "-"], "ask"),
        (["editor", "-c", "!./x", "f"], "ask"),
        (["run-parts", "./hooks"], "ask"),
        (["split", "-l", "10", "f"], "allow"),
        (["git", "clone", "-q", "/w/r", "d"], "allow"),
        # what stays allowed: programs whose arguments are data, and plain arguments
        (["ls", "rm"], "allow"),
        (["grep", "-E", "rm|sh", "f"], "allow"),
        (["echo", "a; rm x"], "allow"),
        (["make", "-C", ".", "test"], "allow"),
        (["pytest", "-q", "tests/"], "allow"),
        (["cargo", "build", "--release"], "allow"),
        (["curl", "-o", "f", "https://example.org/x"], "allow"),
        (["busybox", "rm", "x"], "deny"),
    ],
)
def test_every_known_bypass_of_a_deny_rule_is_denied_or_asked_and_plain_commands_stay_allowed(
    tmp_path: Path, argv: list[str], decision: str
) -> None:
    assert decide(profile(tmp_path, rules=DENY_RM_AND_PUSH), Call(Exec=Exec(argv=argv)))[0] == decision


def test_a_command_that_cannot_be_seen_into_is_allowed_when_no_rule_denies_or_asks(tmp_path: Path) -> None:
    p = profile(tmp_path, rules=(Rule(prefix=("ls",), decision="allow"),))
    assert decide(p, Call(Exec=Exec(argv=["python3", "-c", "print(1)"]))) == ("allow", "agent 'p' has exec = \"allow\"")


def test_an_allow_rule_for_that_very_command_allows_it_though_it_cannot_be_seen_into(tmp_path: Path) -> None:
    p = profile(tmp_path, rules=(*DENY_RM, Rule(prefix=("python3", "-m", "pytest"), decision="allow")))
    assert decide(p, Call(Exec=Exec(argv=["python3", "-m", "pytest", "-q"])))[0] == "allow"


@pytest.mark.parametrize(
    ("allowed", "argv", "decision"),
    [
        (["python3", "-m", "pytest"], ["python3", "-m", "pytest", "-q"], "allow"),
        (["./build.sh"], ["./build.sh", "all"], "allow"),
        (["git"], ["git", "-c", "alias.x=!rm -rf src", "x"], "ask"),
        (["git"], ["git", "rebase", "-x", "rm -rf src", "main"], "ask"),
        (["make"], ["make", "--eval=x:;rm -rf src", "x"], "ask"),
        (["tar"], ["tar", "--to-command=./x", "-xf", "a.tar"], "ask"),
        (["sh"], ["sh", "-c", "ls; rm x"], "ask"),
        (["sh", "-c", "ls; ls"], ["sh", "-c", "ls; ls"], "allow"),
    ],
)
def test_an_allow_rule_lets_a_command_it_cannot_see_into_run_only_when_it_names_what_makes_it_so(
    tmp_path: Path, allowed: list[str], argv: list[str], decision: str
) -> None:
    p = profile(tmp_path, exec="ask", rules=(*DENY_RM, Rule(prefix=tuple(allowed), decision="allow")))
    assert decide(p, Call(Exec=Exec(argv=argv)))[0] == decision


def test_an_allow_rule_of_a_wrapper_does_not_allow_what_it_wraps(tmp_path: Path) -> None:
    p = profile(tmp_path, exec="ask", rules=(Rule(prefix=("timeout",), decision="allow"),))
    assert decide(p, Call(Exec=Exec(argv=["timeout", "5", "curl", "x"]))) == ("ask", "agent 'p' has exec = \"ask\"")


def test_an_allow_list_sees_through_a_harmless_wrapper(tmp_path: Path) -> None:
    p = profile(tmp_path, exec="ask", rules=(Rule(prefix=("ls",), decision="allow"),))
    assert decide(p, Call(Exec=Exec(argv=["nice", "ls"])))[0] == "allow"


def test_a_denial_through_a_wrapper_names_the_command_it_runs(tmp_path: Path) -> None:
    assert decide(profile(tmp_path, rules=DENY_RM), Call(Exec=Exec(argv=["timeout", "5", "rm", "-rf", "src"]))) == (
        "deny",
        "denied by the policy: the rule prefix = ['rm'] of agent 'p' says deny (the command runs rm -rf src)",
    )


def test_asking_about_what_cannot_be_seen_into_says_why(tmp_path: Path) -> None:
    assert decide(profile(tmp_path, rules=DENY_RM), Call(Exec=Exec(argv=["sh", "-c", "ls; rm x"]))) == (
        "ask",
        "sh -c runs a script that is not one simple command, which is not read here, and agent 'p' has rules that "
        "deny or ask (prefix = ['rm']) which what it runs could match: a person decides",
    )


def test_a_nul_in_an_argument_is_refused_saying_so(tmp_path: Path) -> None:
    assert decide(profile(tmp_path), Call(Exec=Exec(argv=["echo", "a\0b"]))) == (
        "deny",
        "refused: argument 1 of the command holds a NUL character, which no program can be given (what ran would "
        "differ from what was asked); send the command without it",
    )


def test_a_nul_in_a_git_argument_or_a_path_is_refused(tmp_path: Path) -> None:
    calls = [Call(Git=Git(argv=["log", "\0"])), Call(Read=Read(path="a\0")), Call(Write=Write(path="\0", text=""))]
    assert [decide(profile(tmp_path), call)[0] for call in calls] == ["deny", "deny", "deny"]


def test_max_calls_per_reply_defaults_to_100_and_must_be_at_least_1(tmp_path: Path) -> None:
    body = GOOD.replace("max_tokens = 2000", "max_tokens = 2000\nmax_calls_per_reply = 0")
    assert (profile(tmp_path).max_calls_per_reply, error_of(tmp_path, body)) == (
        100,
        "FILE:18: agent.coder.max_calls_per_reply is 0; it must be at least 1 (a tool call per reply)",
    )


def test_delegates_naming_no_agent_of_the_file_is_refused_with_its_line(tmp_path: Path) -> None:
    text = f'[agent.a]\nbase_url = "http://h"\nmodel = "m"\nworkspace_roots = ["{tmp_path}"]\ndelegates = ["b"]\n'
    with pytest.raises(ConfigError) as refused:
        parse_profiles(text, "FILE")
    assert str(refused.value) == (
        "FILE:5: agent.a.delegates names 'b', which is no agent of this file (the agents are a); add [agent.b] or "
        "remove it"
    )
