"""Counters of what the engine did, for benchmarks, logs and the worker's Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineMetrics:
    steps: int = 0
    # prompt tokens whose KV was computed (prefixes once, suffixes, recomputes)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # prompt tokens taken from a group's prefix or the prefix cache instead of being computed
    prefix_tokens_reused: int = 0
    # block references taken on a group's prefix or on cached blocks (one per sequence and block)
    kv_blocks_shared: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    decode_steps: int = 0  # steps whose batch was decode-only
    decode_seconds: float = 0.0  # wall time of those steps, CPU work included
    # KV entries attended over all decode-only steps (for bandwidth figures)
    decode_kv_tokens: int = 0
    mixed_seconds: float = 0.0  # wall time of steps with prefill work
    # steps and windows enqueued before the host had seen the previous one's tokens
    steps_launched_ahead: int = 0
    # output tokens jump-forward appended without a decoding step (a grammar allowed each alone)
    tokens_jumped: int = 0
    # CPU-only time between steps: scheduling, stop checks, finishing requests
    host_seconds: float = 0.0
    intake_seconds: float = 0.0  # validating and queueing requests (add_request / add_group)
