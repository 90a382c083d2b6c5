"""Every option of every `prefixgrove` command says what it does and its default; an option that is
a setting also names its PREFIXGROVE_* variable, and that variable really sets it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import MISSING, Field, fields
from typing import Any

import pytest

from prefixgrove import settings as cfg
from prefixgrove.cli import SETTINGS, _parser
from prefixgrove.settings import LogSettings


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Each command that runs something (a leaf of the subcommands), with its words."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield path, parser
    for group in groups:
        for name, command in group.choices.items():
            yield from commands(command, (*path, name))


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]


def settings_of(path: tuple[str, ...]) -> dict[str, tuple[type, Field[Any]]]:
    """The settings fields the command loads, by name (the first class that has it)."""
    found: dict[str, tuple[type, Field[Any]]] = {}
    for cls in (*SETTINGS[path], LogSettings):
        for f in fields(cls):
            found.setdefault(f.name, (cls, f))
    return found


PARSER = _parser()
COMMANDS = dict(commands(PARSER))


def test_the_table_names_every_command() -> None:
    assert sorted(COMMANDS) == sorted(SETTINGS)
    assert ("serve", "worker") in COMMANDS and ("run",) in COMMANDS


@pytest.mark.parametrize("path", sorted(SETTINGS), ids=" ".join)
def test_every_option_has_help_that_names_its_default(path: tuple[str, ...]) -> None:
    parser = COMMANDS[path]
    fields_by_name = settings_of(path)
    seen = set()
    for action in [*options(parser), *options(PARSER)]:
        flag = action.option_strings[-1]
        text = " ".join((action.help or "").split())
        assert text and text != argparse.SUPPRESS, f"{path} {flag}: no help"
        assert action.required or "default: " in text, f"{path} {flag}: no default in {text!r}"
        if action.dest in fields_by_name and flag == "--" + action.dest.replace("_", "-"):
            seen.add(action.dest)
            _, f = fields_by_name[action.dest]
            assert text.endswith(f"; environment: {cfg.env_name(f.name)}"), (path, flag, text)
            secret = f.name.endswith(("_token", "_key"))
            if f.default not in (None, "", MISSING) and not secret:
                assert f"default: {f.default};" in text, (path, flag, text)
        else:  # an option of the command line alone claims no variable
            assert "PREFIXGROVE_" not in text, (path, flag, text)
    assert seen == set(fields_by_name), f"{path}: settings without a flag"


def sample(f: Field[Any]) -> Any:
    """A valid value of a field other than its default."""
    special = {"device": "cpu", "quantization": "fp8", "log_format": "json", "model": "m1",
               "model_alias": "gpt-4o-mini=m1", "gpu": "h200",
               "files_url": "s3://bucket/files"}  # fmt: skip
    if f.name in special:
        return special[f.name]
    kind = str(f.type)
    if kind == "bool":
        return not f.default
    if kind.startswith("int"):
        return (f.default or 1) + 1
    if kind.startswith("float"):
        return (f.default or 1.0) * 2
    return f"/etc/prefixgrove/{f.name}"


def required_arguments(parser: argparse.ArgumentParser) -> list[str]:
    words = []
    for action in parser._actions:
        if not action.option_strings:
            if not isinstance(action, argparse._SubParsersAction):
                words.append("x")
        elif action.required:
            words += [action.option_strings[-1], "x"]
    return words


@pytest.mark.parametrize("path", sorted(SETTINGS), ids=" ".join)
def test_each_variable_named_in_help_sets_its_setting(path: tuple[str, ...]) -> None:
    args = PARSER.parse_args([*path, *required_arguments(COMMANDS[path])])
    for cls in (*SETTINGS[path], LogSettings):
        expected = {f.name: sample(f) for f in fields(cls)}
        env = {cfg.env_name(name): str(value) for name, value in expected.items()}
        loaded = cfg.load(cls, args, env=env)
        assert {name: getattr(loaded, name) for name in expected} == expected
        assert cfg.load(cls, args, env={}) == cls()  # unset: the defaults


def test_a_flag_wins_over_its_variable() -> None:
    args = PARSER.parse_args(["serve", "planner", "--port", "6000"])
    assert cfg.load(cfg.PlannerSettings, args, env={"PREFIXGROVE_PORT": "7000"}).port == 6000


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-format", "json", "--quiet", "list"],
        ["list", "--log-format", "json", "--quiet"],
        ["--log-format", "json", "serve", "worker", "--quiet"],
    ],
)
def test_global_options_come_before_or_after_the_command(argv: list[str]) -> None:
    args = PARSER.parse_args(argv)
    assert cfg.load(LogSettings, args, env={}).log_format == "json" and args.quiet


def test_global_options_default_to_text_and_the_variable() -> None:
    args = PARSER.parse_args(["serve", "worker"])
    assert cfg.load(LogSettings, args, env={}).log_format == "text" and not args.quiet
    env = {"PREFIXGROVE_LOG_FORMAT": "json"}
    assert cfg.load(LogSettings, args, env=env).log_format == "json"


def test_help_shows_a_default_and_a_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        PARSER.parse_args(["serve", "planner", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--port PORT default: 50051; environment: PREFIXGROVE_PORT" in text
    assert "--default-max-tokens DEFAULT_MAX_TOKENS default: 256;" in text
