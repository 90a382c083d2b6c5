"""OpenAI's `strict: true` for a `response_format` JSON schema: the output holds to the schema
exactly, so the schema must leave the model nothing to choose about its shape. As OpenAI's API
does, a strict schema that breaks its rules fails the request (`invalid_value`, naming where):

- the root is an object schema (not `anyOf`);
- every object schema sets `"additionalProperties": false`;
- every object schema lists all its properties in `required` (an optional field is spelled as a
  union with null, `"type": ["string", "null"]`).

The engine enforces every schema strictly in any case (vLLM's behaviour, which ignores `strict`),
so a schema that passes here gives the output OpenAI's strict mode gives: each named property
exactly once, in the schema's order, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prefixgrove.jobs.request_errors import InvalidRequest

_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_ONE_SCHEMA = ("items", "not")
_WHERE = "response_format.json_schema.schema"


def check_strict_schema(schema: dict[str, Any]) -> None:
    """Raises InvalidRequest naming the first place `schema` breaks OpenAI's strict rules."""
    if not _is_object(schema):
        raise InvalidRequest(
            "invalid_value",
            f"{_WHERE} must be an object schema (type object) when strict is true, as OpenAI's "
            "strict mode requires",
        )
    for path, node in _subschemas(schema, _WHERE):
        if not _is_object(node):
            continue
        if node.get("additionalProperties") is not False:
            raise InvalidRequest(
                "invalid_value",
                f"{path} must set additionalProperties to false when strict is true, as "
                "OpenAI's strict mode requires of every object",
            )
        properties = node.get("properties") or {}
        missing = [name for name in properties if name not in (node.get("required") or [])]
        if missing:
            raise InvalidRequest(
                "invalid_value",
                f"{path} must list every property in required when strict is true, as OpenAI's "
                f"strict mode requires (missing: {', '.join(missing[:5])}); make an optional "
                "field a union with null instead",
            )


def _is_object(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema in `node`, itself first, with where it is."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SCHEMA_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{path}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{path}.{key}[{i}]")
    for key in _ONE_SCHEMA:
        yield from _subschemas(node.get(key), f"{path}.{key}")
