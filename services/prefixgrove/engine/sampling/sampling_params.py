"""Per-request sampling settings, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..structured.params import StructuredOutputsParams
from .pooling_params import PoolingParams

_MAX_LOGPROBS = 20
_MAX_N = 1024
_INT32_MAX = 2**31 - 1  # top_k, max_tokens and token ids live in int32/int64 tensors


def _derived(default: Any) -> Any:
    """A field the engine sets, not the caller: not an argument, not shown, not compared."""
    return field(default=default, init=False, repr=False, compare=False)


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. A request with a seed gets
    the same tokens whatever else is in the batch and however many decode steps run per CPU round trip.
    max_tokens None: up to the context limit. Fields may be changed after construction, as in vLLM: the
    engine checks the params again, and takes its own copy, when a request comes in (`prepared`).
    """

    n: int = 1  # samples per prompt (LLM.generate runs them as a group sharing the prompt)
    best_of: int | None = None  # None or n: every sample is returned
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # per prompt token: its logprob and the top k (the prompt runs outside prefix groups)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: token ids only (benchmarks; models whose tokenizer is not loaded)
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never produced (their token sequences are banned)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    # the output matches a JSON schema, regex, choice or grammar (a dict of its fields is taken too)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's name for structured_outputs before 0.11 (GuidedDecodingParams): the same constraint
    guided_decoding: StructuredOutputsParams | None = None
    # the request returns its prompt's pooled embedding (LLM.embed; a dict of its fields is taken
    # too): it generates one token, which is not returned
    pooling: PoolingParams | None = None
    # Set by `prepared`: the token sequences of bad_words, and the ids min_tokens holds back.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = _derived(())
    min_tokens_stop_ids: tuple[int, ...] = _derived(())
    is_prepared: bool = _derived(False)  # an engine's own checked copy

    def __post_init__(self) -> None:
        # Accept a single string / list for the sequence fields, as the OpenAI and vLLM APIs do.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        self.stop = _as_tuple("stop", stop)
        self.stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self._check_samples()
        self._check_sampling()
        self._check_stops_and_logprobs()
        self._check_penalties()
        self._check_logit_controls()
        self._take_guided_decoding()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.pooling is not None:
            self.pooling = PoolingParams.of(self.pooling)
            self._check_pooling()

    def _check_pooling(self) -> None:
        """An embedding request pools its prompt in one step: nothing it would generate counts."""
        clashing = [
            name
            for name, value in (
                ("n", self.n != 1), ("max_tokens", self.max_tokens != 1),
                ("logprobs", self.logprobs is not None),
                ("prompt_logprobs", self.prompt_logprobs is not None),
                ("structured_outputs", self.structured_outputs is not None),
            )
            if value
        ]  # fmt: skip
        if clashing:
            raise ValueError(
                f"SamplingParams.pooling asks for an embedding, so {', '.join(clashing)} cannot "
                "be set: it takes n=1, max_tokens=1 and no logprobs, prompt_logprobs or "
                "structured_outputs"
            )

    def _take_guided_decoding(self) -> None:
        """guided_decoding is structured_outputs under vLLM's older name: one constraint."""
        guided, structured = self.guided_decoding, self.structured_outputs
        if guided is None or guided is structured:
            return
        if structured is not None:
            raise ValueError(
                "SamplingParams takes structured_outputs or guided_decoding (its older name), "
                "not both"
            )
        self.structured_outputs = self.guided_decoding = StructuredOutputsParams.of(guided)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `SamplingParams.clone`): changing it leaves this one as it is."""
        return copy.deepcopy(self)

    def prepared(self, tokenizer: Any, eos_token_ids: Iterable[int]) -> SamplingParams:
        """A checked copy for the engine to keep (later changes to this object do not reach it), with
        the token ids of bad_words and the stop ids min_tokens holds back (EOS unless ignore_eos).
        Without a tokenizer (skip_tokenizer_init) nothing is detokenized, as vLLM does."""
        if tokenizer is None:
            self._check_without_tokenizer()
        params = replace(self)
        params.detokenize = params.detokenize and tokenizer is not None
        eos = () if self.ignore_eos else tuple(sorted(set(eos_token_ids)))
        params.min_tokens_stop_ids = tuple(dict.fromkeys(self.stop_token_ids + eos))
        params.is_prepared = True
        if params.structured_outputs is not None:
            params.structured_outputs = params.structured_outputs.frozen()
            params.guided_decoding = params.guided_decoding and params.structured_outputs
        if self.bad_words:
            params.bad_words_token_ids = _bad_words_token_ids(tokenizer, self.bad_words)
        return params

    def _check_without_tokenizer(self) -> None:
        instead = {"stop": "stop_token_ids", "bad_words": "logit_bias or allowed_token_ids"}
        for name, other in instead.items():
            if getattr(self, name):
                raise ValueError(
                    f"SamplingParams.{name}={getattr(self, name)!r} needs the tokenizer, which "
                    "skip_tokenizer_init=True leaves out (outputs are not detokenized, as with "
                    f"detokenize=False): use {other} instead"
                )

    def _check_samples(self) -> None:
        _check(
            _is_int(self.n) and 1 <= self.n <= _MAX_N, "n", self.n, f"an integer in [1, {_MAX_N}]"
        )
        _check(
            self.best_of is None or (_is_int(self.best_of) and self.best_of == self.n),
            "best_of",
            self.best_of,
            f"None or n={self.n}: all n samples are returned, choosing the best of more is not "
            "supported",
        )
        k = self.truncate_prompt_tokens
        _check(
            k is None or (_is_int(k) and (k == -1 or 1 <= k <= _INT32_MAX)),
            "truncate_prompt_tokens",
            k,
            "None, -1 (max_model_len) or a positive integer",
        )

    def _check_sampling(self) -> None:
        _check(
            self.max_tokens is None
            or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= _INT32_MAX),
            "max_tokens",
            self.max_tokens,
            f"None or an integer in [1, {_INT32_MAX}]",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or _INT32_MAX),
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
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
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= _MAX_LOGPROBS),
            "prompt_logprobs",
            self.prompt_logprobs,
            f"None or an integer in [0, {_MAX_LOGPROBS}]",
        )
        if self.stop and not self.detokenize:
            raise ValueError(
                f"SamplingParams.stop={self.stop!r} needs detokenize=True: stop strings are "
                "matched in the detokenized text"
            )

    def _check_logit_controls(self) -> None:
        bias = self.logit_bias
        _check(
            bias is None
            or (
                isinstance(bias, dict)
                and all(_is_token_id(t) and _is_number(b) for t, b in bias.items())
            ),
            "logit_bias",
            bias,
            "None or a dict of token id -> finite number",
        )
        allowed = self.allowed_token_ids
        _check(
            allowed is None
            or (
                not isinstance(allowed, (str, bytes))
                and bool(allowed)
                and all(map(_is_token_id, allowed))
            ),
            "allowed_token_ids",
            allowed,
            "None or a non-empty list of token ids",
        )
        words = self.bad_words
        _check(
            words is None
            or (
                not isinstance(words, str) and all(isinstance(w, str) and w.strip() for w in words)
            ),
            "bad_words",
            words,
            "None or a list of non-blank strings",
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

    def sample(self, index: int) -> SamplingParams:
        """The params of the index-th of n samples: one sample, seed + index where a seed is set
        (seeded samples differ from each other and repeat from run to run); prompt logprobs with
        the first sample only."""
        params = copy.copy(self)  # keeps what `prepared` set
        params.n, params.best_of = 1, None
        if index:  # the prompt's logprobs come once, with the first sample: the others may share it
            params.prompt_logprobs = None
        if self.seed is not None:
            params.seed = (self.seed + index) % 2**63
        return params

    @property
    def pools_every_row(self) -> bool:
        """Whether its embedding needs every prompt row computed for it (mean pooling)."""
        return self.pooling is not None and self.pooling.pooling_type == "mean"

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

    @property
    def needs_output_tokens(self) -> bool:
        """Whether sampling a token reads the request's earlier output token ids on the host
        (penalties, bad words of several tokens): its steps run one at a time."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit is biased or masked for this request (some steps may still need none)."""
        return bool(
            self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
        )


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        if isinstance(value, int) and value.bit_length() > 128:  # whole, it could be 4,000 digits
            shown = f"<an integer of {value.bit_length()} bits>"
        else:
            text = repr(value)
            shown = text if len(text) <= 80 else text[:77] + "..."
        raise ValueError(f"SamplingParams.{name}={shown} is invalid: expected {expected}")


def _bad_words_token_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as it starts a text, and with a leading space where that encodes to
    another first token in as many tokens (a word in the middle of a text)."""
    banned: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        banned.append(bare)
        if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            banned.append(spaced)
    return tuple(ids for ids in banned if ids)


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


def _is_token_id(value: object) -> bool:
    return _is_int(value) and 0 <= value <= _INT32_MAX  # type: ignore[operator]


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
