"""Schemas written outside devd (a model's output_schema, an MCP server's question), as an attacker would write them."""

from __future__ import annotations

import time

from devd.agent import jsonschemas


def test_a_regular_expression_anywhere_in_a_schema_is_refused() -> None:
    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string", "pattern": "^(a+)+$"}]}}}
    assert jsonschemas.problem(schema) == (
        "uses `pattern`: devd runs no regular expression a model or a server wrote (one can hold the daemon's CPU for "
        "minutes); describe the format in `description` instead"
    )


def test_a_property_named_pattern_is_no_regular_expression() -> None:
    schema = {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}
    assert (jsonschemas.problem(schema), jsonschemas.mismatch(schema, {"pattern": "x"})) == (None, None)


def test_a_reference_outside_the_schema_is_refused_and_nothing_is_fetched() -> None:
    started = time.monotonic()
    problem = jsonschemas.problem({"$ref": "http://127.0.0.1:9/schema.json"})
    assert (problem, time.monotonic() - started < 1) == (
        "has a `$ref` outside itself ('http://127.0.0.1:9/schema.json'): only `#...` references are followed",
        True,
    )


def test_a_reference_to_nowhere_inside_the_schema_fails_the_check_saying_so_instead_of_raising() -> None:
    schema = {"$ref": "#/$defs/missing"}
    found = jsonschemas.mismatch(schema, {})
    assert (
        jsonschemas.problem(schema),
        found and found[1].startswith("it could not be checked against the schema ("),
    ) == (
        None,
        True,
    )


def test_a_schema_too_long_is_refused() -> None:
    schema = {"type": "object", "description": "x" * (jsonschemas.SCHEMA_BYTES_MAX + 1)}
    assert jsonschemas.problem(schema) == f"is longer than {jsonschemas.SCHEMA_BYTES_MAX} bytes"


def test_a_value_that_does_not_fit_is_told_where_and_why() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert jsonschemas.mismatch(schema, {"n": "one"}) == ("n", "'one' is not of type 'integer'")
