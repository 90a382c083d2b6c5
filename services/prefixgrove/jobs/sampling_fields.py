"""A body's sampling fields -> the keyword arguments of SamplingParams, each checked against the
range the engine accepts (and that fits its int32 / int64 tensors)."""

from __future__ import annotations

import math
from typing import Any

from prefixgrove.jobs.request_body import INT32_MAX, Endpoint
from prefixgrove.jobs.request_errors import InvalidRequest, is_int, shown
from prefixgrove.jobs.structured_fields import structured_params
from prefixgrove.jobs.vllm_fields import OUTPUT_ONLY, add_echo, add_vllm_sampling

_MAX_STOP_STRINGS = 16
_MAX_LOGPROBS = 20
_MAX_N = 128  # OpenAI's own bound on samples per request


def sampling_params(
    body: dict[str, Any], endpoint: Endpoint, default_max_tokens: int
) -> dict[str, Any]:
    """The body's sampling settings as SamplingParams keyword arguments, JSON-serialisable."""
    n = _samples(body)
    if body.get("stream", False) is not False:
        raise InvalidRequest(
            "invalid_value", f"stream must be false in a batch, got {shown(body['stream'])}"
        )
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(name)
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    params: dict[str, Any] = {"max_tokens": _int(max_tokens, name, 1, INT32_MAX)}
    if n > 1:
        params["n"] = n
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0)):
        if body.get(name) is not None:
            params[name] = _float(body[name], name, low, high)
    if "top_p" in params and params["top_p"] == 0.0:
        raise InvalidRequest("invalid_value", "top_p must be > 0")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            params[name] = _float(body[name], name, -2.0, 2.0)
    if body.get("repetition_penalty") is not None:
        params["repetition_penalty"] = _float(
            body["repetition_penalty"], "repetition_penalty", 0.01, 10.0
        )
    if body.get("top_k") is not None:
        params["top_k"] = max(_int(body["top_k"], "top_k", -1, INT32_MAX), 0)
    if body.get("seed") is not None:
        params["seed"] = _int(body["seed"], "seed", 0, 2**63 - 1)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise InvalidRequest(
                "invalid_value",
                f"ignore_eos must be a boolean, got {shown(body['ignore_eos'])}",
            )
        params["ignore_eos"] = body["ignore_eos"]
    _add_outputs(params, body, endpoint)
    return params


def _add_outputs(params: dict[str, Any], body: dict[str, Any], endpoint: Endpoint) -> None:
    """Adds to `params` what shapes the output: stops, logprobs, logit_bias, its constraint."""
    if body.get("stop") is not None:
        params["stop"] = _stop(body["stop"])
    if body.get("stop_token_ids") is not None:
        params["stop_token_ids"] = _stop_token_ids(body["stop_token_ids"])
    logprobs = _logprobs(body, endpoint)
    if logprobs is not None:
        params["logprobs"] = logprobs
    if body.get("logit_bias") is not None:
        params["logit_bias"] = _logit_bias(body["logit_bias"])
    structured = structured_params(body)
    if structured is not None:
        params["structured_outputs"] = structured
    add_vllm_sampling(params, body)
    add_echo(params, body, endpoint)


def sampling_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """A request's params -> SamplingParams keyword arguments (logit_bias keyed by token id;
    what shapes only the output line, such as echo, left out)."""
    if "logit_bias" not in params and not any(name in params for name in OUTPUT_ONLY):
        return params
    kwargs = {name: value for name, value in params.items() if name not in OUTPUT_ONLY}
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
    return kwargs


def _samples(body: dict[str, Any]) -> int:
    """n, OpenAI's samples per request (each a choice of the response, `index` 0..n-1; seeded
    sample j uses seed + j, as vLLM's). best_of may only repeat n: every sample is returned."""
    n = _int(body["n"], "n", 1, _MAX_N) if body.get("n") is not None else 1
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise InvalidRequest(
            "unsupported_field",
            f"best_of {shown(best_of)} is not supported: every sample is returned, so best_of "
            f"may only equal n ({n})",
        )
    return n


def _logit_bias(bias: Any) -> dict[str, float]:
    """OpenAI's map of token id (a decimal string, as JSON keys are) -> bias in [-100, 100]. The
    keys stay strings so the params survive JSON; `sampling_kwargs` turns them into ids."""
    if not isinstance(bias, dict):
        raise InvalidRequest(
            "invalid_value",
            f"logit_bias must be an object of token id -> number in [-100, 100], got {shown(bias)}",
        )
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= INT32_MAX):
            raise InvalidRequest(
                "invalid_value",
                f"logit_bias key {shown(key)} is not a token id: keys are integers in "
                f"[0, {INT32_MAX}] written as strings",
            )
        _float(value, f"logit_bias[{key!r}]", -100.0, 100.0)
    return {key: float(value) for key, value in bias.items()}


def _stop_token_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        raise InvalidRequest(
            "invalid_value",
            f"stop_token_ids must be a list of token ids (integers in [0, {INT32_MAX}]), "
            f"got {shown(ids)}",
        )
    return ids


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    value = body.get("logprobs")
    if endpoint == "completions":
        return None if value is None else _int(value, "logprobs", 0, _MAX_LOGPROBS)
    if value is None or value is False:
        return None
    if value is not True:
        raise InvalidRequest(
            "invalid_value", f"logprobs must be a boolean for chat, got {shown(value)}"
        )
    top = body.get("top_logprobs")
    return 0 if top is None else _int(top, "top_logprobs", 0, _MAX_LOGPROBS)


def _stop(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise InvalidRequest(
            "invalid_value",
            f"stop must be a string or a list of at most {_MAX_STOP_STRINGS} non-empty "
            f"strings, got {shown(stop)}",
        )
    return stops


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequest(
            "invalid_value", f"{name} must be an integer {bound}, got {shown(value)}"
        )
    return int(value)


def _float(value: Any, name: str, low: float, high: float) -> float:
    # NOTE: compare before converting: an integer of 400 digits has no float.
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not low <= value <= high or not math.isfinite(value):
        raise InvalidRequest(
            "invalid_value", f"{name} must be a number in [{low}, {high}], got {shown(value)}"
        )
    return float(value)
