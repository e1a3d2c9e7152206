"""What a command runs, as far as its argv shows: the commands a wrapper runs (`env rm`, `timeout 5 rm`, `sh -c
'rm x'`, `git -C . push`), and where the argv stops showing it (`python -c`, a program at a path of the workspace,
`tar --to-command=...`). Pure: no I/O.

The policy's rules (`devd.agent.profiles.decide_command`) match every command `see` finds, so a deny rule is not
bypassed by a wrapper; where it is blind, the policy asks instead of allowing. What it promises, and no more:
- each wrapper of `WRAPPERS` is stripped with its options (an option it does not know makes it blind rather than
  guess); a program is named by its basename; git's own options before its subcommand are stripped (`git -C . push`
  is `git push`), and what it runs besides (`GIT_RUNS`, `GIT_SUBCOMMAND_RUNS`: `rebase -x`, `bisect run`, ...) is blind;
- a shell's options are read (`-o VALUE`, `-O VALUE` in a cluster too: `-oc posix 'rm x'`); its `-c` script that is
  one simple command (words, quotes, globs in its arguments; no expansion, redirection, keyword or second command) is
  read as that command, and anything else it is given is blind;
- every program of `BLIND` is blind (interpreters, runners that take a command in a form not read here);
- the one rule for every other program: it is taken to run nothing else when it is one of `INERT` (programs whose
  arguments are data, never a command), and otherwise it is blind when an argument looks like a command: it holds
  shell syntax (`;`, `|`, `&`, `$`, a backquote, a newline), or a word of it names a program that runs commands (a
  shell, a wrapper, a program of `BLIND`) or one the caller watches (the programs its deny and ask rules name), or it
  is an option of `COMMAND_OPTIONS` (`tar -I`, `rsync -e`, `sort --compress-program`; a long one, or a git
  subcommand's of `GIT_SUBCOMMAND_RUNS`, also by any prefix of it: `--to-com`), or a sed script's `e`;
- xargs's command is blind unless it is one of `INERT`, since words from its input are added to it, and so is one
  whose program is xargs's `-I` placeholder (as find's `{}`).
Rules are advice to the model's commands, not a boundary: a program can run another in ways no argv shows
(a Makefile, a test suite, a git hook), which is what the sandbox is for.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence

import msgspec

# The regular expressions below are kept as text and compiled by `re` at their first use (its cache keeps them): a
# daemon imports this module as it starts and checks no command then; compiling them at import was about 4 ms of
# every start.
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
SHELLS = frozenset("sh bash rbash dash zsh ksh mksh lksh oksh loksh posh ash yash fish csh tcsh".split())
# Their options (bash's, which the others' are a part of): letters alone or in a cluster, `o` and `O` taking the next
# word as their value for each time they occur in it (`-oc posix` is `-o posix -c`); an option not here is blind.
_SHELL_LETTERS = frozenset("abcefhiklmnprstuvxBCDEHPT")
_SHELL_LETTERS_VALUED = frozenset("oO")
_SHELL_LONG = frozenset(
    "--login --noprofile --norc --posix --restricted --verbose --noediting --debugger --dump-strings --dump-po-strings "
    "--wordexp --protected --help --version".split()
)
_SHELL_LONG_VALUED = frozenset("--rcfile --init-file".split())
# Words that begin a shell's compound command or change what the next word is: a script starting with one is not
# one simple command.
_SHELL_KEYWORDS = frozenset(
    "if then else elif fi case esac for select while until do done in function time coproc ! { } [[ ]]".split()
)
# Shells that read startup files from their home (a command's HOME is its workspace) before any script: zsh's
# .zshenv, fish's config.fish, csh's .cshrc. Any other shell does so as a login (-l) or interactive (-i) shell.
_STARTUP_ALWAYS = frozenset("zsh fish csh tcsh".split())
_STARTUP_OPTIONS = frozenset("--login --rcfile --init-file --interactive".split())

# Programs that run code their argv does not show as a command: interpreters (inline code or a file), the shell's
# builtins that run a string, and runners that take a command in a form not read here.
BLIND = frozenset(
    "python pypy perl ruby node nodejs deno bun php lua luajit tclsh wish Rscript awk gawk mawk nawk busybox-awk jq "
    "pwsh nu elvish xonsh rc es "
    "eval trap source . fc enable coproc "
    "sudo doas su runuser pkexec sg newgrp setpriv runcon chroot chrt taskset flock unshare nsenter prlimit "
    "strace ltrace gdb lldb valgrind perf catchsegv watch parallel systemd-run systemd-inhibit caffeinate script "
    "expect fakeroot proot firejail bwrap numactl cgexec logsave ssh-agent dbus-run-session dbus-launch eatmydata "
    "faketime unbuffer rlwrap torsocks proxychains proxychains4 tsocks chpst setuidgid softlimit envdir daemonize "
    "start-stop-daemon tmux screen at batch entr "
    "setarch linux32 linux64 uname26 "
    "vi vim nvim view ex vimdiff rvim gvim emacs emacsclient nano editor sensible-editor "
    "socat run-parts".split()
)
_VERSIONED = r"[0-9.]+$"  # python3.12, perl5.36, lua5.4, ksh93: named without their version
_INTERPRETER = r"(python|pypy|perl|ruby|node|php|lua)[0-9.]*[-_.]"  # python3.12-dbg, php-cgi
# The dynamic loader runs the program it is given (ld.so, ld-linux-x86-64.so.2, ld-musl-x86_64.so.1), and setarch's
# names for an architecture run theirs (`x86_64 rm x`, `i386 sh`).
_LOADER = r"ld([-.].*)?\.so(\.[0-9]+)*"
_ARCH = (
    r"i[3-6]86|x86_64|amd64|aarch64|arm(v[0-9]+[a-z]*)?|ppc(32|64)?(le)?|s390x?|sparc(32|64)?|mips(64)?(el)?|"
    r"parisc(32|64)?|ia64|alpha|riscv(32|64)|loongarch64|m68k|sh[0-9]+"
)

# Programs whose arguments are data, never a command (coreutils and the like): an argument naming a program, or
# holding shell syntax, is not run by them. Any other program with such an argument is blind.
INERT = frozenset(
    "ls cat tac head tail wc cut paste join tr uniq comm fold fmt nl od expand unexpand rev column echo printf pwd "
    "true false test [ mkdir rmdir touch cp mv ln rm unlink chmod chown chgrp stat du df basename dirname realpath "
    "readlink date sleep seq tee diff cmp md5sum sha1sum sha224sum sha256sum sha384sum sha512sum b2sum cksum sum "
    "base32 base64 xxd hexdump file which whoami id uname hostname grep egrep fgrep mktemp truncate shred sync "
    "csplit yes expr tree nproc arch printenv dd".split()
)


def _by_name(*rows: tuple[str, str]) -> dict[str, frozenset[str]]:
    """A table from rows of (names, words), each a string of space-separated words: every name to its row's words."""
    return {name: frozenset(words.split()) for names, words in rows for name in names.split()}


# Options that name a command the program runs (`tar --to-command=CMD`, `rsync -e CMD`), by program. A long option
# matches itself and `OPTION=VALUE`, a short one also with its value attached (`-Icmd`), and in a cluster of letters
# (`tar -xIf`) for the programs of `_CLUSTERING`; `+` matches any word starting with it (less's `+!cmd`).
COMMAND_OPTIONS = _by_name(
    (
        "tar",
        "--to-command --use-compress-program --checkpoint-action --info-script --new-volume-script "
        "--rmt-command --rsh-command -I -F",
    ),
    ("rsync", "-e --rsh --rsync-path"),
    ("man", "-P --pager -H --html"),
    ("less more most pager sensible-pager", "+"),
    ("sort", "--compress-program"),
    ("split", "--filter"),
    ("cc gcc g++ c++ clang clang++", "-wrapper -B -specs --specs -fplugin -fuse-ld --ld-path"),
    ("make gmake", "--eval -E"),
    ("ssh scp sftp", "-o -F -S"),
    ("zip", "-TT --unzip-command"),
    ("sdiff diff3", "--diff-program"),
    ("wget", "--use-askpass"),
    ("rg", "--pre"),
    ("install", "--strip-program"),
)
_CLUSTERING = frozenset("tar rsync ssh scp sftp zip sort man".split())
# Names of programs that run commands which are as often plain words of an argument (`make -C .`, `--when at`):
# not taken for a program there (the rules' own programs always are).
_PLAIN_WORDS = frozenset(". .. at batch es rc nu ex view alpha arm".split())
# Characters with which a string is a shell's script rather than words: a program given it may hand it to a shell.
_SHELL_SYNTAX = frozenset(";|&`$\n")
# sed's `e` command (`1e CMD`) and `s///e` flag run a command.
_SED_RUNS = (
    r"(^|[;\n{}!0-9$/,~])\s*e(\s|$|[;}])",
    r"s(.)(?:\\.|(?!\1).)*\1(?:\\.|(?!\1).)*\1[^;\n}]*e",
)
# find's actions that run a command: the words after one, up to `;` or `+`.
FIND_RUNS = frozenset(("-exec", "-execdir", "-ok", "-okdir"))
# git's options that name a command git runs (an alias `!cmd`, core.pager, core.sshCommand; a directory of its own
# subcommands): what it runs is not its argv.
GIT_RUNS = ("-c", "--config-env", "--exec-path")
_GIT_VALUED = frozenset("-C --git-dir --work-tree --namespace --super-prefix --attr-source --list-cmds".split())
_GIT_FLAGS = frozenset(
    "--no-pager -P -p --paginate --bare --no-replace-objects --literal-pathspecs --glob-pathspecs --noglob-pathspecs "
    "--icase-pathspecs --no-optional-locks --no-advice --no-lazy-fetch --version --help -h --html-path --man-path "
    "--info-path".split()
)
# git's subcommands that run a command they are given: by an option (`rebase -x CMD`), by a word (`bisect run CMD`,
# `submodule foreach CMD`), or always (`mergetool`, `filter-branch`'s filters, `instaweb`'s server).
GIT_SUBCOMMAND_RUNS = _by_name(
    ("rebase", "-x --exec"),
    ("bisect", "run"),
    ("submodule", "foreach"),
    ("difftool", "-x --extcmd"),
    ("mergetool filter-branch instaweb daemon web--browse", "*"),
    ("fetch pull ls-remote archive", "--upload-pack -u --exec"),
    ("clone", "--upload-pack -u --exec -c --config --template"),  # config (core.sshCommand), hooks it runs
    ("push send-pack", "--receive-pack --exec"),
    ("send-email", "--smtp-server --to-cmd --cc-cmd --sendmail-cmd"),
    ("grep", "-O --open-files-in-pager"),
)
# `git config KEY VALUE` setting a key that names a command git runs later (core.pager, core.sshCommand, alias.x,
# a hook, an editor, a filter or diff driver), or editing the file (`-e`: the editor), is blind.
_GIT_CONFIG_RUNS = (
    r"(?i)command|cmd|hook|editor|edit|pager|ssh|program|helper|alias|textconv|filter|driver|tool|browser|askpass|"
    r"exec|sendmail|proxy|fsmonitor|gpg|include|credential|^-e$"
)
# Where a program named by path is one of the system's, named by its basename; anywhere else (the workspace, /tmp)
# it may be any program copied or written there.
SYSTEM_DIRS = frozenset("/bin /sbin /usr/bin /usr/sbin /usr/local/bin /usr/local/sbin".split())
# A shell script read as one simple command: words of these characters, quoted or not; nothing the shell expands,
# redirects, joins or comments.
_SIMPLE_SCRIPT = r"""[A-Za-z0-9_./=:,+@%^*?\[\] \t'"-]*"""
_GLOB = frozenset("*?[")
_ASSIGNMENT = r"[A-Za-z_][A-Za-z0-9_]*="


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


def see(argv: list[str] | tuple[str, ...], watched: frozenset[str] = frozenset()) -> Seen:
    """The commands argv runs, through every wrapper it can see through, and why it is blind where it is. `watched`
    names programs an argument of a program not `INERT` must not name (the policy's deny and ask rules')."""
    layers: list[tuple[str, ...]] = []
    blind: tuple[str, int] | None = None
    current: tuple[str, ...] | None = tuple(argv)
    while current:
        layers.append(current)
        if len(layers) > LAYERS_MAX:
            blind = blind or (f"it wraps commands more than {LAYERS_MAX} deep", len(layers) - 1)
            break
        current, why = _inside(current, watched)
        if why is not None:
            blind = blind or (why, len(layers) - 1)
    return Seen(tuple(layers), *(blind or (None, None)))


def blind_by_itself(layer: Sequence[str]) -> bool:
    """Whether a command is blind for what its program is (an interpreter, a runner of `BLIND`, a program at a path
    outside the system's directories), not for an argument it was given (`git -c`, `make --eval`, `sh -c 'a; b'`):
    only then does a rule naming the program and some of its arguments name what it may run."""
    first = layer[0]
    name = program(first)
    if "/" in first and os.path.dirname(os.path.normpath(first)) not in SYSTEM_DIRS:
        return True
    bare = re.sub(_VERSIONED, "", name)
    shell_or_wrapper = name in SHELLS or bare in SHELLS or name in WRAPPERS or name in ("find", "git")
    return runs_commands(name) and not shell_or_wrapper


def runs_commands(name: str) -> bool:
    """Whether a program of this name runs a command given in its arguments: a shell, a wrapper, find, git,
    a program of `BLIND` (an interpreter, a runner), the loader or an architecture's name (setarch)."""
    bare = re.sub(_VERSIONED, "", name)
    return (
        name in SHELLS
        or bare in SHELLS
        or name in BLIND
        or bare in BLIND
        or name in WRAPPERS
        or name in ("find", "git")
        or re.match(_INTERPRETER, name) is not None
        or re.fullmatch(_LOADER, name) is not None
        or re.fullmatch(_ARCH, name) is not None
    )


# Programs that run a command given as later words elsewhere or in an environment they make (`ssh host CMD`,
# `docker exec c CMD`, `uv run CMD`): a remembered prefix of their argv would settle any command.
RUN_LATER_WORDS = frozenset(
    "ssh rsh docker podman kubectl npx uvx pipx uv npm pnpm yarn poetry pipenv bundle conda mamba nix nix-shell".split()
)


def runs_later_words(words: tuple[str, ...]) -> str | None:
    """Why these words followed by more may run any command given in them (so that a remembered prefix of them
    would settle every command), or None: a wrapper, shell, interpreter or other runner, or a program of
    `RUN_LATER_WORDS`. find and git are not: what they run is only after an option (`-exec`, `-c`) or a
    subcommand that `see` is blind at."""
    if not words:
        return None
    name = program(words[0])
    seen = see(words)
    if len(seen.layers) > 1 or seen.blind is not None or name in RUN_LATER_WORDS:
        return f"{name} runs a command given in its arguments"
    if name not in ("find", "git") and runs_commands(name):
        return f"{name} runs a command given in its arguments"
    return None


Inside = tuple[tuple[str, ...] | None, str | None]  # the command run inside (None: none), and why more may run


def _inside(argv: tuple[str, ...], watched: frozenset[str]) -> Inside:
    """The command argv runs inside it (None: it is the command itself), and why it may run what argv does not
    show (None: it does not)."""
    first = argv[0]
    name = program(first)
    if first != "[" and not _GLOB.isdisjoint(first):  # from a shell's script, `/usr/bin/r[m]` is rm
        return None, f"{first} is a pattern the shell expands, which may name any program"
    if "/" in first and os.path.dirname(os.path.normpath(first)) not in SYSTEM_DIRS:
        return None, f"{first} is a program at a path outside the system's directories: what it runs cannot be seen"
    if name in SHELLS or re.sub(_VERSIONED, "", name) in SHELLS:
        return _script(name, argv[1:])
    if name == "find":
        return _find(argv[1:])
    if name == "git":
        return _git(argv[1:])
    if name in ("busybox", "toybox"):  # `busybox rm`: the next word is the program
        return argv[1:] or None, None
    options = WRAPPERS.get(name)
    if options is not None:
        inner, why = _unwrap(name, options, argv[1:])
        return inner, why if why is not None or name != "xargs" else _fed(argv[1:], inner)
    if runs_commands(name):
        return None, f"{name} runs code that its arguments do not show as a command"
    if name in INERT:
        return None, None
    return None, _looks_like_a_command(name, argv[1:], watched)


def _looks_like_a_command(name: str, args: tuple[str, ...], watched: frozenset[str]) -> str | None:
    """Why a program not known to be inert may run a command one of its arguments gives, or None: an option that
    names one (`COMMAND_OPTIONS`, sed's `e`), shell syntax, or a word naming a program that runs commands or one
    the rules watch."""
    options = COMMAND_OPTIONS.get(name, frozenset())
    for at, word in enumerate(args):
        option = _command_option(name, options, word, first=at == 0)
        if option is not None:
            return f"{name}'s option {option} names a command for it to run, which is not read here"
        if name == "sed" and any(re.search(runs, word) for runs in _SED_RUNS):
            return f"sed's script {_short(word)} may hold its e command, which runs a command"
        value = word.partition("=")[2] if word.startswith("-") else word
        syntax = next((c for c in value if c in _SHELL_SYNTAX), None)
        if syntax is not None:
            return (
                f"{name}'s argument {_short(word)} holds shell syntax ({syntax!r}), which {name} may run as a command"
            )
        for part in value.split():
            named = program(part.lstrip("+!:'\""))
            if named in watched or (named not in _PLAIN_WORDS and runs_commands(named)):
                return f"{name}'s argument {_short(word)} names the program {named}, which {name} may run"
    return None


def _command_option(name: str, options: frozenset[str], word: str, first: bool) -> str | None:
    """The option of `COMMAND_OPTIONS` this word is or holds, or None."""
    if "+" in options and word.startswith("+"):
        return word
    key = word.partition("=")[0]
    if key in options:
        return key
    if (long := _abbreviates(key, options)) is not None:
        return long
    for option in options:
        if len(option) == 2 and option[0] == "-" and word.startswith(option):  # `-Icmd`
            return option
    cluster = word[1:] if word[:1] == "-" and word[1:2] != "-" else word if first and name == "tar" else ""
    if name in _CLUSTERING and cluster.isalpha():  # `tar -xIf`, `tar xIf` (its old first word), `rsync -avze`
        return next((f"-{c}" for c in cluster if f"-{c}" in options), None)
    return None


def _abbreviates(key: str, options: frozenset[str]) -> str | None:
    """The long option of `options` that `key` may name by a prefix of it (`--to-com` for `--to-command`), or None:
    getopt_long and git take a long option by any prefix that names it alone."""
    if not key.startswith("--") or len(key) < 3:
        return None
    return next((option for option in sorted(options) if option.startswith(key)), None)


def _short(word: str) -> str:
    """A word as a reason quotes it: at most 60 characters of it."""
    return repr(word) if len(word) <= 60 else f"{word[:60]!r}..."


def _fed(args: tuple[str, ...], inner: tuple[str, ...] | None) -> str | None:
    """Why xargs's command may run what its argv does not show: words from xargs's input are added to it, or its
    program is the `-I` placeholder, unless it is a program of `INERT`."""
    if inner is None:
        return None
    options = args[: len(args) - len(inner)]
    replace = None
    for at, word in enumerate(options):
        if word == "-I" and at + 1 < len(options):
            replace = options[at + 1]
        elif word.startswith(("-I", "-i", "--replace")):
            replace = word[2:] if word[1] != "-" else word.partition("=")[2]
            replace = replace or "{}"
    if replace is not None and replace in inner[0]:
        return f"xargs takes the program it runs from its input (its placeholder {replace!r})"
    if program(inner[0]) not in INERT:
        return f"xargs gives {program(inner[0])} words read from its input, which may name a command for it to run"
    return None


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
    if options.assignments and i < len(args) and re.match(_ASSIGNMENT, args[i]):
        why = f"{name} sets {args[i].split('=')[0]} in the environment, which can change what a command runs"
        while i < len(args) and re.match(_ASSIGNMENT, args[i]):
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
    """The command find runs for each file (`-exec CMD ... ;`): the first one; more than one is blind, and so is
    one whose program is the file found (`-exec {} ;`)."""
    runs: list[tuple[str, ...]] = []
    i = 0
    while i < len(args):
        if args[i] in FIND_RUNS:
            end = next((j for j in range(i + 1, len(args)) if args[j] in (";", "+")), len(args))
            runs.append(args[i + 1 : end])
            i = end
        i += 1
    runs = [run for run in runs if run]
    if not runs:
        return None, None
    if "{}" in runs[0][0]:
        return None, "find runs the files it finds as the program (-exec {}), which the argv does not show"
    if len(runs) > 1:
        return runs[0], "find runs more than one command (-exec), and only the first is read here"
    return runs[0], None


def _git(args: tuple[str, ...]) -> Inside:
    """git runs what its argv shows, unless an option names a command for it to run. Its own options before the
    subcommand are stripped (`git -C . push` runs `git push`, which a rule for ["git", "push"] matches)."""
    i = 0
    while i < len(args) and args[i].startswith("-"):  # git's own options end at the subcommand
        word = args[i]
        key = word.partition("=")[0]
        if key in GIT_RUNS or (word.startswith("-c") and word != "-C"):
            return None, f"git {word} can name a command git runs (an alias, a pager, an ssh command)"
        if key in _GIT_VALUED:
            i += 1 if "=" in word else 2
        elif word in _GIT_FLAGS:
            i += 1
        elif word.startswith("-C"):  # -Cdir
            i += 1
        else:
            return None, f"git's option {word} is not known here, so what it runs cannot be told"
    if i > 0:
        return (("git", *args[i:]) if i < len(args) else None), None
    if not args:
        return None, None
    sub, rest = args[0], args[1:]
    runs = GIT_SUBCOMMAND_RUNS.get(sub, frozenset())
    if "*" in runs:
        return None, f"git {sub} runs commands its arguments or configuration name"
    for word in rest:
        key = word.partition("=")[0]
        short = word[:1] == "-" and word[1:2] != "-"
        abbreviated = _abbreviates(key, runs) is not None
        if (
            key in runs
            or abbreviated
            or (short and any(len(r) == 2 and r[1] in word[1:] for r in runs if r[:2] != "--"))
        ):
            return None, f"git {sub} {word} names a command for git to run, which is not read here"
    if sub == "config" and any(re.search(_GIT_CONFIG_RUNS, word) for word in rest):
        return None, "git config sets a key that can name a command git runs later (a pager, an alias, a hook)"
    return None, None


def _script(shell: str, args: tuple[str, ...]) -> Inside:
    """The command of `SHELL -c SCRIPT` when SCRIPT is one simple command; else none, and why."""
    command = False
    startup = re.sub(_VERSIONED, "", shell) in _STARTUP_ALWAYS
    i = 0
    while i < len(args) and args[i][:1] in ("-", "+") and args[i] not in ("-", "--"):
        word = args[i]
        i += 1
        if word.startswith("--"):
            key = word.partition("=")[0]
            startup = startup or key in _STARTUP_OPTIONS
            if key in _SHELL_LONG_VALUED:
                i += 0 if "=" in word else 1
            elif word not in _SHELL_LONG:
                return None, f"{shell}'s option {word} is not known here, so the script it runs cannot be told"
            continue
        for letter in word[1:]:  # a cluster: -lc is -l -c, -oc posix is -o posix -c
            if letter in _SHELL_LETTERS_VALUED:
                i += 1
            elif letter not in _SHELL_LETTERS:
                return None, f"{shell}'s option {word} is not known here, so the script it runs cannot be told"
        startup = startup or (word[0] == "-" and not {"l", "i"}.isdisjoint(word[1:]))
        command = command or (word[0] == "-" and "c" in word[1:])
    if i < len(args) and args[i] == "--":
        i += 1
    if not command or i >= len(args):
        return None, f"{shell} runs a script that its arguments do not show"
    script = args[i]
    words: list[str] = []
    if re.fullmatch(_SIMPLE_SCRIPT, script):
        try:
            words = shlex.split(script)
        except ValueError:  # an unclosed quote: the shell refuses it too, but it is not read as a command here
            words = []
    if not words or words[0] in _SHELL_KEYWORDS:  # a keyword begins a compound command
        return None, f"{shell} -c runs a script that is not one simple command, which is not read here"
    if re.match(_ASSIGNMENT, words[0]):
        while words and re.match(_ASSIGNMENT, words[0]):
            name = words.pop(0).split("=")[0]
        return tuple(words) or None, f"{shell} -c sets {name}, which can change what a command runs"
    if startup:
        return tuple(words), f"{shell} reads startup files from its home (the workspace) before its script"
    return tuple(words), None
