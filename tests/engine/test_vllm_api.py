"""vLLM's offline API as its users write it: LLM(...) arguments taken over, accepted or refused by
name; the checkpoint's generation_config.json as the default sampling; a progress-bar callable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import save_checkpoint
from tqdm import tqdm

from prefixgrove import LLM, SamplingParams


def test_vllm_arguments_that_mean_something_here_are_taken_over() -> None:
    llm = LLM(
        model="tiny-random-llama",
        enable_prefix_caching=False,
        num_gpu_blocks_override=64,
        tensor_parallel_size=1,
        trust_remote_code=False,
        swap_space=4,
        disable_log_stats=True,
    )
    assert llm.config.enable_prefix_grouping is False
    assert llm.config.cache.num_blocks == 64


@pytest.mark.parametrize(
    ("argument", "value"),
    [("tensor_parallel_size", 2), ("quantization", "awq"), ("trust_remote_code", True),
     ("download_dir", "/tmp/models"), ("skip_tokenizer_init", True)],
)  # fmt: skip
def test_a_vllm_argument_that_asks_for_what_is_not_done_here_is_refused_by_name(
    argument: str, value: Any
) -> None:
    with pytest.raises(ValueError, match=f"{argument}={value!r} is not supported"):
        LLM("tiny-random-llama", **{argument: value})


def test_an_unknown_argument_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown engine argument.*no_such_option"):
        LLM("tiny-random-llama", no_such_option=1)


def test_generation_config_gives_the_default_sampling_params(tmp_path: Path) -> None:
    path = save_checkpoint("llama3", tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3, "do_sample": True})
    )
    llm = LLM(path, attention_backend="torch")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, 3)
    [out] = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 3


def test_without_generation_config_the_defaults_are_sampling_params_own() -> None:
    llm = LLM("tiny-random-llama")
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_use_tqdm_takes_a_progress_bar_callable() -> None:
    bars: list[dict[str, Any]] = []

    def progress(**kwargs: Any) -> tqdm:
        bars.append(kwargs)
        return tqdm(disable=True, **{k: v for k, v in kwargs.items() if k != "disable"})

    llm = LLM("tiny-random-llama")
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=progress)
    assert [b["total"] for b in bars] == [2]


def test_a_prompt_that_is_not_unicode_text_is_refused_by_position() -> None:
    llm = LLM("tiny-random-llama")
    with pytest.raises(ValueError, match="prompt 1 holds a lone surrogate"):
        llm.generate(["fine", "bad \ud800 text"], SamplingParams(max_tokens=1), use_tqdm=False)
