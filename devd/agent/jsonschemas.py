"""JSON Schemas written outside devd (a model's `output_schema`, an MCP server's question): one check before devd takes
one, and one check of a value against a schema so taken.

What it promises:
- A schema taken is a JSON object of at most SCHEMA_BYTES_MAX bytes, valid under its own metaschema, whose every
  `$ref` points into itself (`#...`: nothing is fetched, and no reference is left unresolvable to fail a check later),
  and which holds no regular expression (`pattern`, `patternProperties`). Python's matcher keeps the GIL while it
  backtracks, so a pattern chosen by a model or a server would stop the whole daemon: `^(a+)+$` against 24 a's took
  0.8 s, and each further a doubles it.
- `mismatch` never raises for a schema `problem` took: it says why the value does not satisfy it, or None.
jsonschema is imported at the first check: a daemon that is never given a schema does not load it.
"""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA_BYTES_MAX = 64 * 1024  # as JSON

# Keywords whose value maps names to schemas (a name there is no keyword), and those whose value is data, not a schema.
_NAMED = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"enum", "const", "default", "examples", "description", "title", "required", "$comment"})
_REFUSED = frozenset({"pattern", "patternProperties"})


def problem(schema: Any) -> str | None:
    """Why the schema is not taken, in words that follow "the schema " (None: it is taken)."""
    if not isinstance(schema, dict):
        return "is not a JSON object"
    if len(msgspec.json.encode(schema)) > SCHEMA_BYTES_MAX:
        return f"is longer than {SCHEMA_BYTES_MAX} bytes"
    refused = _refused(schema)
    if refused is not None:
        return refused
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return f"is not a JSON Schema ({e.message[:200]})"
    except RecursionError:
        return "nests too deeply to be checked"
    return None


def mismatch(schema: dict[str, Any], value: Any) -> tuple[str, str] | None:
    """Where (a JSON pointer's parts joined by `/`, empty for the whole value) and why the value does not satisfy a
    schema `problem` took; None when it does."""
    import jsonschema
    from referencing.exceptions import Unresolvable

    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except (jsonschema.SchemaError, Unresolvable, RecursionError) as e:  # `#/nowhere`, say
        return "", f"it could not be checked against the schema ({str(e)[:200]})"
    if error is None:
        return None
    return "/".join(str(p) for p in error.absolute_path), error.message[:300]


def _refused(schema: dict[str, Any]) -> str | None:
    """What of the schema devd will not run: a regular expression, or a reference outside it."""
    schemas: list[Any] = [schema]
    while schemas:
        node = schemas.pop()
        if isinstance(node, list):
            schemas.extend(node)
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _REFUSED:
                return (
                    f"uses `{key}`: devd runs no regular expression a model or a server wrote (one can hold the "
                    "daemon's CPU for minutes); describe the format in `description` instead"
                )
            if key in ("$ref", "$dynamicRef") and not (isinstance(value, str) and value.startswith("#")):
                return f"has a `{key}` outside itself ({str(value)[:100]!r}): only `#...` references are followed"
            if key in _NAMED and isinstance(value, dict):
                schemas.extend(value.values())
            elif key not in _DATA:
                schemas.append(value)
    return None
