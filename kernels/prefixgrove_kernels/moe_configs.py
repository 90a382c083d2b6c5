"""The tiles of `fused_moe`'s grouped GEMMs, chosen per token count from a table keyed by the device,
the experts' shape and the dtype (vLLM's per-device MoE config files, as one Python table).

| part of the key | holds                                                                        |
|-----------------|------------------------------------------------------------------------------|
| device          | the name torch reports ("NVIDIA H200"); "cpu" for CPU tensors               |
| experts         | E, the experts in the layer                                                  |
| n               | N, an expert's intermediate columns on this rank (w_down's last dimension)   |
| k               | K, the hidden size                                                           |
| dtype           | the activations' dtype ("bfloat16", "float16", "float32"), or "fp8_w8a8"     |

A key's entry maps token counts to tiles: a call with T tokens takes the tile of the smallest count
>= T, and the largest count's tile beyond them. A key without an entry takes the entry of a device
with the same SMs (SAME_SMS), else DEFAULT_TILES. One tile serves both GEMMs of a call, since both
walk the same padded runs of BLOCK_M rows.

TUNED_TILES holds the shapes tuned so far on the GPUs (benchmarks/RESULTS.md, "Mixture of experts").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from prefixgrove_kernels.checks import FP8_KV_DTYPE, is_power_of_two

MIN_BLOCK = 16  # tl.dot's smallest tile side
NUM_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int  # rows of a block: one expert's pairs (the alignment's padding unit)
    block_n: int  # output columns of a program
    block_k: int  # reduction step
    group_m: int = 1  # row blocks that walk the column blocks together (L2 reuse of the weights)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not is_power_of_two(value) or value < MIN_BLOCK:
                raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {self.group_m!r}")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {self.num_warps!r}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages!r}")

    def launch_options(self) -> dict[str, int]:
        """The grouped GEMM kernel's tile constexprs and launch options."""
        return {
            "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m, "num_warps": self.num_warps, "num_stages": self.num_stages,
        }  # fmt: skip


class MoeShape(NamedTuple):
    device: str
    experts: int
    n: int
    k: int
    dtype: str


TileTable = Mapping[int, MoeTileConfig]  # token count -> tile

# Untuned: small row blocks while few tokens reach each expert, then larger ones (vLLM's defaults).
DEFAULT_TILES: TileTable = {
    32: MoeTileConfig(block_m=16, block_n=64, block_k=64, group_m=1),
    512: MoeTileConfig(block_m=32, block_n=64, block_k=64, group_m=8),
    4096: MoeTileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
}
# `python benchmarks/moe.py tune` on the GPU named in the key (its best of the grid per token count);
# decode sizes (16-1,024 tokens) and prefill chunks (4,096 and 16,384) both tuned.
_QWEN3_30B_A3B_H200 = MoeShape("NVIDIA H200", 128, 768, 2048, "bfloat16")
_OLMOE_1B_7B_H200 = MoeShape("NVIDIA H200", 64, 1024, 2048, "bfloat16")
_MIXTRAL_8X7B_H200 = MoeShape("NVIDIA H200", 8, 14336, 4096, "bfloat16")
_PREFILL_TILES_H200 = MoeTileConfig(
    block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3
)
TUNED_TILES: Mapping[MoeShape, TileTable] = {
    _QWEN3_30B_A3B_H200: {
        16: MoeTileConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_stages=3),
        64: MoeTileConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_stages=3),
        256: MoeTileConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_stages=3),
        512: MoeTileConfig(
            block_m=64, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3
        ),
        1024: MoeTileConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_stages=3),
        4096: _PREFILL_TILES_H200,
        16384: _PREFILL_TILES_H200,  # a prefill step's chunk (max_num_batched_tokens)
    },
    _OLMOE_1B_7B_H200: {
        16: MoeTileConfig(
            block_m=16, block_n=64, block_k=128, group_m=8, num_warps=8, num_stages=3
        ),
        64: MoeTileConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_stages=3),
        256: MoeTileConfig(
            block_m=64, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3
        ),
        1024: MoeTileConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_stages=3),
        16384: _PREFILL_TILES_H200,  # 4,096 tokens too
    },
    _MIXTRAL_8X7B_H200: {
        16: MoeTileConfig(
            block_m=16, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3
        ),
        64: MoeTileConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_stages=3),
        256: MoeTileConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_stages=4),
        512: MoeTileConfig(
            block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4
        ),
        1024: _PREFILL_TILES_H200,  # and beyond: measured best at 4,096 (16,384 not tuned)
    },
}


# The H100 SXM is the H200's GH100 with less and slower HBM: the same 132 SMs, shared memory and
# clocks, so the same tiles fit it (tuned on an H200; no H100 has been lent since the table began).
SAME_SMS = {"NVIDIA H100 80GB HBM3": "NVIDIA H200"}


def tile_config(
    shape: MoeShape, tokens: int, tuned: Mapping[MoeShape, TileTable] = TUNED_TILES
) -> MoeTileConfig:
    """The tile for `tokens` tokens through experts of `shape`: from `tuned`'s entry for the shape,
    else for the same shape on a device with the same SMs (SAME_SMS), else from DEFAULT_TILES (see
    the module docstring)."""
    twin = shape._replace(device=SAME_SMS.get(shape.device, shape.device))
    table = tuned.get(shape) or tuned.get(twin, DEFAULT_TILES)
    if not table:
        raise ValueError(f"the tile table of {shape} has no entries")
    fitting = [count for count in table if count >= tokens]
    return table[min(fitting) if fitting else max(table)]


def moe_shape(x: torch.Tensor, w_gate_up: torch.Tensor) -> MoeShape:
    """The table key of a call: x [tokens, K] on its device, w_gate_up [E, 2N, K]."""
    on_gpu = x.device.type == "cuda"
    device = torch.cuda.get_device_name(x.device) if on_gpu else x.device.type
    fp8 = w_gate_up.dtype == FP8_KV_DTYPE
    dtype = "fp8_w8a8" if fp8 else str(x.dtype).removeprefix("torch.")
    experts, rows, hidden = w_gate_up.shape
    return MoeShape(device, experts, rows // 2, hidden, dtype)
