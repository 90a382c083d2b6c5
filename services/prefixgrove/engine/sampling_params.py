"""Per-request sampling settings, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_MAX_LOGPROBS = 20
_INT32_MAX = 2**31 - 1  # top_k, max_tokens and token ids live in int32/int64 tensors


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. A request with a seed gets
    the same tokens whatever else is in the batch and however many decode steps run per CPU round trip.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: token ids only (benchmarks; models whose tokenizer is not loaded)
    detokenize: bool = True

    def __post_init__(self) -> None:
        # Accept a single string / list for the sequence fields, as the OpenAI and vLLM APIs do.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple("stop", stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        if _is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._check_sampling()
        self._check_stops_and_logprobs()
        self._check_penalties()

    def _check_sampling(self) -> None:
        _check(
            _is_int(self.max_tokens) and 1 <= self.max_tokens <= _INT32_MAX,
            "max_tokens",
            self.max_tokens,
            f"an integer in [1, {_INT32_MAX}]",
        )
        _check_number(self, "temperature", 0.0, 100.0)
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            self.top_p,
            "0 < top_p <= 1",
        )
        _check(
            _is_int(self.top_k) and 0 <= self.top_k <= _INT32_MAX,
            "top_k",
            self.top_k,
            f"0 (disabled), -1 (disabled) or a positive integer <= {_INT32_MAX}",
        )
        _check_number(self, "min_p", 0.0, 1.0)
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "None or an integer in [0, 2**63)",
        )

    def _check_stops_and_logprobs(self) -> None:
        _check(
            all(isinstance(s, str) and s and is_unicode(s) for s in self.stop),
            "stop",
            self.stop,
            "non-empty strings of valid Unicode (no lone surrogates)",
        )
        _check(
            all(_is_int(t) and 0 <= t <= _INT32_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            f"integers in [0, {_INT32_MAX}]",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= _MAX_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"None or an integer in [0, {_MAX_LOGPROBS}]",
        )

    def _check_penalties(self) -> None:
        _check_number(self, "presence_penalty", -2.0, 2.0)
        _check_number(self, "frequency_penalty", -2.0, 2.0)
        _check(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            self.repetition_penalty,
            "0 < repetition_penalty <= 10",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        if isinstance(value, int) and value.bit_length() > 128:  # whole, it could be 4,000 digits
            shown = f"<an integer of {value.bit_length()} bits>"
        else:
            text = repr(value)
            shown = text if len(text) <= 80 else text[:77] + "..."
        raise ValueError(f"SamplingParams.{name}={shown} is invalid: expected {expected}")


def _as_tuple(name: str, value: Any) -> tuple[Any, ...]:
    if value is None or isinstance(value, (str, bytes)):
        _check(value is None, name, value, "a list")
        return ()
    try:
        return tuple(value)
    except TypeError:
        _check(False, name, value, "a list")
        raise


def _check_number(params: SamplingParams, name: str, low: float, high: float) -> None:
    value = getattr(params, name)
    ok = _is_number(value) and low <= value <= high
    _check(ok, name, value, f"a number with {low:g} <= {name} <= {high:g}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (NaN, infinities, bools and strings are not); an int too large for a
    float is not either."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (no encoder, no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
