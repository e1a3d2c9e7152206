# Two commands for a fresh machine: `make run` (set up, then start the daemon) and `make test` (set up, then test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
CORE_SRC := $(wildcard core/build.zig core/build.zig.zon core/src/*.zig)

.PHONY: setup build run test prerequisites bench clean typescript

# The package is byte-compiled as an installed wheel is (pip compiles at install; an editable install does not):
# where PYTHONDONTWRITEBYTECODE is set, every start would otherwise compile devd's modules again (0.15-0.2 s).
# compileall checks each file's mtime, so a setup with nothing changed costs a fraction of a second.
setup: $(VENV)/.installed devd/core.wasm
	$(PY) -m compileall -q devd

$(VENV)/.installed: pyproject.toml hatch_build.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q hatchling editables "ziglang==0.17.0"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

# The editable install builds the core once; this keeps it current when core/ changes.
devd/core.wasm: $(CORE_SRC) | $(VENV)/.installed
	$(PY) -c 'from pathlib import Path; from hatch_build import build_core; build_core(Path("."), Path("$@"))'

build: devd/core.wasm

run: setup
	$(VENV)/bin/devd serve

# One worker more than the cores (pytest-xdist): with one a core the cores stood idle a quarter of the run, while
# workers waited on daemons, fsyncs and sockets (2 cores, one sitting: 3 min 12 s with two workers, 2 min 43 s with
# three, 2 min 47 s with four). The TypeScript tests share one worker, as they share clients/typescript.
# The benchmarks are byte-compiled too (setup compiles devd): a run starts about 170 daemon and CLI processes, and
# where PYTHONDONTWRITEBYTECODE is set each would compile what it imports again (0.2 s of CPU a process).
# The core's own unit tests (its logic and its allocator, run natively) come first: a few seconds.
# A hung test fails within its own timeout and a minute, and a worker lost to one fails the run then (pyproject.toml).
test: setup prerequisites
	cd core && $(abspath $(PY)) -m ziglang build test
	$(PY) -m compileall -q benchmarks
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup

# What the suite needs from outside the virtualenv (bubblewrap, git, Node.js, PostgreSQL): installs bubblewrap and git,
# and the npm packages of the MCP tests (tests/npm),
# where it can (root or password-less sudo, apt-get), else says in one line what is missing and how to get it.
prerequisites: setup
	.ci/prerequisites $(PY)

bench: setup
	$(PY) -m benchmarks.bench core

# The TypeScript client's types, generated from the daemon's; tests/test_typescript.py and .ci/run fail when the
# checked-in file is not what this prints. (`make test` installs the client's npm packages itself, with `npm ci`.)
typescript: $(VENV)/.installed
	$(VENV)/bin/devd schema --typescript > clients/typescript/src/types.ts.new
	mv clients/typescript/src/types.ts.new clients/typescript/src/types.ts


clean:
	rm -rf $(VENV) devd/core.wasm core/zig-out core/.zig-cache build clients/typescript/node_modules clients/typescript/dist
