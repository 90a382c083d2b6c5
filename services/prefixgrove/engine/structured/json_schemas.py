"""A JSON schema as vLLM's default structured-output backend reads it, before llguidance compiles it.

llguidance follows the JSON Schema specification, where an object that says nothing of other
properties allows any: a model could add keys the schema never named. vLLM's default backend
(xgrammar, strict mode) generates only the named properties unless the schema allows more, and its
guidance backend does the same with `guidance_disable_additional_properties`; so here every object
schema that names its properties (`properties` or `patternProperties`) and says nothing of others
gets `"additionalProperties": false`. A schema that allows more (`true`, or a schema of them)
keeps it. Property order and whitespace are llguidance's own: properties in the order the schema
lists them, any JSON whitespace unless `disable_any_whitespace`.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a map of name -> schema, a list of schemas, or one schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_ONE_SCHEMA = (
    "items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip


def without_unnamed_properties(schema: Any) -> Any:
    """A copy of `schema` in which every object schema naming its properties and silent about
    others allows no others (the module's docstring says why). Keys keep their order."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: without_unnamed_properties(v) for name, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [without_unnamed_properties(v) for v in value]
        elif key in _ONE_SCHEMA:
            value = without_unnamed_properties(value)
        out[key] = value
    names_properties = "properties" in out or "patternProperties" in out
    if names_properties and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
