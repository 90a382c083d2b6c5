"""Past its keys and values, the model's last layer computes only the rows that end with a new token:
the rows of a prefill chunk that sample nothing feed no later layer, so their attention, o_proj and MLP
there would be thrown away. Narrowing changes no token and no log-probability."""

from __future__ import annotations

import pytest
import torch
from engine_checkpoints import engine, greedy, random_prompts, run, shared_prefix_job

from prefixgrove import LLM

PARAMS = greedy(6, ignore_eos=True, logprobs=3)


def every_row_to_the_end(llm: LLM) -> None:
    """Turns narrowing off: every step computes the last layer for all its rows, as before it."""
    llm.engine.runner.builder.narrow_last_layer = False


def mlp_rows(llm: LLM, layer: int) -> list[int]:
    """Rows each step's MLP of `layer` computes, recorded step by step."""
    rows: list[int] = []
    mlp = llm.engine.runner.model.layers[layer].mlp
    mlp.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    return rows


@pytest.fixture(scope="module")
def job() -> list[list[int]]:
    return shared_prefix_job(num_prefixes=3, per_prefix=4) + random_prompts([5, 40], seed=3)


@pytest.mark.parametrize(
    ("backend", "budget"),
    [("torch", 512), ("torch", 48), ("triton", 48)],
    ids=["torch-whole-prompts", "torch-chunked", "triton-chunked"],
)
def test_narrowing_leaves_tokens_and_logprobs_unchanged(llama_dir, job, backend, budget):
    if backend == "triton":
        # Triton's interpreter runs every kernel program by program on the CPU: two groups of two
        # and the two loose prompts still take chunked, grouped and ungrouped rows through it.
        job = shared_prefix_job(num_prefixes=2, per_prefix=2) + job[-2:]
    kwargs = {"attention_backend": backend, "max_num_batched_tokens": budget, "max_num_seqs": 16}
    full = engine(llama_dir, **kwargs)
    every_row_to_the_end(full)
    expected = run(full, job, PARAMS)
    got = run(engine(llama_dir, **kwargs), job, PARAMS)
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        assert b.token_ids == a.token_ids, want.request_id
        assert a.logprobs is not None and b.logprobs is not None
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert step_b.keys() == step_a.keys()
            for token, lp in step_a.items():
                assert step_b[token].logprob == pytest.approx(lp.logprob, abs=1e-5)


def test_last_layer_mlp_runs_once_per_generated_token(llama_dir, job):
    llm = engine(llama_dir, max_num_batched_tokens=48, max_num_seqs=16)
    first, last = mlp_rows(llm, 0), mlp_rows(llm, -1)
    outs = run(llm, job, PARAMS)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert sum(last) == generated
    assert sum(first) > 2 * generated  # the prompts' rows, computed in every layer but the last
    assert len(last) == len(first)  # steps that sample nothing still run the last layer's K/V


def test_a_step_that_samples_nothing_still_caches_the_last_layer(llama_dir):
    """A prompt prefilled over several chunks: the early chunks sample nothing, and the last layer's
    keys and values they cache must be the same as without narrowing."""
    prompt = random_prompts([100], seed=5)
    caches = []
    for narrow in (False, True):
        llm = engine(
            llama_dir, max_num_batched_tokens=32, max_num_seqs=16, enable_prefix_grouping=False
        )
        if not narrow:
            every_row_to_the_end(llm)
        run(llm, prompt, greedy(1))
        k_cache, v_cache = llm.engine.runner.kv_caches[-1]
        caches.append((k_cache.clone(), v_cache.clone()))
    torch.testing.assert_close(caches[1][0], caches[0][0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1][1], caches[0][1], rtol=0, atol=0)
