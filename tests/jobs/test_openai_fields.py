"""Every field OpenAI documents for a batch body is accepted: used (seed, stop, logprobs,
logit_bias, max_completion_tokens, model), ignored (user, metadata, store, ...), or refused for
the one request, naming the field, where the feature is not served (tools, audio, ...); output
constraints (response_format, vLLM's structured_outputs and guided_*) reach the engine."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from prefixgrove.engine import SamplingParams
from prefixgrove.jobs.redis_store.schema import RequestRecord
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line
from prefixgrove.jobs.sampling_fields import sampling_kwargs

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(extra: dict[str, Any], url: str = CHAT) -> BatchRequest | RequestError:
    body = {"messages": MESSAGES} if url == CHAT else {"prompt": "hi"}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body | extra})
    return parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)


def accepted(extra: dict[str, Any], url: str = CHAT) -> BatchRequest:
    request = parse(extra, url)
    assert isinstance(request, BatchRequest), request
    return request


def refused(extra: dict[str, Any], url: str = CHAT) -> RequestError:
    error = parse(extra, url)
    assert isinstance(error, RequestError), error
    return error


@pytest.mark.parametrize(
    "field, value",
    [
        ("user", "u1"), ("metadata", {"team": "search"}), ("store", True),
        ("service_tier", "auto"), ("parallel_tool_calls", False),
        ("stream_options", {"include_usage": True}), ("prompt_cache_key", "k"),
        ("safety_identifier", "s"), ("modalities", ["text"]), ("response_format", {"type": "text"}),
        ("n", 1),
    ],
)  # fmt: skip
def test_a_field_that_changes_nothing_offline_is_accepted_and_ignored(
    field: str, value: Any
) -> None:
    assert accepted({field: value}).params == {"max_tokens": 16}


@pytest.mark.parametrize(
    "field, value", [("user", "u1"), ("n", 1), ("best_of", 1), ("echo", False)]
)
def test_a_completions_field_that_changes_nothing_is_accepted(field: str, value: Any) -> None:
    assert accepted({field: value}, COMPLETIONS).params == {"max_tokens": 16}


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "alloy"}),
        ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
        ("reasoning_effort", "low"), ("modalities", ["text", "audio"]),
    ],
)  # fmt: skip
def test_an_unserved_feature_fails_the_request_naming_the_field(field: str, value: Any) -> None:
    error = refused({field: value})
    assert error.code == "unsupported_field" and field in error.message


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("best_of", 3), ("best_of", 2)])
def test_an_unserved_completions_feature_fails_naming_the_field(field: str, value: Any) -> None:
    error = refused({field: value}, COMPLETIONS)
    assert error.code == "unsupported_field" and field in error.message


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# What OpenAI's strict mode takes: every object closed, every property required.
STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string"},
        "result": {"type": "object", "properties": {"b": {"type": ["integer", "null"]}},
                   "required": ["b"], "additionalProperties": False},
    },
    "required": ["reasoning", "result"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.mark.parametrize(
    "extra, constraint",
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
         {"json": SCHEMA}),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": STRICT_SCHEMA, "strict": True}}}, {"json": STRICT_SCHEMA}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"guided_choice": ["x"], "response_format": {"type": "text"}}, {"choice": ["x"]}),
    ],
)  # fmt: skip
def test_an_output_constraint_reaches_the_engine(
    extra: dict[str, Any], constraint: dict[str, Any]
) -> None:
    for url in (CHAT, COMPLETIONS):
        assert accepted(extra, url).params["structured_outputs"] == constraint


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"pattern": "a"}}, "exactly one"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "choice"),
        ({"structured_outputs": {"json_object": False}}, "json_object"),
        ({"guided_regex": 7}, "regex"),
    ],
)  # fmt: skip
def test_a_malformed_output_constraint_fails_its_request_naming_it(
    extra: dict[str, Any], named: str
) -> None:
    error = refused(extra)
    assert error.code == "invalid_value" and named in error.message


def test_a_schema_reaches_the_engine_in_its_own_property_order() -> None:
    ordered = {"type": "object", "properties": {"z": {}, "a": {}, "m": {}}}
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": ordered}}}
    line = json.dumps({"custom_id": "a", "url": CHAT, "body": {"messages": MESSAGES, **body}})
    request = parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)
    assert isinstance(request, BatchRequest)
    assert list(request.params["structured_outputs"]["json"]["properties"]) == ["z", "a", "m"]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema, "strict": True}}}  # fmt: skip


@pytest.mark.parametrize(
    "schema, named",
    [
        (SCHEMA, "response_format.json_schema.schema must set additionalProperties to false"),
        ({**STRICT_SCHEMA, "required": ["result"]}, "must list every property in required "
         "when strict is true, as OpenAI's strict mode requires (missing: reasoning)"),
        ({**STRICT_SCHEMA, "properties": {"result": {"type": "object", "properties": {}}}},
         "schema.properties.result must set additionalProperties to false"),
        ({"$defs": {"x": {"type": "object"}}, "anyOf": [{"$ref": "#/$defs/x"}]},
         "must be an object schema (type object) when strict is true"),
    ],
)  # fmt: skip
def test_a_strict_schema_outside_openais_strict_rules_fails_naming_where(
    schema: dict[str, Any], named: str
) -> None:
    """OpenAI refuses such a schema under strict: true, and so does a batch line here; without
    strict (false or left out) the same schema is taken and enforced, as vLLM takes it."""
    error = refused(strict(schema))
    assert error.code == "invalid_value" and named in error.message
    loose = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    assert accepted(loose).params["structured_outputs"] == {"json": schema}


@pytest.mark.parametrize(
    "extra", [{"structured_outputs": {"choice": []}}, {"guided_choice": []}]
)  # fmt: skip
def test_an_empty_choice_list_is_refused_as_a_constraint_no_output_meets(
    extra: dict[str, Any],
) -> None:
    error = refused(extra)
    assert error.code == "unsatisfiable_constraint" and "choice is an empty list" in error.message


def test_n_samples_reach_the_engine_and_best_of_may_repeat_n() -> None:
    assert accepted({"n": 3}).params == {"max_tokens": 16, "n": 3}
    assert accepted({"n": 2, "best_of": 2}, COMPLETIONS).params == {"max_tokens": 16, "n": 2}
    assert accepted({"n": 128}).params["n"] == 128


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0), ("n", 129), ("response_format", {"type": "xml"}), ("response_format", "text"),
        ("logit_bias", {"abc": 1}), ("logit_bias", {"-3": 1}), ("logit_bias", {"5": 101}),
        ("logit_bias", [5, 1]), ("logit_bias", {"9" * 5000: 1}), ("model", 7), ("model", ""),
    ],
)  # fmt: skip
def test_a_bad_value_of_a_new_field_is_named(field: str, value: Any) -> None:
    error = refused({field: value})
    assert error.code == "invalid_value" and field in error.message


def test_logit_bias_reaches_the_engine_keyed_by_token_id() -> None:
    request = accepted({"logit_bias": {"5": 1.5, "17": -100}})
    assert request.params["logit_bias"] == {"5": 1.5, "17": -100.0}
    assert json.loads(json.dumps(request.params)) == request.params  # survives Redis
    params = SamplingParams(**sampling_kwargs(request.params))
    assert params.logit_bias == {5: 1.5, 17: -100.0}


def test_sampling_fields_reach_the_engine() -> None:
    body = {"seed": 7, "stop": "\n", "logprobs": True, "top_logprobs": 3,
            "max_completion_tokens": 5}  # fmt: skip
    params = accepted(body).params
    assert params == {"max_tokens": 5, "seed": 7, "stop": ["\n"], "logprobs": 3}
    SamplingParams(**sampling_kwargs(params))


def test_the_requested_model_is_kept_for_the_response() -> None:
    assert accepted({"model": "gpt-4o-mini"}).model == "gpt-4o-mini"
    assert accepted({}).model is None


def test_a_request_record_carries_the_requested_model_through_redis() -> None:
    tokens = np.arange(3, dtype=np.int32)
    named = RequestRecord.decode(RequestRecord("c", "chat", {}, tokens, "m1").encode())
    unnamed = RequestRecord.decode(RequestRecord("c", "chat", {}, tokens).encode())
    assert (named.model, unnamed.model) == ("m1", None)
