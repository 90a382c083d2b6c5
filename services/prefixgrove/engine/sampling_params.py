"""Per-request sampling settings, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass

_MAX_LOGPROBS = 20


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
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._check_sampling()
        self._check_stops_and_logprobs()
        self._check_penalties()

    def _check_sampling(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            self.temperature,
            "0 <= temperature <= 100",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "0 < top_p <= 1")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "0 (disabled), -1 (disabled) or a positive integer",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "0 <= min_p <= 1")
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "None or an integer in [0, 2**63)",
        )

    def _check_stops_and_logprobs(self) -> None:
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative integers",
        )
        _check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= _MAX_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"None or an integer in [0, {_MAX_LOGPROBS}]",
        )

    def _check_penalties(self) -> None:
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "-2 <= presence_penalty <= 2",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "-2 <= frequency_penalty <= 2",
        )
        _check(
            0.0 < self.repetition_penalty <= 10.0,
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
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}")
