"""`LLM.embed` on decoder-based embedding models: the model's last hidden states (after its final norm)
pooled from the last token or the mean of all, normalized or not, cut to `dimensions`, equal to
transformers' own last_hidden_state pooled the same way (fp32, CPU); prompts sharing an instruction
prefix share its computation and get the same embeddings; a sentence-transformers checkout's
pooling config is the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_checkpoints import save_checkpoint
from transformers import AutoModel, AutoTokenizer

from prefixgrove import LLM, PoolingParams, SamplingParams
from prefixgrove.catalog.pooling import pooling_defaults

INSTRUCT = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
TEXTS = [INSTRUCT + q for q in ("capital of France", "how tall is Everest", "define entropy")]
TEXTS.append("a text of its own")


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llm(checkpoint: str) -> LLM:
    return LLM(checkpoint, device="cpu", dtype="float32", num_gpu_blocks_override=64)


def transformers_embedding(checkpoint: str, text: str, pooling: str) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**ids).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(
    llm: LLM, checkpoint: str, pooling: str
) -> None:
    outputs = llm.embed(TEXTS, PoolingParams(pooling_type=pooling, normalize=False), use_tqdm=False)
    for text, out in zip(TEXTS, outputs, strict=True):
        expected = transformers_embedding(checkpoint, text, pooling)
        got = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == expected.numel()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_normalize_and_dimensions_cut_then_scale_to_unit_length(llm: LLM) -> None:
    [raw] = llm.embed(TEXTS[:1], PoolingParams(normalize=False), use_tqdm=False)
    [cut] = llm.embed(TEXTS[:1], PoolingParams(dimensions=16), use_tqdm=False)
    vector = torch.tensor(raw.outputs.embedding[:16])
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), vector / vector.norm())
    with pytest.raises(ValueError, match="dimensions=100000 is more than the model's"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=100_000), use_tqdm=False)


def test_prompts_sharing_an_instruction_share_its_computation(checkpoint: str) -> None:
    """Last-token pooling takes a group's shared prefix as generation does, and gives the
    embeddings each prompt gets alone."""
    grouped = LLM(checkpoint, device="cpu", dtype="float32", num_gpu_blocks_override=64)
    alone = LLM(checkpoint, device="cpu", dtype="float32", num_gpu_blocks_override=64,
                enable_prefix_grouping=False, enable_prefix_caching=False)  # fmt: skip
    shared = grouped.embed(TEXTS, use_tqdm=False)
    assert grouped.engine.metrics.prefix_tokens_reused > 0
    for a, b in zip(shared, alone.embed(TEXTS, use_tqdm=False), strict=True):
        torch.testing.assert_close(
            torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding)
        )


def test_an_embedding_request_asks_for_nothing_it_would_generate() -> None:
    with pytest.raises(ValueError, match="logprobs cannot be set"):
        SamplingParams(max_tokens=1, logprobs=2, pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling_type='cls' is not supported"):
        PoolingParams(pooling_type="cls")


def test_a_sentence_transformers_checkout_says_its_pooling(tmp_path: Path) -> None:
    assert pooling_defaults(str(tmp_path)) == ("last", True)  # no config: last token, normalized
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    assert pooling_defaults(str(tmp_path)) == ("mean", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert pooling_defaults(str(tmp_path)) == ("mean", True)
