"""Head sizes the Triton kernels do not tile (80, 96 as Phi-3-mini, 112) run on the torch backend,
which 'auto' picks for them, and compute what transformers computes; asking for Triton says why not."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_checkpoints import build_model, engine, greedy, random_prompts, run, save_checkpoint
from test_hf_parity import hf_greedy

from prefixgrove.engine.config import kernels_take

MAX_TOKENS = 8


@pytest.mark.parametrize("head_dim", [80, 96, 112])
def test_a_head_size_off_the_kernels_tiles_runs_on_torch_and_matches_transformers(
    tmp_path: Path, head_dim: int
) -> None:
    path = save_checkpoint("llama3", tmp_path, head_dim=head_dim)
    model = build_model("llama3", head_dim=head_dim)
    llm = engine(path, attention_backend="auto")
    assert llm.config.attention_backend == "torch"
    prompts = random_prompts((5, 23), seed=2)
    for prompt, out in zip(prompts, run(llm, prompts, greedy(MAX_TOKENS)), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS)


def test_triton_for_such_a_head_size_is_refused_with_the_way_out(tmp_path: Path) -> None:
    path = save_checkpoint("llama3", tmp_path, head_dim=96)
    with pytest.raises(ValueError, match=r"head_dim=96 .* use attention_backend='torch'"):
        engine(path, attention_backend="triton")


def test_the_kernels_take_powers_of_two_from_32_to_256() -> None:
    assert [d for d in (16, 32, 64, 80, 96, 128, 256, 512) if kernels_take(d)] == [32, 64, 128, 256]
