"""Command-line flags for settings classes: one --flag per field, its help naming the default and
the PREFIXGROVE_* variable that sets it (prefixgrove/settings.py's `load` reads them back)."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any

from prefixgrove.settings import HELP, REPEATED, env_name


def add_arguments(parser: argparse.ArgumentParser, *classes: type, suppress: bool = False) -> None:
    """Adds one --flag per field of the given settings classes; defaults stay None so the
    environment and the dataclass default can fill what the command line leaves out (suppress:
    a flag left out leaves no attribute at all, for a subcommand's copy of a global flag that
    must not overwrite what was given before the subcommand)."""
    unset = argparse.SUPPRESS if suppress else None
    seen: set[str] = set()
    for cls in classes:
        for f in fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.metadata.get(REPEATED):  # `--x a b`, `--x a --x b` and `--x a,b` alike
                parser.add_argument(flag, dest=f.name, default=unset, action="extend", nargs="+",
                                    help=field_help(f))  # fmt: skip
            else:
                parser.add_argument(flag, dest=f.name, default=unset, help=field_help(f))


def field_help(f: Field[Any]) -> str:
    """What --help says of a setting: its default and the variable that sets it."""
    secret = f.name.endswith(("_token", "_key"))  # not default_max_tokens, tokenize_batch
    default = "unset" if f.default in (None, "") or secret else f"{f.default}"
    described = f"{f.metadata[HELP]}; " if HELP in f.metadata else ""
    return f"{described}default: {default}; environment: {env_name(f.name)}"
