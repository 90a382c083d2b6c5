"""A request that will not run: its error record, the exception the validators raise with the error
code, and how a message quotes the offending value.

Codes a line's validation gives: line_too_large, invalid_encoding, nesting_too_deep, invalid_json,
unknown_field, missing_custom_id, invalid_method, invalid_url, invalid_body, invalid_prompt,
invalid_token_id, invalid_messages, invalid_value, unsupported_field, unsatisfiable_constraint. The
engine's refusals after the planner accepted: context_length_exceeded, unsatisfiable_constraint (a
structured-output constraint no output can meet), invalid_request (`engine_error`). A request the
engine ran and ended as an error: constraint_failed (output_lines.failed_output).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from prefixgrove.jobs.output_lines import error_line

SURROGATE = re.compile("[\ud800-\udfff]")  # a str holding one cannot be written as UTF-8


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request that will not run; it becomes one line of the job's error file."""

    index: int
    custom_id: str | None
    code: str
    message: str

    def to_line(self, tag: str) -> str:
        """The error file's line, its id under the job's run tag (output_lines.run_tag)."""
        line = error_line(self.index, self.custom_id, self.code, self.message, tag)
        # A message quoting a tokenizer's or template's words may hold what UTF-8 cannot.
        if is_unicode(line):
            return line
        return json.dumps(json.loads(line) | {"custom_id": None})


class InvalidRequest(Exception):
    """Raised by a validator; the line's parser turns it into a RequestError with its code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def engine_error(index: int, custom_id: str, exc: ValueError) -> RequestError:
    """What the engine refuses after the planner accepted (its own context and cache limits)."""
    text = str(exc)
    if "max_model_len" in text:
        code = "context_length_exceeded"
    elif "accepts no output" in text:  # the engine's words for it (structured/grammars.py)
        code = "unsatisfiable_constraint"
    else:
        code = "invalid_request"
    return RequestError(index, custom_id, code, text)


def is_unicode(text: str) -> bool:
    return SURROGATE.search(text) is None


def is_int(value: Any) -> bool:
    """An integer, as JSON gives one (`true` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: Any) -> str:
    """`value` as an error message quotes it: short, whatever it holds."""
    if is_int(value) and value.bit_length() > 128:  # whole, it could be 4,000 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
