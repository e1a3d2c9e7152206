# Two commands for a fresh machine: `make run` (set up, then start the daemon) and `make test` (set up, then test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE_SRC := $(wildcard core/build.zig core/build.zig.zon core/src/*.zig)

.PHONY: setup build run test bench clean

setup: $(VENV)/.installed devd/core.wasm

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

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m devd.bench core


clean:
	rm -rf $(VENV) devd/core.wasm core/zig-out core/.zig-cache build
