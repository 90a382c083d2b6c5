"""StructuredOutputsParams: what a request's output must match (vLLM's names and meaning)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields, replace
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (a dict, or a string holding one); the output is a JSON value it validates.
    regex: the output matches this regular expression (whole).
    choice: the output is one of these strings.
    grammar: an EBNF grammar in GBNF (llama.cpp) or Lark syntax.
    json_object: True: the output is any JSON object (OpenAI's response_format json_object).

    disable_any_whitespace: JSON without whitespace between tokens (json, json_object): shorter
    outputs, and no room for a model to run on in whitespace; by default any JSON whitespace may
    appear, as vLLM allows it.

    The output ends (EOS) once the constraint is complete and nothing more may follow; max_tokens
    may cut it short, as it cuts any output (finish_reason "length").
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # vLLM and JSON give a list
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "StructuredOutputsParams.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams takes exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        kind = given[0]
        value = getattr(self, kind)
        ok = {
            "json": (isinstance(value, str) and value.strip()) or isinstance(value, dict),
            "regex": isinstance(value, str) and value,
            "grammar": isinstance(value, str) and value.strip(),
            "choice": isinstance(value, tuple)
            and value
            and all(isinstance(c, str) and c for c in value),
            "json_object": value is True,
        }[kind]
        if not ok:
            expected = {
                "json": "a JSON schema (a dict, or a non-empty string holding one)",
                "regex": "a non-empty regular expression",
                "grammar": "a non-empty GBNF or Lark grammar",
                "choice": "a non-empty list of non-empty strings",
                "json_object": "True",
            }[kind]
            text = repr(value)
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise ValueError(
                f"StructuredOutputsParams.{kind}={shown} is invalid: expected {expected}"
            )
        if kind == "json" and isinstance(value, str):
            try:
                schema = _json.loads(value)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    "StructuredOutputsParams.json must hold a JSON schema (an object), got "
                    f"{type(schema).__name__}"
                )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, compact): equal constraints compile once. A schema's spacing does
        not count, its key order does: properties are generated in the order the schema lists
        them ("reasoning" before "answer"), as vLLM and OpenAI generate them. Worked out once where
        the value cannot change (anything but a schema dict: see `frozen`)."""
        cached: tuple[str, str, bool] | None = self.__dict__.get("_key")
        if cached is not None:
            return cached
        kind, value = self.kind, getattr(self, self.kind)
        compact = self.disable_any_whitespace
        if kind == "json":
            schema = _json.loads(value) if isinstance(value, str) else value
            key = kind, _json.dumps(schema, separators=(",", ":")), compact
        elif kind == "choice":
            key = kind, _json.dumps(list(value)), compact
        else:
            key = kind, str(value), compact
        if not isinstance(value, dict):
            object.__setattr__(self, "_key", key)
        return key

    def frozen(self) -> StructuredOutputsParams:
        """This constraint as the engine keeps it: a schema dict becomes its canonical text, which
        later changes to the dict cannot reach, and the key is then worked out once instead of per
        request (a job of thousands spent most of its intake there)."""
        if not isinstance(self.json, dict):
            return self
        return replace(self, json=self.key[1])

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        """`value` itself, or one built from a dict of its fields (batch files and the gRPC job
        carry the constraint as a dict)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown field(s) {', '.join(unknown)}; expected one "
                    f"of {', '.join(KINDS)} (and optionally disable_any_whitespace)"
                )
            return cls(**value)
        raise ValueError(
            "SamplingParams.structured_outputs must be StructuredOutputsParams or a dict of its "
            f"fields, got {type(value).__name__}"
        )


@dataclass(frozen=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's name for StructuredOutputsParams before 0.11 (`vllm.sampling_params.GuidedDecodingParams`,
    `SamplingParams(guided_decoding=...)`), with its `backend`: every constraint compiles with
    llguidance (vLLM's "guidance"), so "auto" and "guidance" are taken and another backend is
    refused by name rather than silently replaced."""

    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in (None, "auto", "guidance"):
            raise ValueError(
                f"GuidedDecodingParams.backend={self.backend!r} is not supported: constraints "
                "compile with llguidance; pass 'guidance', 'auto' or leave it out"
            )
        super().__post_init__()
