"""What a command runs, as far as its argv shows: the commands a wrapper runs (`env rm`, `timeout 5 rm`, `sh -c
'rm x'`), and where the argv stops showing it (`python -c`, a program at a path of the workspace). Pure: no I/O.

The policy's rules (`devd.agent.profiles.decide`) match every command `see` finds, so a deny rule is not bypassed by a
wrapper; where it is blind, the policy asks instead of allowing. What it promises, and no more: each wrapper of
`WRAPPERS` is stripped with its options (an option it does not know makes it blind rather than guess), a program is
named by its basename, a shell's `-c` script that is one simple command (words, quotes, no expansion, redirection or
second command) is read as that command and anything else it is given is blind, and every program of `BLIND` is
blind. Rules are advice to the model's commands, not a boundary: a program can run another in ways no argv shows
(a Makefile, a test suite, a git hook), which is what the sandbox is for.
"""

from __future__ import annotations

import os
import re
import shlex

import msgspec

LAYERS_MAX = 16  # commands seen through, one inside the other, before the rest is taken as blind


class Options(msgspec.Struct, frozen=True):
    """How a wrapper's own arguments are read before the command it runs: its options without a value (`flags`),
    with one (`valued`: `-n 5`, `-n5`, `--adjustment=5`), with one only when attached (`attached`: xargs `-i[R]`),
    how many operands come before the command (timeout's duration), and whether `NAME=VALUE` words may (env)."""

    flags: frozenset[str] = frozenset()
    valued: frozenset[str] = frozenset()
    attached: frozenset[str] = frozenset()
    operands: int = 0
    assignments: bool = False
    numeric: bool = False  # `-10` is an option (nice's adjustment)


def _options(
    flags: str = "",
    valued: str = "",
    attached: str = "",
    operands: int = 0,
    assignments: bool = False,
    numeric: bool = False,
) -> Options:
    return Options(
        frozenset(flags.split()), frozenset(valued.split()), frozenset(attached.split()), operands, assignments, numeric
    )


# The programs that run the command given after their own arguments, and how those arguments are read (GNU
# coreutils, util-linux, findutils; the shell's builtins `exec`, `command`, `builtin`, `time`).
WRAPPERS: dict[str, Options] = {
    "env": _options(
        flags="-i - -0 -v --ignore-environment --null --debug --list-signal-handling",
        valued="-u --unset -C --chdir",
        attached="--default-signal --ignore-signal --block-signal",
        assignments=True,
    ),
    "nice": _options(valued="-n --adjustment", numeric=True),
    "timeout": _options(
        flags="-v -f -p --verbose --foreground --preserve-status", valued="-s -k --signal --kill-after", operands=1
    ),
    "xargs": _options(
        flags="-0 -p -r -t -x -o --null --interactive --no-run-if-empty --verbose --exit --open-tty --show-limits",
        valued="-a -d -E -I -L -n -P -s --arg-file --delimiter --max-args --max-procs --max-chars --process-slot-var",
        attached="-e -i -l --eof --replace --max-lines",
    ),
    "command": _options(flags="-p -v -V"),
    "builtin": _options(),
    "exec": _options(flags="-c -l", valued="-a"),
    "nohup": _options(),
    "stdbuf": _options(valued="-i -o -e --input --output --error"),
    "ionice": _options(flags="-t --ignore", valued="-c -n -p -P -u --class --classdata --pid --pgid --uid"),
    "setsid": _options(flags="-c -f -w --ctty --fork --wait"),
    "time": _options(flags="-p -v -a -q --portability --verbose --append --quiet", valued="-f -o --format --output"),
    "busybox": _options(),  # `busybox rm`: the next word is the program
    "toybox": _options(),
}

# Shells: `-c SCRIPT` is read when it is one simple command; any other use runs what argv does not show.
SHELLS = frozenset("sh bash dash zsh ksh mksh ash yash fish csh tcsh".split())
_SHELL_VALUED = frozenset("-o +o -O +O --rcfile --init-file".split())
# Shells that read startup files from their home (a command's HOME is its workspace) before any script: zsh's
# .zshenv, fish's config.fish, csh's .cshrc. Any other shell does so as a login (-l) or interactive (-i) shell.
_STARTUP_ALWAYS = frozenset("zsh fish csh tcsh".split())
_STARTUP_OPTIONS = frozenset("--login --rcfile --init-file --interactive".split())

# Programs that run code their argv does not show as a command: interpreters (inline code or a file), the shell's
# builtins that run a string, and runners that take a command in a form not read here.
BLIND = frozenset(
    "python pypy perl ruby node nodejs deno bun php lua luajit tclsh wish Rscript awk gawk mawk nawk jq "
    "eval trap source . fc "
    "sudo doas su runuser chroot chrt taskset flock unshare nsenter strace ltrace gdb valgrind watch parallel "
    "systemd-run script expect fakeroot proot firejail bwrap numactl prlimit cgexec".split()
)
_VERSIONED = re.compile(r"[0-9.]+$")  # python3.12, perl5.36, lua5.4, ksh93: named without their version
_INTERPRETER = re.compile(r"(python|pypy|perl|ruby|node|php|lua)[0-9.]*[-_.]")  # python3.12-dbg, php-cgi
# find's actions that run a command: the words after one, up to `;` or `+`.
FIND_RUNS = frozenset(("-exec", "-execdir", "-ok", "-okdir"))
# git's options that name a command git runs (an alias `!cmd`, core.pager, core.sshCommand; a directory of its own
# subcommands): what it runs is not its argv.
GIT_RUNS = ("-c", "--config-env", "--exec-path")
_GIT_VALUED = frozenset("-C --git-dir --work-tree --namespace --super-prefix --attr-source".split())
# Where a program named by path is one of the system's, named by its basename; anywhere else (the workspace, /tmp)
# it may be any program copied or written there.
SYSTEM_DIRS = frozenset("/bin /sbin /usr/bin /usr/sbin /usr/local/bin /usr/local/sbin".split())
# A shell script read as one simple command: words of these characters, quoted or not; nothing the shell expands,
# redirects, joins or comments.
_SIMPLE_SCRIPT = re.compile(r"""[A-Za-z0-9_./=:,+@%^ \t'"-]*""")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


class Seen(msgspec.Struct, frozen=True):
    """What an argv runs: `layers`, the argv and then each command found inside it, outermost first (the last is
    what runs in the end, as far as the argv shows); `blind`, why it may run something else than those (None: it
    does not, as far as argv can show), and `blind_at`, the layer that is so."""

    layers: tuple[tuple[str, ...], ...]
    blind: str | None = None
    blind_at: int | None = None


def program(word: str) -> str:
    """The name a rule knows a program by: its basename (`/bin/rm` is `rm`)."""
    return os.path.basename(word)


def see(argv: list[str] | tuple[str, ...]) -> Seen:
    """The commands argv runs, through every wrapper it can see through, and why it is blind where it is."""
    layers: list[tuple[str, ...]] = []
    blind: tuple[str, int] | None = None
    current: tuple[str, ...] | None = tuple(argv)
    while current:
        layers.append(current)
        if len(layers) > LAYERS_MAX:
            blind = blind or (f"it wraps commands more than {LAYERS_MAX} deep", len(layers) - 1)
            break
        current, why = _inside(current)
        if why is not None:
            blind = blind or (why, len(layers) - 1)
    return Seen(tuple(layers), *(blind or (None, None)))


Inside = tuple[tuple[str, ...] | None, str | None]  # the command run inside (None: none), and why more may run


def _inside(argv: tuple[str, ...]) -> Inside:
    """The command argv runs inside it (None: it is the command itself), and why it may run what argv does not
    show (None: it does not)."""
    first = argv[0]
    name = program(first)
    if "/" in first and os.path.dirname(os.path.normpath(first)) not in SYSTEM_DIRS:
        return None, f"{first} is a program at a path outside the system's directories: what it runs cannot be seen"
    if name in SHELLS or _VERSIONED.sub("", name) in SHELLS:
        return _script(name, argv[1:])
    if name in BLIND or _VERSIONED.sub("", name) in BLIND or _INTERPRETER.match(name):
        return None, f"{name} runs code that its arguments do not show as a command"
    if name == "find":
        return _find(argv[1:])
    if name == "git":
        return _git(argv[1:])
    options = WRAPPERS.get(name)
    if options is None:
        return None, None
    if name in ("busybox", "toybox"):
        return argv[1:] or None, None
    return _unwrap(name, options, argv[1:])


def _unwrap(name: str, options: Options, args: tuple[str, ...]) -> Inside:
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            i += 1
            break
        if word == "-" and "-" in options.flags:  # env's `-`, an old spelling of -i
            i += 1
            continue
        if not word.startswith("-") or word == "-":
            break
        if name == "env" and word.startswith(("-S", "--split-string")):
            return None, "env -S splits a string into a command, which is not read here"
        taken = _option(options, word, args[i + 1 : i + 2])
        if taken is None:
            return None, f"{name}'s option {word} is not known here, so the command it runs cannot be told"
        i += taken
    why = None
    if options.assignments and i < len(args) and _ASSIGNMENT.match(args[i]):
        why = f"{name} sets {args[i].split('=')[0]} in the environment, which can change what a command runs"
        while i < len(args) and _ASSIGNMENT.match(args[i]):
            i += 1
    i += options.operands
    return args[i:] or None, why


def _option(options: Options, word: str, following: tuple[str, ...]) -> int | None:
    """How many words an option takes up (1 or 2), or None when it is not known."""
    if word.startswith("--"):
        key, eq, _ = word.partition("=")
        if key in options.valued:
            return 1 if eq else 1 + len(following)
        if key in options.attached or (key in options.flags and not eq):
            return 1
        return None
    if options.numeric and word[1:].isdigit():
        return 1
    for at, letter in enumerate(word[1:], start=1):
        short = f"-{letter}"
        if short in options.valued:
            return 1 if at < len(word) - 1 else 1 + len(following)
        if short in options.attached:
            return 1
        if short not in options.flags:
            return None
    return 1


def _find(args: tuple[str, ...]) -> Inside:
    """The command find runs for each file (`-exec CMD ... ;`): the first one; more than one is blind."""
    runs: list[tuple[str, ...]] = []
    i = 0
    while i < len(args):
        if args[i] in FIND_RUNS:
            end = next((j for j in range(i + 1, len(args)) if args[j] in (";", "+")), len(args))
            runs.append(args[i + 1 : end])
            i = end
        i += 1
    runs = [run for run in runs if run]
    if len(runs) > 1:
        return runs[0], "find runs more than one command (-exec), and only the first is read here"
    return (runs[0] if runs else None), None


def _git(args: tuple[str, ...]) -> Inside:
    """git runs what its argv shows, unless an option names a command for it to run."""
    i = 0
    while i < len(args) and args[i].startswith("-"):  # git's own options end at the subcommand
        word = args[i]
        if word in GIT_RUNS or word.startswith(tuple(f"{o}=" for o in GIT_RUNS[1:])) or word.startswith("-c"):
            return None, f"git {word} can name a command git runs (an alias, a pager, an ssh command)"
        i += 2 if word in _GIT_VALUED else 1
    return None, None


def _script(shell: str, args: tuple[str, ...]) -> Inside:
    """The command of `SHELL -c SCRIPT` when SCRIPT is one simple command; else none, and why."""
    command = False
    startup = _VERSIONED.sub("", shell) in _STARTUP_ALWAYS
    i = 0
    while i < len(args) and args[i][:1] in ("-", "+") and args[i] not in ("-", "--"):
        word = args[i]
        short = word[:1] == "-" and word[1:2] != "-"  # a cluster of letters: -lc is -l -c
        startup = startup or word in _STARTUP_OPTIONS or (short and not {"l", "i"}.isdisjoint(word[1:]))
        if word in _SHELL_VALUED:
            i += 2
            continue
        if not word.startswith("--"):
            command = command or "c" in word[1:]
        i += 1
    if i < len(args) and args[i] == "--":
        i += 1
    if not command or i >= len(args):
        return None, f"{shell} runs a script that its arguments do not show"
    script = args[i]
    words: list[str] = []
    if _SIMPLE_SCRIPT.fullmatch(script):
        try:
            words = shlex.split(script)
        except ValueError:  # an unclosed quote: the shell refuses it too, but it is not read as a command here
            words = []
    if not words:
        return None, f"{shell} -c runs a script that is not one simple command, which is not read here"
    if _ASSIGNMENT.match(words[0]):
        while words and _ASSIGNMENT.match(words[0]):
            name = words.pop(0).split("=")[0]
        return tuple(words) or None, f"{shell} -c sets {name}, which can change what a command runs"
    if startup:
        return tuple(words), f"{shell} reads startup files from its home (the workspace) before its script"
    return tuple(words), None
