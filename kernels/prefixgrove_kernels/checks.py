"""Host-side argument checks shared by the attention launchers.

Every check raises ValueError (or TypeError for dtypes) naming the argument, what it was and what is
accepted, before anything reaches a kernel, where a wrong stride means silently wrong numbers.
"""

from __future__ import annotations

import torch

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A paged cache is in the queries' dtype, or in FP8 e4m3 with one float32 scale per cache (a stored code
# c stands for c * scale; |c| <= FP8_MAX)
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # the floor of a per-row FP8 scale: an all-zero row keeps a finite one
MIN_HEAD_DIM = 32
MAX_HEAD_DIM = 256
MIN_BLOCK_SIZE = 8


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        accepted = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: {accepted}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the queries are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")


def check_index(name: str, t: torch.Tensor, *, ndim: int, device: torch.device) -> None:
    """Index tensors are int32; block tables may be row slices of a bigger table (unit last stride)."""
    check_tensor(name, t, ndim=ndim, dtypes=(torch.int32,), device=device, contiguous=ndim == 1)
    if ndim == 2:
        check_unit_last_stride(name, t)


def check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")


def check_queries(q: torch.Tensor, kernel: bool = True) -> None:
    """q: [num_tokens, num_heads, head_dim]; token and head strides are free (views of a qkv).
    kernel: the Triton kernels' head sizes too (the torch references take any)."""
    check_tensor("q", q, ndim=3, dtypes=ATTENTION_DTYPES, device=q.device, contiguous=False)
    check_unit_last_stride("q", q)
    head_dim = q.shape[2]
    if kernel and (not is_power_of_two(head_dim) or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(
            f"head_dim {head_dim} is not supported; use a power of two in "
            f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
        )


def check_kv_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Checks the paged cache against q and returns the GQA ratio (query heads per kv head)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, ndim=4, dtypes=(q.dtype, FP8_KV_DTYPE), device=q.device)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache is {v_cache.dtype} but k_cache is {k_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if not is_power_of_two(block_size) or block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size {block_size} must be a power of two >= {MIN_BLOCK_SIZE}")
    if head_dim != q.shape[2]:
        raise ValueError(f"cache head_dim {head_dim} != query head_dim {q.shape[2]}")
    num_heads = q.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads {num_heads} must be a multiple of the cache's num_kv_heads {num_kv_heads}"
        )
    return num_heads // num_kv_heads


def kv_scale_args(
    device: torch.device,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k_scale, v_scale) tensors a kernel takes for this cache: an FP8 cache's own (float32, one
    value each, on `device`; required), or, for a cache in the compute dtype (which takes none), the
    cache itself standing in for pointers the kernel never reads."""
    if k_cache.dtype != FP8_KV_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale are for an FP8 cache, not {k_cache.dtype}")
        return k_cache, k_cache
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 cache (float8_e4m3fn) needs k_scale and v_scale")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(name, t, ndim=t.dim(), dtypes=(torch.float32,), device=device)
        if t.numel() != 1:
            raise ValueError(
                f"{name} must hold one value (a per-tensor scale), got {tuple(t.shape)}"
            )
    return k_scale, v_scale


def check_output(
    name: str,
    t: torch.Tensor,
    q: torch.Tensor,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    *,
    contiguous: bool = True,
) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    check_tensor(name, t, ndim=3, dtypes=dtypes, device=q.device, contiguous=contiguous)
    check_unit_last_stride(name, t)
    check_shape(name, t, tuple(q.shape))


def check_lse(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=q.device)
    check_shape(name, t, tuple(q.shape[:2]))


def check_scale(scale: float) -> None:
    if not isinstance(scale, float | int) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")


def check_score_shaping(softcap: float, window: int) -> None:
    """softcap: a non-negative number (0: no soft-capping); window: a non-negative int (0: none)."""
    if not isinstance(softcap, float | int) or not softcap >= 0:
        raise ValueError(f"softcap must be a number >= 0 (0: none), got {softcap!r}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")


def check_segments(
    q: torch.Tensor,
    cu_name: str,
    cu: torch.Tensor,
    vectors: dict[str, torch.Tensor | None],
    table_name: str,
    table: torch.Tensor,
    bound_name: str,
    bound: int,
) -> int:
    """Checks segment metadata (cumulative query offsets, per-segment vectors, a block table and a
    host bound on query rows per segment); returns the number of segments."""
    check_index(cu_name, cu, ndim=1, device=q.device)
    num_segments = cu.shape[0] - 1
    if num_segments < 0:
        raise ValueError(f"{cu_name} must have (number of segments + 1) >= 1 entries, got 0")
    for name, vector in vectors.items():
        if vector is not None:
            check_index(name, vector, ndim=1, device=q.device)
            check_shape(name, vector, (num_segments,))
    check_index(table_name, table, ndim=2, device=q.device)
    if table.shape[0] != num_segments:
        raise ValueError(
            f"{table_name} has {table.shape[0]} rows but {cu_name} describes {num_segments}"
        )
    if not isinstance(bound, int) or bound < 0:
        raise ValueError(f"{bound_name} must be a non-negative int, got {bound!r}")
    return num_segments


def check_state(
    q: torch.Tensor,
    o_name: str,
    o: torch.Tensor | None,
    lse_name: str,
    lse: torch.Tensor | None,
) -> None:
    """An optional attention state: o [num_tokens, num_heads, head_dim] in fp32 or q's dtype, and lse
    [num_tokens, num_heads] in fp32."""
    if (o is None) != (lse is None):
        raise ValueError(f"{o_name} and {lse_name} must be given together (or neither)")
    if o is not None and lse is not None:
        check_output(o_name, o, q, state_dtypes(q))
        check_lse(lse_name, lse, q)


def state_dtypes(q: torch.Tensor) -> tuple[torch.dtype, ...]:
    """What a partial attention output may be stored in: fp32, or q's own dtype (half the bytes; the
    log-sum-exp that weighs it in a merge stays fp32)."""
    return (torch.float32,) if q.dtype == torch.float32 else (torch.float32, q.dtype)
