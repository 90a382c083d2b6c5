"""Loading a model whole and as one rank's shard, and checking that the shard is the whole's cut:
the tensor-parallel tests of safetensors checkpoints and of GGUF files share these."""

from __future__ import annotations

import torch

from prefixgrove.engine.config import EngineConfig
from prefixgrove.engine.models.base import CausalLM
from prefixgrove.engine.models.loader import load_model
from prefixgrove.engine.models.ops import create_ops
from prefixgrove.engine.parallel.group import TensorParallel


def load_on_cpu(model: str, parallel: TensorParallel, quantization: str | None = None) -> CausalLM:
    """`model` as the engine loads it in fp32 on the CPU (torch ops, seed 0), or `parallel`'s
    rank's shard of it; loading calls no collective, so any rank loads in this process."""
    config = EngineConfig.create(model, device="cpu", dtype="float32", quantization=quantization)
    return load_model(
        model,
        config.model.arch,
        dtype=torch.float32,
        device="cpu",
        max_positions=64,
        seed=0,
        ops=create_ops("torch"),
        quantization=config.model.quantization,
        parallel=parallel,
    )


def assert_shard_is_cut_of_whole(
    shard: CausalLM, whole: dict[str, torch.Tensor], rank_name: str
) -> None:
    """Every parameter of `shard` equals its layout's cut of the same parameter of `whole`."""
    for name, param in shard.named_parameters():
        layout = shard.layout(name)
        expected = whole[name] if layout is None else layout.local_of_full(whole[name])
        assert torch.equal(param.float(), expected.float()), f"{rank_name}: {name}"
