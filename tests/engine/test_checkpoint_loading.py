"""Loading local Hugging Face directories: sharded safetensors, and clear errors for broken ones."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from engine_checkpoints import engine, greedy, random_prompts, run, save_checkpoint, token_ids
from safetensors.torch import load_file, save_file


def test_sharded_checkpoint_loads_and_generates_like_the_single_file(tmp_path: Path):
    single = save_checkpoint("qwen2", tmp_path / "single")
    sharded = save_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="200KB")
    shards = [n for n in os.listdir(sharded) if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    prompts = random_prompts((6, 30), seed=4)
    params = greedy(8, ignore_eos=True)
    assert token_ids(run(engine(sharded), prompts, params)) == token_ids(
        run(engine(single), prompts, params)
    )


def test_checkpoint_missing_a_tensor_fails_naming_it(tmp_path: Path):
    path = Path(save_checkpoint("llama3-untied", tmp_path))
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.mlp\.gate_up_proj"):
        engine(str(path))


def test_checkpoint_with_a_wrongly_shaped_tensor_fails_naming_it(tmp_path: Path):
    path = Path(save_checkpoint("llama3-untied", tmp_path))
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"norm\.weight.*\(7,\)"):
        engine(str(path))


def test_nonexistent_model_path_is_a_clear_value_error(tmp_path: Path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"no-such-model.*is not a built-in preset"):
        engine(missing)


def test_directory_without_weights_is_a_clear_value_error(tmp_path: Path):
    path = Path(save_checkpoint("llama3", tmp_path))
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        engine(str(path))


def test_unsupported_architecture_is_named(tmp_path: Path):
    path = Path(save_checkpoint("llama3", tmp_path))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        engine(str(path))


def test_a_checkpoint_without_tokenizer_files_asks_for_tokenizer(tmp_path: Path) -> None:
    path = save_checkpoint("llama3", tmp_path / "model")
    for f in (tmp_path / "model").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab")):
            f.unlink()
    with pytest.raises(ValueError, match=r"holds no tokenizer .*pass tokenizer=PATH"):
        engine(path)
    tokenizer_dir = save_checkpoint("llama3", tmp_path / "with-tokenizer")
    assert engine(path, tokenizer=tokenizer_dir).get_tokenizer() is not None
