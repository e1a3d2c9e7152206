"""What a command runs as far as its argv shows (devd.agent.wrappers), pure: exact layers and exact reasons."""

from __future__ import annotations

import pytest

from devd.agent.wrappers import LAYERS_MAX, Seen, see


@pytest.mark.parametrize(
    ("argv", "seen"),
    [
        (["rm", "x"], Seen((("rm", "x"),))),
        (["env", "-i", "rm", "x"], Seen((("env", "-i", "rm", "x"), ("rm", "x")))),
        (["timeout", "-k", "1", "5", "rm"], Seen((("timeout", "-k", "1", "5", "rm"), ("rm",)))),
        (["nice", "-n5", "rm"], Seen((("nice", "-n5", "rm"), ("rm",)))),
        (["xargs", "-I", "{}", "rm", "{}"], Seen((("xargs", "-I", "{}", "rm", "{}"), ("rm", "{}")))),
        (["/usr/bin/busybox", "rm"], Seen((("/usr/bin/busybox", "rm"), ("rm",)))),
        (["sh", "-c", "rm 'a b'"], Seen((("sh", "-c", "rm 'a b'"), ("rm", "a b")))),
        (["env"], Seen((("env",),))),
        (
            ["env", "PATH=/tmp", "ls"],
            Seen(
                (("env", "PATH=/tmp", "ls"), ("ls",)),
                "env sets PATH in the environment, which can change what a command runs",
                0,
            ),
        ),
        (
            ["nice", "python3", "-c", "x"],
            Seen(
                (("nice", "python3", "-c", "x"), ("python3", "-c", "x")),
                "python3 runs code that its arguments do not show as a command",
                1,
            ),
        ),
        (
            ["sh", "-c", "ls | rm"],
            Seen(
                (("sh", "-c", "ls | rm"),),
                "sh -c runs a script that is not one simple command, which is not read here",
                0,
            ),
        ),
        (["bash"], Seen((("bash",),), "bash runs a script that its arguments do not show", 0)),
        (
            ["workspace/tool", "x"],
            Seen(
                (("workspace/tool", "x"),),
                "workspace/tool is a program at a path outside the system's directories: what it runs cannot be seen",
                0,
            ),
        ),
        (
            ["timeout", "--frobnicate", "5", "rm"],
            Seen(
                (("timeout", "--frobnicate", "5", "rm"),),
                "timeout's option --frobnicate is not known here, so the command it runs cannot be told",
                0,
            ),
        ),
    ],
)
def test_see_finds_each_command_inside_and_where_it_is_blind(argv: list[str], seen: Seen) -> None:
    assert see(argv) == seen


def test_find_runs_the_command_after_exec() -> None:
    assert see(["find", ".", "-exec", "rm", "{}", "+"]).layers[1:] == (("rm", "{}"),)


def test_git_is_blind_where_an_option_names_a_command_for_it_to_run() -> None:
    assert see(["git", "--config-env=core.pager=PAGER", "log"]).blind == (
        "git --config-env=core.pager=PAGER can name a command git runs (an alias, a pager, an ssh command)"
    )


def test_a_login_shell_reads_its_homes_startup_files_so_is_blind_though_its_script_is_read() -> None:
    assert see(["sh", "-lc", "ls"]) == Seen(
        (("sh", "-lc", "ls"), ("ls",)), "sh reads startup files from its home (the workspace) before its script", 0
    )


def test_wrappers_nested_past_the_bound_are_blind() -> None:
    seen = see(["nice"] * (LAYERS_MAX + 5) + ["ls"])
    assert (len(seen.layers), seen.blind) == (LAYERS_MAX + 1, f"it wraps commands more than {LAYERS_MAX} deep")


def test_gits_own_options_are_stripped_so_a_rule_sees_the_subcommand() -> None:
    assert see(["git", "-C", ".", "--no-pager", "push", "origin"]) == Seen(
        (("git", "-C", ".", "--no-pager", "push", "origin"), ("git", "push", "origin"))
    )


def test_a_shells_valued_option_in_a_cluster_takes_its_value_before_the_script() -> None:
    assert see(["bash", "-oc", "posix", "rm x"]).layers[1:] == (("rm", "x"),)


def test_an_argument_naming_a_watched_program_makes_a_program_not_known_inert_blind() -> None:
    assert (
        see(["ssh", "h", "rm", "x"], frozenset({"rm"})).blind
        == "ssh's argument 'rm' names the program rm, which ssh may run"
    )


def test_an_argument_with_shell_syntax_makes_a_program_not_known_inert_blind() -> None:
    assert (
        see(["curl", "a;b"]).blind == "curl's argument 'a;b' holds shell syntax (';'), which curl may run as a command"
    )


def test_an_option_that_names_a_command_is_blind() -> None:
    assert see(["tar", "-xIf", "./x", "a.tar"]).blind == (
        "tar's option -I names a command for it to run, which is not read here"
    )


def test_a_program_whose_arguments_are_data_is_not_blind_for_them() -> None:
    assert see(["grep", "-E", "rm|sh", "f"], frozenset({"rm"})) == Seen((("grep", "-E", "rm|sh", "f"),))


def test_xargs_command_is_blind_unless_inert_as_it_is_given_words_from_the_input() -> None:
    assert see(["xargs", "-I", "X", "sh", "-c", "X"]).blind == (
        "xargs gives sh words read from its input, which may name a command for it to run"
    )


def test_a_git_subcommand_that_runs_a_command_it_is_given_is_blind() -> None:
    assert see(["git", "rebase", "-x", "make", "main"]).blind == (
        "git rebase -x names a command for git to run, which is not read here"
    )
