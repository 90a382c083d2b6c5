"""Every engine feature on each family beyond the Llama one (Phi-3, the mixtures of experts and
Gemma, whose 80-token prefixes here outrun its 24-key sliding window), as the Llama family is
tested: a request's tokens and log-probs do not depend on whether its prefix was grouped (cascade
attention), computed before (prefix cache) or decoded in windows of 8 steps."""

from __future__ import annotations

import pytest
from engine_checkpoints import (
    assert_no_leak,
    assert_same_tokens_and_logprobs,
    engine,
    greedy,
    run,
    save_checkpoint,
    shared_prefix_job,
)

FAMILIES = ["phi3", "qwen3-moe", "qwen2-moe", "mixtral", "olmoe", "gemma2", "gemma3"]
PARAMS = greedy(10, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("arch", FAMILIES)
def test_grouped_cached_and_windowed_equal_plain_steps(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = save_checkpoint(arch, tmp_path_factory.mktemp(arch))
    job = shared_prefix_job(num_prefixes=2, per_prefix=3, prefix_len=80)
    plain = engine(
        model,
        enable_prefix_grouping=False,
        enable_prefix_caching=False,
        enable_cascade_attention=False,
        num_scheduler_steps=1,
    )
    expected = run(plain, job, PARAMS)
    grouped = engine(model, num_scheduler_steps=8)
    first = run(grouped, job, PARAMS)  # groups and cascade attention, windows of 8 steps
    again = run(grouped, job, PARAMS)  # every prefix now found in the prefix cache
    assert all(o.num_cached_tokens > 0 for o in again)
    assert grouped.engine.metrics.kv_blocks_shared > 0
    for outputs in (first, again):
        assert_same_tokens_and_logprobs(expected, outputs, tolerance=1e-4)
    assert_no_leak(grouped)
