"""What the engine hands back for each request (vLLM's RequestOutput shape)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Logprob:
    """Log probability of one token, under the model's raw (unpenalised, untempered) distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the chosen token plus the top-n alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing comes before it), then as SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """When a request went through the engine (vLLM's RequestMetrics), in seconds since the epoch
    (time.time()); a stage it never reached (no token yet, not finished) is None."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time
    finished_time: float | None = None

    @classmethod
    def arriving(cls) -> RequestMetrics:
        now = time.time()
        return cls(arrival_time=now, last_token_time=now)

    def scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
            self.time_in_queue = now - self.arrival_time

    def token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    @staticmethod
    def of_samples(samples: list[RequestMetrics]) -> RequestMetrics:
        """One prompt's n samples as one request: its earliest start and its latest end."""

        def first(values: list[float | None]) -> float | None:
            return min((v for v in values if v is not None), default=None)

        def last(values: list[float | None]) -> float | None:
            return max((v for v in values if v is not None), default=None)

        arrival = min(m.arrival_time for m in samples)
        merged = RequestMetrics(
            arrival_time=arrival,
            last_token_time=max(m.last_token_time for m in samples),
            first_token_time=first([m.first_token_time for m in samples]),
            finished_time=last([m.finished_time for m in samples]),
        )
        scheduled = first([m.first_scheduled_time for m in samples])
        if scheduled is not None:
            merged.scheduled(scheduled)
        return merged


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # with finish_reason "error": why (its structured-output constraint could not be enforced); the
    # output is then not an answer, only what came before the failure
    error: str | None = None
    # with SamplingParams.pooling: the prompt's embedding (the sample's token is no answer then)
    embedding: list[float] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a shared prefix or the cache
    # Of them, those of the request's group's shared prefix: the job's plan decides them, whereas
    # cache hits depend on what ran before in the same engine (batch output lines report these).
    num_shared_prefix_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` hands back per prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
