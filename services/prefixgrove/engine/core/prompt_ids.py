"""A prompt's token ids, checked before the engine takes them: integers, inside the vocabulary."""

from __future__ import annotations

import array
import numbers
from collections.abc import Sequence

import numpy as np


def checked_token_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids as a list of Python ints; raises ValueError naming the first bad one."""
    # A job holds millions of tokens: one C-level pass per prompt, and the slow loop only runs to
    # name a culprit.
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    if isinstance(prompt_token_ids, (list, tuple)):
        try:  # every item an integer (floats and strings refused), none beyond int64
            packed = np.frombuffer(array.array("q", prompt_token_ids), dtype=np.int64)
        except (TypeError, OverflowError):
            _name_bad_item(prompt_token_ids, vocab_size)
            raise ValueError("prompt token ids must be a flat list of integers") from None
        _check_vocabulary(packed, vocab_size)
        # A list is kept as it is, not copied: the engine never writes to a prompt's ids, and
        # turning 2,000 ids back into new Python ints costs as much as checking them twice.
        return prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
    arr = np.asarray(prompt_token_ids) if not isinstance(prompt_token_ids, str) else None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        _name_bad_item(prompt_token_ids, vocab_size)
        raise ValueError("prompt token ids must be a flat list of integers")
    _check_vocabulary(arr, vocab_size)
    return arr.tolist()


def _name_bad_item(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raises ValueError for the first id that is not an integer or lies outside the vocabulary."""
    for t in prompt_token_ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"prompt token id {t!r} is not an integer")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {vocab_size})")


def _check_vocabulary(ids: np.ndarray, vocab_size: int) -> None:
    if ids.min() < 0 or ids.max() >= vocab_size:
        _name_bad_item(ids.tolist(), vocab_size)
