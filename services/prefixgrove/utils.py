"""vLLM's `vllm.utils` import path, for the one thing its example scripts take from it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: `--max_tokens` is read as `--max-tokens`."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        import sys

        given = list(sys.argv[1:] if args is None else args)
        return super().parse_args([_dashed(a) for a in given], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value
