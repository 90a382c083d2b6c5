"""Random paged KV caches and batches, and a naive dense attention (float64) to check against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata

NUM_KV_HEADS = 2
# Largest difference from the float64 dense attention the interpreter's kernels may show, by dtype.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 5e-3}


@dataclass
class Cache:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    free: list[int]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def take(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.block_size)
        blocks, self.free = self.free[:count], self.free[count:]
        assert len(blocks) == count, "test cache too small"
        return blocks


def make_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Cache:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device, dtype)
    v = torch.randn(shape, generator=gen).to(device, dtype)
    return Cache(k, v, torch.randperm(num_blocks, generator=gen).tolist())


@dataclass(frozen=True)
class KernelShape:
    """The sizes an attention kernel is compiled for: head_dim, query heads per kv head (group), and
    keys per cache block. Printed as its test id, e.g. d64-g4-b16."""

    head_dim: int
    group: int
    block_size: int

    def __str__(self) -> str:
        return f"d{self.head_dim}-g{self.group}-b{self.block_size}"

    @property
    def num_heads(self) -> int:
        return NUM_KV_HEADS * self.group

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def cache(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> Cache:
        return make_cache(num_blocks, self.block_size, NUM_KV_HEADS, self.head_dim, dtype, device)


def over_shapes(*shapes: KernelShape) -> pytest.MarkDecorator:
    """Runs a test once per kernel shape, passed as its `shape` argument and named by it."""
    return pytest.mark.parametrize("shape", shapes, ids=str)


def random_queries(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_heads)
    return torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(device, dtype)


def block_table(rows: list[list[int]], num_blocks: int, device: torch.device) -> torch.Tensor:
    """[len(rows), width] int32; unused entries point at random real blocks, so reading one shows."""
    width = max([len(r) for r in rows] + [1]) + 1
    gen = torch.Generator().manual_seed(len(rows) + width)
    table = torch.randint(0, num_blocks, (len(rows), width), generator=gen, dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table.to(device)


def cumulative(lengths: list[int], device: torch.device, start: int = 0) -> torch.Tensor:
    cu = [start]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def gather(cache_t: torch.Tensor, blocks: list[int], positions: range) -> torch.Tensor:
    """Keys (or values) at the given positions, one position at a time: [n, num_kv_heads, d]."""
    size = cache_t.shape[1]
    rows = [cache_t[blocks[p // size], p % size] for p in positions]
    if not rows:
        return cache_t.new_zeros((0, *cache_t.shape[2:]))
    return torch.stack(rows)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook softmax attention in float64: q [n_q, H, d], k/v [n_k, H_kv, d], allowed [n_q, n_k].

    Returns (o [n_q, H, d], lse [n_q, H]); rows with nothing allowed give o = 0, lse = -inf.
    """
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", weights, v)
    return o, torch.logsumexp(scores, dim=-1).T


@dataclass
class Seq:
    """One sequence of a paged batch: q_len new tokens, seq_len keys in all, keys from kv_start."""

    q_len: int
    seq_len: int
    kv_start: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def positions(self) -> range:
        return range(self.seq_len - self.q_len, self.seq_len)


@dataclass
class Batch:
    q: torch.Tensor
    seqs: list[Seq]
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    kv_start: torch.Tensor
    block_tables: torch.Tensor

    @property
    def max_query_len(self) -> int:
        return max([s.q_len for s in self.seqs] + [0])

    def metadata(self, *, with_kv_start: bool = True, **fields: Any) -> PagedMetadata:
        """The batch as the kernels take it; `fields` replace any of its tensors or ints."""
        meta = {
            "cu_seqlens_q": self.cu_seqlens_q,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
            "max_query_len": self.max_query_len,
            "kv_start": self.kv_start if with_kv_start else None,
        }
        return PagedMetadata(**(meta | fields))


def make_batch(cache: Cache, seqs: list[Seq], num_heads: int, dtype: torch.dtype) -> Batch:
    """Gives each sequence without blocks its own blocks and builds the metadata tensors."""
    device = cache.k.device
    for s in seqs:
        if not s.blocks:
            s.blocks = cache.take(s.seq_len)
    q = random_queries(sum(s.q_len for s in seqs), num_heads, cache.k.shape[3], dtype, device)
    return Batch(
        q=q,
        seqs=seqs,
        cu_seqlens_q=cumulative([s.q_len for s in seqs], device),
        seq_lens=int32([s.seq_len for s in seqs], device),
        kv_start=int32([s.kv_start for s in seqs], device),
        block_tables=block_table([s.blocks for s in seqs], cache.k.shape[0], device),
    )


def dense_paged(
    batch: Batch, cache: Cache, scale: float, q: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal paged attention of a batch computed densely: (o, lse) in float64; q: the queries
    in place of the batch's own (the values an FP8 cache's kernels quantize them to)."""
    q = batch.q if q is None else q
    outs, lses = [], []
    start = 0
    for s in batch.seqs:
        keys = range(s.kv_start, s.seq_len)
        k = gather(cache.k, s.blocks, keys)
        v = gather(cache.v, s.blocks, keys)
        allowed = torch.tensor(
            [[key <= pos for key in keys] for pos in s.positions], dtype=torch.bool
        ).reshape(s.q_len, len(keys))
        o, lse = dense_attention(q[start : start + s.q_len], k, v, allowed, scale)
        outs.append(o)
        lses.append(lse)
        start += s.q_len
    return torch.cat(outs), torch.cat(lses)


@dataclass
class Groups:
    """Rows group_cu_q[g]:group_cu_q[g + 1] of q belong to group g, whose prefix is `blocks[g]`."""

    cu: list[int]
    prefix_lens: list[int]
    blocks: list[list[int]]

    def metadata(self, cache: Cache, max_group_q: int | None = None) -> CascadeMetadata:
        """The groups as the kernels take them (max_group_q: by default the largest group's rows)."""
        device = cache.k.device
        rows = [b - a for a, b in zip(self.cu, self.cu[1:], strict=False)]
        return CascadeMetadata(
            group_cu_q=int32(self.cu, device),
            group_prefix_lens=int32(self.prefix_lens, device),
            group_block_tables=block_table(self.blocks, cache.k.shape[0], device),
            max_group_q=max([*rows, 0]) if max_group_q is None else max_group_q,
        )


@dataclass
class Request:
    q_len: int
    own_len: int  # tokens after the prefix, new ones included


def build_cascade(
    cache: Cache, layout: list[tuple[int, list[Request]]], num_heads: int, dtype: torch.dtype
) -> tuple[Batch, Groups]:
    """layout: (prefix_len, requests) per group in batch order; prefix_len 0 means ungrouped."""
    seqs, cu, prefix_lens, prefix_tables = [], [0], [], []
    for prefix_len, requests in layout:
        shared = cache.take(prefix_len)
        for r in requests:
            blocks = shared + cache.take(r.own_len)
            seqs.append(Seq(r.q_len, prefix_len + r.own_len, prefix_len, blocks))
        cu.append(cu[-1] + sum(r.q_len for r in requests))
        prefix_lens.append(prefix_len)
        prefix_tables.append(shared)
    batch = make_batch(cache, seqs, num_heads, dtype)
    return batch, Groups(cu, prefix_lens, prefix_tables)
