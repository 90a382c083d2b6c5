"""Which part of each weight a tensor-parallel rank holds, and how it takes that part from a
checkpoint's tensor or from a whole random one.

A parameter is one or more checkpoint tensors stacked along one dimension (q, k, v in one matrix;
gate and up in another). Each of them is cut the same way on every rank: `parts` equal slices along
`dim`, the rank holding slice `index`. Column-parallel layers cut dim 0 (heads, columns), row-parallel
layers dim 1; KV heads are replicated where there are fewer of them than ranks (several ranks hold
the same head); the vocabulary is cut in slices of ceil(vocab / ranks) rows, the last padded with
zero rows. With one rank every cut is the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arch import ModelArch


@dataclass(frozen=True)
class Cut:
    dim: int = 0
    parts: int = 1
    index: int = 0

    def local_len(self, full_len: int) -> int:
        return -(-full_len // self.parts)

    def bounds(self, full_len: int) -> tuple[int, int]:
        """(start, length) of this rank's slice within the tensor; shorter than local_len only
        where the last slices run past the end (a vocabulary that does not divide)."""
        size = self.local_len(full_len)
        start = min(self.index * size, full_len)
        return start, min(size, full_len - start)

    def applies_to(self, shape: torch.Size | tuple[int, ...], full_len: int) -> bool:
        """Whether a tensor of `shape` is cut: a per-channel scale of a row-parallel layer, or a
        per-tensor one, has no such dimension and is every rank's whole."""
        return self.parts > 1 and len(shape) > self.dim and shape[self.dim] == full_len

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole tensor, zero-padded to local_len."""
        full_len = full.shape[self.dim]
        if not self.applies_to(full.shape, full_len):
            return full
        start, length = self.bounds(full_len)
        return self.pad(full.narrow(self.dim, start, length), full_len)

    def pad(self, part: torch.Tensor, full_len: int) -> torch.Tensor:
        """A slice read by `bounds`, zero-padded to local_len (the vocabulary's last slice)."""
        missing = self.local_len(full_len) - part.shape[self.dim]
        if missing <= 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)


@dataclass(frozen=True)
class Piece:
    shard: str  # the checkpoint tensor's shard name ('' for an unfused parameter)
    full_len: int  # its length along the layout's dim, whole
    cut: Cut


@dataclass(frozen=True)
class ParamLayout:
    """A parameter as its pieces stacked along `dim`, each cut for this rank."""

    dim: int
    pieces: tuple[Piece, ...]

    def piece(self, shard: str) -> Piece:
        return next(p for p in self.pieces if p.shard == shard)

    def local_offset(self, shard: str) -> int:
        """Where this rank's part of `shard` starts in the local parameter."""
        offset = 0
        for p in self.pieces:
            if p.shard == shard:
                return offset
            offset += p.cut.local_len(p.full_len)
        raise KeyError(shard)

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's parameter from the whole (unsharded) one: each piece's slice, stacked. A
        tensor without the cut dimension (a row-parallel layer's per-channel scales) is whole."""
        total = sum(p.full_len for p in self.pieces)
        uncut = full.dim() <= self.dim or full.shape[self.dim] != total
        if uncut or all(p.cut.parts == 1 for p in self.pieces):
            return full
        parts, offset = [], 0
        for p in self.pieces:
            parts.append(p.cut.take(full.narrow(self.dim, offset, p.full_len)))
            offset += p.full_len
        return torch.cat(parts, dim=self.dim)

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(p.full_len for p in self.pieces)
        return tuple(shape)


def block_cut(name: str, cut: Cut, full_len: int, block: int) -> tuple[Cut, int]:
    """The cut of a block-scaled weight's scales (one per `block` rows or columns), given its
    weight's cut: the same slice of blocks, which exists only where this rank's slice of the weight
    starts and ends on block edges; ValueError naming the tensor otherwise."""
    local = cut.local_len(full_len)
    if full_len % cut.parts or local % block:
        raise ValueError(
            f"{name}: a cut of {full_len} into {cut.parts} slices of {local} does not keep the "
            f"{block}x{block} scale blocks whole; choose a tensor_parallel_size whose slices are "
            f"multiples of {block}"
        )
    return cut, full_len // block


def whole(length: int) -> ParamLayout:
    return ParamLayout(0, (Piece("", length, Cut()),))


def check_tensor_parallel(arch: ModelArch, size: int) -> None:
    """ValueError naming the dimension that `size` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size}: must be at least 1")
    rules = [
        ("num_attention_heads", arch.num_heads, arch.num_heads % size == 0),
        ("intermediate_size", arch.intermediate_size, arch.intermediate_size % size == 0),
        (
            "num_key_value_heads",
            arch.num_kv_heads,
            arch.num_kv_heads % size == 0 or size % arch.num_kv_heads == 0,
        ),
    ]
    if arch.moe is not None:
        for name, value in (
            ("moe_intermediate_size", arch.moe.intermediate_size),
            ("shared_expert_intermediate_size", arch.moe.shared_intermediate_size),
        ):
            rules.append((name, value, value % size == 0))
    for name, value, ok in rules:
        if not ok:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide {arch.architecture}'s "
                f"{name}={value}: choose a size that divides it"
            )


def local_arch(arch: ModelArch, size: int) -> ModelArch:
    """The shapes one rank's layers have: its heads, its KV heads (one where they are
    replicated), its share of the MLP's columns."""
    if size == 1:
        return arch
    from dataclasses import replace

    return replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=max(1, arch.num_kv_heads // size),
        intermediate_size=arch.intermediate_size // size,
    )


def kv_head_cut(arch: ModelArch, size: int, rank: int) -> Cut:
    """KV heads split over the ranks, or, with fewer heads than ranks, the one head that serves
    this rank's query heads (rank r's queries are heads [r*h, (r+1)*h) of the whole)."""
    if arch.num_kv_heads >= size:
        return Cut(0, size, rank)
    return Cut(0, arch.num_kv_heads, rank * arch.num_kv_heads // size)
