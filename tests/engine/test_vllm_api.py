"""vLLM's offline API as its users write it: LLM(...) arguments taken over, accepted or refused by
name; the checkpoint's generation_config.json as the default sampling and its EOS ids; a
progress-bar callable; RequestOutput.metrics on every path; skip_tokenizer_init."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import EOS_IDS, engine, greedy, random_prompts, run, save_checkpoint
from tqdm import tqdm

from prefixgrove import LLM, RequestOutput, SamplingParams


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
    assert llm.config.enable_prefix_caching is False
    assert llm.config.cache.num_blocks == 64


@pytest.mark.parametrize(
    ("argument", "value"),
    [("pipeline_parallel_size", 2), ("quantization", "awq"), ("tokenizer_mode", "mistral"),
     ("download_dir", "/tmp/models")],
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


def test_generation_config_spelling_out_transformers_default_top_k_leaves_it_alone(
    tmp_path: Path,
) -> None:
    """vLLM takes over what differs from transformers' GenerationConfig defaults (top_k=50)."""
    path = save_checkpoint("llama3", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "top_p": 0.8}))
    defaults = LLM(path, attention_backend="torch").get_default_sampling_params()
    assert (defaults.top_k, defaults.top_p) == (SamplingParams().top_k, 0.8)


def test_generation_config_vllm_keeps_sampling_params_defaults_and_overrides_go_on_top(
    tmp_path: Path,
) -> None:
    path = save_checkpoint("llama3", tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3})
    )
    own = LLM(path, generation_config="vllm").get_default_sampling_params()
    assert (own.temperature, own.top_p, own.max_tokens) == (1.0, 1.0, SamplingParams().max_tokens)
    override = {"temperature": 0.2, "max_new_tokens": 5}
    mixed = LLM(path, override_generation_config=override).get_default_sampling_params()
    assert (mixed.temperature, mixed.top_p, mixed.max_tokens) == (0.2, 0.9, 5)


def test_a_generation_config_that_cannot_be_used_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"generation_config='/elsewhere' is not supported"):
        LLM("tiny-random-llama", generation_config="/elsewhere")
    with pytest.raises(ValueError, match=r"default sampling .* SamplingParams.temperature=-1"):
        LLM("tiny-random-llama", override_generation_config={"temperature": -1})


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_checkpoint("llama3", tmp_path)
    return tmp_path


def _free_run(path: Path) -> tuple[list[int], list[int]]:
    """A prompt and its greedy continuation, EOS ignored, cut before any of the model's own EOS."""
    prompt = random_prompts([11], seed=5)[0]
    [out] = run(engine(str(path)), [prompt], greedy(10, ignore_eos=True))
    tokens = out.outputs[0].token_ids
    cut = next((k for k, t in enumerate(tokens) if t in EOS_IDS), len(tokens))
    return prompt, tokens[:cut]


@pytest.mark.parametrize("as_list", [False, True], ids=["int", "list"])
def test_generation_config_eos_token_id_ends_generation(checkpoint: Path, as_list: bool) -> None:
    prompt, tokens = _free_run(checkpoint)
    at = next(k for k, t in enumerate(tokens) if k >= 2 and t not in tokens[:k])
    eos = [tokens[at]] if as_list else tokens[at]
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    llm = engine(str(checkpoint))
    [stopped] = run(llm, [prompt], greedy(10))
    [ignored] = run(llm, [prompt], greedy(len(tokens), ignore_eos=True))
    assert stopped.outputs[0].token_ids == tokens[: at + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert ignored.outputs[0].token_ids == tokens


def test_an_invalid_generation_config_eos_token_id_is_named(checkpoint: Path) -> None:
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id='</s>'"):
        engine(str(checkpoint))


def _assert_metrics_in_order(out: RequestOutput) -> None:
    m = out.metrics
    assert m is not None
    assert m.first_scheduled_time is not None and m.first_token_time is not None
    assert m.finished_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time


@pytest.mark.parametrize("grouping", [True, False], ids=["grouped", "ungrouped"])
def test_every_output_carries_its_request_metrics(grouping: bool) -> None:
    llm = engine(
        "tiny-random-llama", enable_prefix_grouping=grouping, enable_prefix_caching=grouping
    )
    shared = random_prompts([40], seed=6)[0]
    prompts = [shared + tail for tail in random_prompts([3, 5, 4], seed=7)]
    outs = run(llm, prompts, greedy(3, ignore_eos=True))
    assert (sum(o.num_cached_tokens for o in outs) > 0) == grouping
    for out in outs:
        _assert_metrics_in_order(out)


def test_n_samples_report_one_request_from_the_first_start_to_the_last_end() -> None:
    llm = engine("tiny-random-llama")
    [out] = run(llm, [[1, 2, 3, 4, 5]], SamplingParams(n=3, max_tokens=3, seed=1))
    assert len(out.outputs) == 3
    _assert_metrics_in_order(out)


@pytest.fixture(scope="module")
def no_tokenizer() -> LLM:
    return engine("tiny-random-llama", skip_tokenizer_init=True)


def test_skip_tokenizer_init_generates_token_ids_without_text(no_tokenizer: LLM) -> None:
    prompts = random_prompts([6, 9], seed=8)
    params = greedy(4, ignore_eos=True, logprobs=2)
    expected = run(engine("tiny-random-llama"), prompts, params)
    outs = run(no_tokenizer, prompts, params)
    assert no_tokenizer.get_tokenizer() is None
    for got, want in zip(outs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == "" and got.prompt is None
        assert got.outputs[0].logprobs is not None
        assert all(lp.decoded_token is None for e in got.outputs[0].logprobs for lp in e.values())


def test_skip_tokenizer_init_refuses_a_text_prompt_by_position(no_tokenizer: LLM) -> None:
    prompts = [{"prompt_token_ids": [1, 2, 3]}, "text"]
    with pytest.raises(ValueError, match=r"prompt 1 is text, but skip_tokenizer_init=True"):
        no_tokenizer.generate(prompts, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        no_tokenizer.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)


@pytest.mark.parametrize(
    "field", [{"stop": ["a"]}, {"bad_words": ["a"]}], ids=["stop", "bad_words"]
)
def test_skip_tokenizer_init_refuses_what_needs_text(no_tokenizer: LLM, field: dict) -> None:
    name = next(iter(field))
    with pytest.raises(ValueError, match=rf"prompt 0: SamplingParams.{name}=.*needs the tokenizer"):
        run(no_tokenizer, [[1, 2, 3]], greedy(2, **field))


def test_a_large_job_is_handed_to_the_engine_a_window_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine holds at most a window of requests (each its own sequence and params), topped
    up as they finish, groups whole; the outputs are those of handing it everything at once."""
    import prefixgrove.engine.llm as llm_module

    shared = random_prompts([40], seed=11)[0]
    prompts = [shared + tail for tail in random_prompts([3] * 12, seed=12)]
    prompts += random_prompts([5] * 30, seed=13)
    whole = run(engine("tiny-random-llama"), prompts, greedy(2, ignore_eos=True))
    monkeypatch.setattr(llm_module, "feed_window", lambda max_num_seqs: 8)
    llm = engine("tiny-random-llama")
    held: list[int] = []
    step = llm.engine.step

    def counting_step() -> list[RequestOutput]:
        held.append(len(llm.engine.intake.requests))
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    windowed = run(llm, prompts, greedy(2, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in windowed] == [o.outputs[0].token_ids for o in whole]
    assert max(held) <= 12 + 8  # the group of 12 went in whole; otherwise 8 at most
    assert max(held[-10:]) <= 8 and len(held) > 10
