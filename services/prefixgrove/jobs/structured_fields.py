"""A body's output constraint -> StructuredOutputsParams keyword arguments.

Three spellings are accepted, at most one per request: OpenAI's `response_format` (json_object,
json_schema; with `strict: true` the schema must be one OpenAI's strict mode takes, as
strict_schema.py checks), vLLM's `structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields. Whether a schema, regex or grammar compiles, and whether
any output can meet it, is the engine's check (a per-request error); an empty choice list is refused
here (`unsatisfiable_constraint`, the engine's code for a constraint no output meets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgrove.jobs.request_errors import InvalidRequest, shown
from prefixgrove.jobs.strict_schema import check_strict_schema

STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Per kind of structured_outputs: whether a value is one, and what the error says is accepted.
_KIND_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "json": (
        lambda v: isinstance(v, (dict, str)) and bool(v),
        "a JSON schema (an object, or a string holding one)",
    ),
    "regex": (
        lambda v: isinstance(v, str) and bool(v),
        "a regular expression (a non-empty string)",
    ),
    "grammar": (
        lambda v: isinstance(v, str) and bool(v),
        "an EBNF / GBNF grammar (a non-empty string)",
    ),
    "choice": (
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(c, str) for c in v),
        "a non-empty list of strings",
    ),
    "json_object": (lambda v: v is True, "true"),
}


def structured_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's output constraint, or None when it has none."""
    given = {name: body[name] for name in STRUCTURED_FIELDS if body.get(name) is not None}
    response_format = given.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        del given["response_format"]
    if len(given) > 1:
        raise InvalidRequest(
            "invalid_value",
            f"{' and '.join(sorted(given))} both constrain the output: give at most one",
        )
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    kind = name.removeprefix("guided_")
    return _structured_outputs({kind: value})


def _response_format(response_format: Any) -> dict[str, Any]:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "invalid_value",
                "response_format.json_schema must be an object with a `schema` object (and a "
                f"`name`), got {shown(spec)}",
            )
        strict = spec.get("strict")
        if strict not in (None, True, False):
            raise InvalidRequest(
                "invalid_value",
                f"response_format.json_schema.strict must be a boolean, got {shown(strict)}",
            )
        if strict:
            check_strict_schema(schema)
        return {"json": schema}
    raise InvalidRequest(
        "invalid_value",
        f"response_format must be an object with a type of 'text', 'json_object' or "
        f"'json_schema', got {shown(response_format)}",
    )


def _structured_outputs(spec: Any) -> dict[str, Any]:
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""
    kinds = [k for k in _STRUCTURED_KINDS if isinstance(spec, dict) and spec.get(k) is not None]
    known = {*_STRUCTURED_KINDS, "disable_any_whitespace"}
    unknown = sorted(set(spec) - known) if isinstance(spec, dict) else []
    if not isinstance(spec, dict) or len(kinds) != 1 or unknown:
        raise InvalidRequest(
            "invalid_value",
            "structured_outputs must be an object with exactly one of "
            f"{', '.join(_STRUCTURED_KINDS)}, got {shown(spec)}",
        )
    kind = kinds[0]
    value = spec[kind]
    if kind == "choice" and value == []:
        raise InvalidRequest(
            "unsatisfiable_constraint",
            "choice is an empty list, which no output can be one of: give at least one string",
        )
    accepts, expected = _KIND_VALUES[kind]
    if not accepts(value):
        raise InvalidRequest("invalid_value", f"{kind} must be {expected}, got {shown(value)}")
    compact = spec.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise InvalidRequest(
            "invalid_value",
            f"structured_outputs.disable_any_whitespace must be a boolean, got {shown(compact)}",
        )
    return {kind: value, "disable_any_whitespace": True} if compact else {kind: value}
