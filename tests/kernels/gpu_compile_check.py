"""Compiles every attention kernel configuration for an NVIDIA GPU without one (Triton, offline).

Usage: python tests/kernels/gpu_compile_check.py SM [DTYPES]  (SM e.g. 80 or 90; DTYPES e.g.
bfloat16,float32). On targets with FP8 (SM 89 and up) the attention kernels are also compiled over an
FP8 KV cache, whose scores take e4m3 queries on the FP8 tensor cores. Points Triton at a stand-in
driver for that target, plans real launches on CPU tensors with the launchers' own choices of
tile sizes, compiles them to cubin, and prints one JSON line per kernel (shared memory, registers,
spills, whether loads are pipelined). Exits non-zero if a kernel fails to compile or does not fit.
Must run in its own process without TRITON_INTERPRET (the test does that).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
FP8 = torch.float8_e4m3fn
FP8_SM = 89  # the first target with e4m3 conversions and FP8 tensor cores


class OfflineDriver:
    """Just enough of a Triton driver to compile (never launch) for a chosen target."""

    def __init__(self, sm: int) -> None:
        self.target = GPUTarget("cuda", sm, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def resource_usage(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = {k: re.search(rf"{k}:(\d+)", text) for k in ("REG", "LOCAL", "STACK")}
    return {k.lower(): int(m.group(1)) for k, m in found.items() if m}


def kv_scales(kv_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The scale arguments of a cache in kv_dtype: an FP8 cache's two, none for others."""
    return {"k_scale": torch.ones(1), "v_scale": torch.ones(1)} if kv_dtype == FP8 else {}


def paged_launches(dtype: torch.dtype, kv_dtype: torch.dtype) -> list[tuple[str, Any]]:
    from prefixgrove_kernels.paged_attention import paged_attention_launch

    out = []
    # (name, tokens, seqs, max_query_len, heads, kv heads, head_dim, block_size, cascade suffix;
    # "skip": the suffix pass beside suffix chunks finished in the prefix pass)
    shapes: list[tuple[str, int, int, int, int, int, int, int, bool | str]] = [
        ("decode", 256, 256, 1, 32, 8, 128, 16, False),
        ("decode_one_seq", 1, 1, 1, 32, 8, 128, 16, True),
        ("decode_suffix", 256, 256, 1, 32, 8, 128, 16, True),
        ("prefill", 2048, 4, 512, 32, 8, 128, 16, False),
        ("decode_d64_mha", 64, 64, 1, 8, 8, 64, 32, False),
        ("prefill_d256_g8", 512, 2, 256, 16, 2, 256, 16, True),
        ("prefill_skip_chunks", 4096, 20, 2000, 32, 8, 128, 16, "skip"),
    ]
    for name, tokens, seqs, max_q, heads, kv_heads, dim, block, suffix in shapes:
        q = torch.empty(tokens, heads, dim, dtype=dtype)
        cache = torch.empty(64, block, kv_heads, dim, dtype=kv_dtype)
        meta = zero_seqs(seqs, max_q, grouped=bool(suffix))
        state = {}
        if suffix:
            state = {
                "prefix_out": torch.empty(q.shape),
                "prefix_lse": torch.empty(q.shape[:2]),
                "skip_suffix_chunks": suffix == "skip",
            }
        launch = paged_attention_launch(
            q, cache, cache, torch.empty_like(q), meta, scale=0.1, **state, **kv_scales(kv_dtype)
        )
        out.append((f"paged/{name}", launch))
    return out


def _zero_rows(count: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of `count` rows as the metadata holds it, all zeros: cumulative query offsets
    [count + 1], lengths [count] and block tables [count, blocks] (the contents are never read:
    nothing launches)."""
    index = torch.zeros(count + 1, dtype=torch.int32)
    return index, index[:count], torch.zeros(count, blocks, dtype=torch.int32)


def zero_groups(num_groups: int, max_group_q: int) -> Any:
    """Groups of the given count and tile hint."""
    from prefixgrove_kernels.launch import CascadeMetadata

    cu_q, prefix_lens, tables = _zero_rows(num_groups, 500)
    return CascadeMetadata(group_cu_q=cu_q, group_prefix_lens=prefix_lens,
                           group_block_tables=tables, max_group_q=max_group_q)  # fmt: skip


def zero_seqs(count: int, max_query_len: int, grouped: bool) -> Any:
    """`count` sequences of the given query-length hint, with kv_start where `grouped`."""
    from prefixgrove_kernels.launch import PagedMetadata

    cu_q, lens, tables = _zero_rows(count, 160)
    return PagedMetadata(cu_seqlens_q=cu_q, seq_lens=lens, block_tables=tables,
                         max_query_len=max_query_len, kv_start=lens if grouped else None)  # fmt: skip


class CascadeShape(NamedTuple):
    """A decode step's grouped batch, compiled for the prefix pass and for cascade decode with the
    given splits (None: not compiled for that kernel)."""

    name: str
    rows: int  # query rows: one a sequence in decode
    groups: int
    max_group_q: int
    heads: int
    kv_heads: int
    head_dim: int
    prefix_splits: int | None = None
    decode_splits: int | None = None

    def q(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.rows, self.heads, self.head_dim, dtype=dtype)

    def cache(self, dtype: torch.dtype) -> torch.Tensor:  # the KV cache's dtype
        return torch.empty(64, 16, self.kv_heads, self.head_dim, dtype=dtype)

    def inputs(
        self, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """q, the KV cache and the groups' metadata, as both kernels take them."""
        return self.q(dtype), self.cache(kv_dtype), zero_groups(self.groups, self.max_group_q)


CASCADE_SHAPES = [
    CascadeShape("degree4", 256, 64, 4, 32, 8, 128, prefix_splits=1, decode_splits=2),
    CascadeShape("degree16", 256, 16, 16, 32, 8, 128, decode_splits=1),
    CascadeShape("degree16_split", 256, 16, 16, 32, 8, 128, prefix_splits=3, decode_splits=2),
    CascadeShape("degree64", 256, 4, 64, 32, 8, 128, prefix_splits=8),
    CascadeShape("one_group", 1, 1, 1, 32, 8, 128, prefix_splits=2, decode_splits=1),
    CascadeShape("d64_mha", 128, 8, 16, 8, 8, 64, prefix_splits=1, decode_splits=1),
    CascadeShape("d256_g8", 128, 4, 32, 16, 2, 256, prefix_splits=2, decode_splits=2),
    CascadeShape("g3", 96, 4, 16, 12, 4, 128, decode_splits=2),
]


def prefix_launches(dtype: torch.dtype, kv_dtype: torch.dtype) -> list[tuple[str, Any]]:
    from prefixgrove_kernels.cascade_attention import prefix_attention_launches
    from prefixgrove_kernels.launch import SuffixChunks

    out = []
    for shape in (s for s in CASCADE_SHAPES if s.prefix_splits is not None):
        q, cache, groups = shape.inputs(dtype, kv_dtype)
        launches, _, _ = prefix_attention_launches(
            q, cache, cache, groups, scale=0.1, num_splits=shape.prefix_splits,
            **kv_scales(kv_dtype),
        )  # fmt: skip
        out += [(f"prefix/{shape.name}/{i}", launch) for i, launch in enumerate(launches)]
    # A prefill step's prefix pass finishing its suffix chunks (16 chunks of 200 tokens a group).
    q = torch.empty(4 * 3200, 32, 128, dtype=dtype)
    cache = torch.empty(64, 16, 8, 128, dtype=kv_dtype)
    seqs = zero_seqs(64, 200, grouped=True)
    launches, _, _ = prefix_attention_launches(
        q, cache, cache, zero_groups(4, 3200), scale=0.1, out=torch.empty_like(q),
        suffix_chunks=SuffixChunks(torch.empty_like(q), seqs), **kv_scales(kv_dtype),
    )  # fmt: skip
    out += [(f"prefix/suffix_chunks/{i}", launch) for i, launch in enumerate(launches)]
    return out


def decode_launches(dtype: torch.dtype, kv_dtype: torch.dtype) -> list[tuple[str, Any]]:
    from prefixgrove_kernels.cascade_decode import cascade_decode_attention_launches

    out = []
    for shape in (s for s in CASCADE_SHAPES if s.decode_splits is not None):
        q, cache, groups = shape.inputs(dtype, kv_dtype)
        meta = zero_seqs(shape.rows, 1, grouped=True)
        launches = cascade_decode_attention_launches(
            q, cache, cache, torch.empty_like(q), meta, groups, scale=0.1,
            num_splits=shape.decode_splits, **kv_scales(kv_dtype),
        )  # fmt: skip
        out += [(f"cascade_decode/{shape.name}/{i}", launch) for i, launch in enumerate(launches)]
    return out


def gemma_launches(dtype: torch.dtype) -> list[tuple[str, Any]]:
    """Gemma's layers: soft-capped scores and a sliding window in every attention kernel (head
    size 256, two query heads a KV head), the paged kernel's prefill and suffix pass, the prefix
    pass (rows placed by their sequences) with and without suffix chunks, and cascade decode."""
    from prefixgrove_kernels.cascade_attention import prefix_attention_launches
    from prefixgrove_kernels.cascade_decode import cascade_decode_attention_launches
    from prefixgrove_kernels.launch import SuffixChunks
    from prefixgrove_kernels.paged_attention import paged_attention_launch

    shaping = {"scale": 0.0625, "softcap": 50.0, "window": 4096}
    q, cache = torch.empty(256, 8, 256, dtype=dtype), torch.empty(64, 16, 4, 256, dtype=dtype)
    out, decode, groups = torch.empty_like(q), zero_seqs(256, 1, True), zero_groups(16, 16)
    state = {"prefix_out": torch.empty(q.shape), "prefix_lse": torch.empty(q.shape[:2])}
    prefill = paged_attention_launch(q, cache, cache, out, zero_seqs(2, 128, False), **shaping)
    suffix = paged_attention_launch(q, cache, cache, out, decode, **state, **shaping)
    window, _, _ = prefix_attention_launches(
        q, cache, cache, groups, num_splits=1, query_seqs=decode, **shaping
    )
    chunks = SuffixChunks(out, zero_seqs(2, 128, True))
    fused, _, _ = prefix_attention_launches(
        q, cache, cache, zero_groups(2, 128), out=out, suffix_chunks=chunks, **shaping
    )
    one_pass = cascade_decode_attention_launches(
        q, cache, cache, out, decode, groups, num_splits=1, **shaping
    )
    return [
        ("paged/gemma_prefill", prefill),
        ("paged/gemma_suffix", suffix),
        ("prefix/gemma_window/0", window[0]),
        ("prefix/gemma_suffix_chunks/0", fused[0]),
        ("cascade_decode/gemma/0", one_pass[0]),
    ]


def merge_launches(dtype: torch.dtype) -> list[tuple[str, Any]]:
    from prefixgrove_kernels.merge_states import merge_attention_states_launch

    o = torch.empty(256, 32, 128, dtype=dtype)
    lse = torch.empty(256, 32)
    launch, _, _ = merge_attention_states_launch(o, lse, o, lse)
    return [("merge", launch)]


def main(sm: int, dtypes: list[torch.dtype]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile for a GPU", file=sys.stderr)
        return 2
    driver.set_active(OfflineDriver(sm))  # type: ignore[arg-type]
    failures = 0
    runs = [(dtype, dtype) for dtype in dtypes]
    if sm >= FP8_SM:
        runs += [(dtype, FP8) for dtype in dtypes]
    for dtype, kv_dtype in runs:
        planned = (
            paged_launches(dtype, kv_dtype)
            + prefix_launches(dtype, kv_dtype)
            + decode_launches(dtype, kv_dtype)
            + (merge_launches(dtype) + gemma_launches(dtype) if kv_dtype == dtype else [])
        )
        for name, launch in planned:
            record: dict[str, Any] = {
                "kernel": name, "dtype": str(dtype), "kv_dtype": str(kv_dtype), "sm": sm,
            }  # fmt: skip
            try:
                compiled = launch.compile()
            except Exception as e:  # report every failing configuration, not just the first
                failures += 1
                record["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(json.dumps(record), flush=True)
                continue
            record["shared"] = compiled.metadata.shared
            record["pipelined"] = "cp.async" in compiled.asm["ptx"]
            record["mma"] = next(
                (m for m in ("wgmma", "mma.sync") if m in compiled.asm["ptx"]), None
            )
            record |= resource_usage(compiled.asm["cubin"])
            if record["shared"] > SHARED_LIMIT.get(sm, SHARED_LIMIT[80]):
                failures += 1
                record["error"] = "shared memory over the limit"
            print(json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bfloat16", "float16", "float32"]
    sys.exit(
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 90, [getattr(torch, n) for n in names])
    )
