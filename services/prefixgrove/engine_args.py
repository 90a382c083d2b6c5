"""vLLM's `EngineArgs`, for scripts that build their flags from it, as vLLM's examples do:

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="...")
    llm = LLM(**vars(parser.parse_args()))

It is EngineSettings (the engine's knobs under vLLM's names) with the model and `LLM`'s
`generation_config` beside them, so every flag it adds is a keyword `LLM(...)` takes, at the
value `LLM` would use when it is left out. Imports nothing heavy, as EngineSettings.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from prefixgrove.engine_settings import EngineSettings

_HELP = "help"


@dataclass(frozen=True)
class EngineArgs(EngineSettings):
    model: str | None = None
    generation_config: str = "auto"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One --flag per field (`--max-num-seqs`; a bool as `--x` / `--no-x`), defaulting to
        the field's default."""
        group = parser.add_argument_group("Engine arguments")
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            helptext = f.metadata.get(_HELP, "")
            if str(f.type) == "bool":
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext
                )
            else:
                group.add_argument(
                    flag, type=_flag_type(str(f.type)), default=f.default, help=helptext
                )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _flag_type(annotation: str) -> Any:
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str
