"""The TypeScript client (clients/typescript): its types are what `devd schema --typescript` prints, it compiles under
`tsc --strict`, its Node tests pass against a real daemon (the driver's shared scenarios, tests/driver_scenarios.json,
among them, their fleet on a PostgreSQL database made here), and `devd schema --openrpc` is a valid OpenRPC document
by the OpenRPC project's own meta-schema.

npm packages come from `npm ci` (clients/typescript/package-lock.json), run here once and again only when the lock
file changes, so a fresh checkout needs nothing but Node.js 20+ and npm on the machine.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.jsonschema

from devd.schema import openrpc, typescript
from tests.daemon import ROOT, daemon_env
from tests.postgres import postgres, postgres_url  # noqa: F401  (the fixtures: the fleet scenario's store)

# One worker runs them all under pytest-xdist (`make test`): `npm ci` and `tsc` write node_modules and dist/ in the
# checkout, which two workers at once would tread on.
pytestmark = pytest.mark.xdist_group("typescript")

CLIENT = ROOT / "clients" / "typescript"
TYPES = CLIENT / "src" / "types.ts"
INSTALLED = CLIENT / "node_modules" / ".devd-lock-sha256"  # the lock file `npm ci` last installed
NPM_TIMEOUT_S = 600
RUN_TIMEOUT_S = 300


def run(argv: list[str], *, timeout: float = RUN_TIMEOUT_S, env: dict[str, str] | None = None) -> str:
    """Run argv in the client's directory; its output, or the test fails showing it."""
    done = subprocess.run(
        argv, cwd=CLIENT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not on PATH: the TypeScript client's tests need Node.js 20 or later, and npm")
    return found


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """clients/typescript/node_modules as package-lock.json pins it."""
    node = tool("node")
    major = int(run([node, "--version"]).strip().lstrip("v").split(".")[0])
    assert major >= 20, f"the TypeScript client needs Node.js 20 or later; this is {major}"
    lock = hashlib.sha256((CLIENT / "package-lock.json").read_bytes()).hexdigest()
    if not INSTALLED.exists() or INSTALLED.read_text() != lock:
        run([tool("npm"), "ci", "--no-audit", "--no-fund"], timeout=NPM_TIMEOUT_S)
        INSTALLED.write_text(lock)
    return CLIENT / "node_modules"


@pytest.fixture(scope="module")
def compiled(node_modules: Path) -> Path:
    """The client and its tests compiled by `tsc -p .` (strict) into a fresh dist/."""
    shutil.rmtree(CLIENT / "dist", ignore_errors=True)  # a test file since removed must not run from an old build
    run([tool("node"), str(node_modules / "typescript" / "bin" / "tsc"), "-p", "."])
    return CLIENT / "dist"


def test_the_checked_in_types_are_what_devd_schema_typescript_prints() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "devd", "schema", "--typescript"],
        cwd=ROOT,
        env=daemon_env(),
        capture_output=True,
        timeout=30,
        check=True,
    )
    assert printed.stdout.decode() == typescript()
    assert TYPES.read_text() == typescript(), "clients/typescript/src/types.ts is stale: run `make typescript`"


def test_the_client_and_its_narrowing_tests_compile_under_strict(compiled: Path) -> None:
    """tsconfig.json is strict; each `@ts-expect-error` in test/narrowing.test.ts must meet its error."""
    assert json.loads((CLIENT / "tsconfig.json").read_text())["compilerOptions"]["strict"] is True
    assert "export type Op =" in (compiled / "src" / "types.d.ts").read_text()
    assert (compiled / "test" / "narrowing.test.js").exists()


def test_the_node_tests_pass_against_a_real_daemon(compiled: Path, postgres_url: str) -> None:  # noqa: F811
    """`node --test`: the client and the turn driver against a daemon each test file starts (with this Python), and
    one test per shared driver scenario (scenarios.test.ts declares them in a loop)."""
    files = sorted((compiled / "test").glob("*.test.js"))
    declared = sum(len(re.findall(r"^test\(", p.read_text(), re.M)) for p in (CLIENT / "test").glob("*.test.ts"))
    declared += len(json.loads((ROOT / "tests" / "driver_scenarios.json").read_text())["scenarios"])
    output = run(
        [tool("node"), "--test", "--test-reporter=tap", *(str(f.relative_to(CLIENT)) for f in files)],
        env={**daemon_env(), "DEVD_PYTHON": sys.executable, "DEVD_TEST_POSTGRES_URL": postgres_url},
    )
    assert [f.name for f in files] == [
        "client.test.js",
        "driver.test.js",
        "kit.test.js",
        "narrowing.test.js",
        "scenarios.test.js",
    ]
    assert re.search(r"^# fail 0$", output, re.M), output
    assert re.search(rf"^# pass {declared}$", output, re.M), output


# Prints the OpenRPC meta-schema, which @open-rpc/meta-schema ships as a JavaScript object.
_PRINT_META = 'const m = await import("@open-rpc/meta-schema"); process.stdout.write(JSON.stringify(m.openrpcDocument))'


def openrpc_validator(node_modules: Path) -> jsonschema.Draft7Validator:
    """The OpenRPC meta-schema (@open-rpc/meta-schema), with the JSON Schema meta-schema it refers to."""
    meta = json.loads(run([tool("node"), "--input-type=module", "-e", _PRINT_META]))
    tools_schema = node_modules / "@json-schema-tools" / "meta-schema" / "schema.json"
    resource = referencing.jsonschema.DRAFT7.create_resource(json.loads(tools_schema.read_text()))
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(
        [("https://meta.json-schema.tools", resource), ("https://meta.json-schema.tools/", resource)]
    )
    return jsonschema.Draft7Validator(meta, registry=registry)


def test_devd_schema_openrpc_is_valid_by_the_openrpc_meta_schema(node_modules: Path) -> None:
    validator = openrpc_validator(node_modules)
    document = openrpc()
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(document)]
    assert errors == []
    broken = {**document, "methods": [{**document["methods"][0], "params": "none"}]}
    assert not validator.is_valid(broken)  # the meta-schema does check methods
