"""The model registry: every supported architecture is one entry, builds through it, takes its
transformers checkpoint's tensors, and has a parity checkpoint; any other architecture is refused by
name, with the supported ones; docs/engine-api.md lists the same names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from engine_checkpoints import ARCHES, build_model, engine
from transformers import GPT2Config

from prefixgrove.engine.models.arch import ModelArch
from prefixgrove.engine.models.base import CausalLM
from prefixgrove.engine.models.ops import create_ops
from prefixgrove.engine.models.registry import MODELS, model_class

ENGINE_API = Path(__file__).parents[2] / "docs" / "engine-api.md"


def parity_checkpoint(architecture: str) -> str:
    """The engine_checkpoints.ARCHES entry whose transformers class is `architecture`."""
    for key, make in ARCHES.items():
        if make()[1].__name__ == architecture:
            return key
    raise AssertionError(f"{architecture} has no checkpoint in engine_checkpoints.ARCHES")


def test_an_unsupported_architecture_is_refused_naming_it_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as refused:
        model_class("GPT2LMHeadModel")
    for supported in MODELS:
        assert supported in str(refused.value)


def test_a_foreign_config_is_refused_by_its_architecture_before_its_shapes_are_read(
    tmp_path: Path,
) -> None:
    # GPT-2's config has no intermediate_size: reading its shapes first would be an AttributeError
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        engine(str(tmp_path))


@pytest.mark.parametrize("architecture", list(MODELS))
def test_every_registered_architecture_has_a_parity_checkpoint(architecture: str) -> None:
    assert parity_checkpoint(architecture) in ARCHES


@pytest.mark.parametrize("architecture", list(MODELS))
def test_every_registered_architecture_builds_and_loads_its_transformers_weights(
    architecture: str,
) -> None:
    hf = build_model(parity_checkpoint(architecture), architectures=[architecture])
    arch = ModelArch.from_hf_config(hf.config)
    net = model_class(architecture)(arch, 64, create_ops("torch"))
    assert isinstance(net, CausalLM)
    net.load_weights(hf.state_dict().items())  # ValueError for a tensor with no place or missing
    assert len(net.layers) == arch.num_layers


def test_engine_api_lists_the_registered_architectures() -> None:
    paragraph = re.search(
        r"^Supported architectures.*?(?:\n\n|\Z)", ENGINE_API.read_text(), re.M | re.S
    )
    assert paragraph is not None, "docs/engine-api.md has no 'Supported architectures' paragraph"
    listed = re.findall(r"`(\w+For\w+)`", paragraph.group(0))
    assert listed == list(MODELS)
