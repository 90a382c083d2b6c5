"""Settings come from flags, then PREFIXGROVE_* variables, then defaults, and say what is wrong."""

from __future__ import annotations

import argparse

import pytest

from prefixgrove import settings as cfg
from prefixgrove.cli_flags import add_arguments
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.settings import PlannerSettings, SecuritySettings, ServedModel, WorkerSettings


def test_flags_win_over_environment_over_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings)
    args = parser.parse_args(["--lease-timeout-s", "9"])
    env = {"PREFIXGROVE_LEASE_TIMEOUT_S": "5", "PREFIXGROVE_MAX_GROUPS_IN_FLIGHT": "3"}
    settings = cfg.load(WorkerSettings, args, env)
    assert settings.lease_timeout_s == 9.0
    assert settings.max_groups_in_flight == 3
    assert settings.model == WorkerSettings().model


def test_bad_setting_says_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="PREFIXGROVE_PORT='http' is invalid: expected int"):
        cfg.load(PlannerSettings, {}, {"PREFIXGROVE_PORT": "http"})
    with pytest.raises(ValueError, match="device='tpu' is invalid"):
        cfg.load(EngineSettings, {"device": "tpu"}, {})


def test_token_never_shows_in_the_settings_repr() -> None:
    settings = cfg.load(SecuritySettings, {}, {"PREFIXGROVE_AUTH_TOKEN": "s3cret"})
    assert settings.auth_token == "s3cret"
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)


def test_a_planner_serves_every_model_given_the_first_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, PlannerSettings)
    args = parser.parse_args(["--model", "tiny-random-llama", "--model", "big=/models/llama-8b"])
    flagged = cfg.load(PlannerSettings, args, {})
    from_env = cfg.load(
        PlannerSettings, {}, {"PREFIXGROVE_MODEL": "tiny-random-llama, big=/models/llama-8b"}
    )
    expected = (
        ServedModel("tiny-random-llama", "tiny-random-llama"),
        ServedModel("big", "/models/llama-8b"),
    )
    assert flagged.models == from_env.models == expected


def test_two_models_of_one_name_or_an_empty_source_are_refused() -> None:
    with pytest.raises(ValueError, match="two models share a name"):
        PlannerSettings(model="a=tiny-random-llama,a=/models/other")
    with pytest.raises(ValueError, match="expected SOURCE or NAME=SOURCE"):
        PlannerSettings(model="a=")


def test_a_worker_leases_from_its_served_name_else_its_source() -> None:
    assert WorkerSettings(model="/models/llama-8b").served_name == "/models/llama-8b"
    env = {"PREFIXGROVE_SERVED_MODEL_NAME": "big"}
    assert cfg.load(WorkerSettings, {"model": "/models/llama-8b"}, env).served_name == "big"


def test_a_model_takes_aliases_that_name_it_and_no_other_model() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, PlannerSettings)
    args = parser.parse_args(["--model", "llama=/m/l", "qwen=/m/q", "--model-alias",
                              "gpt-4o-mini=llama", "--model-alias", "gpt-4o=llama,o1=qwen"])  # fmt: skip
    assert cfg.load(PlannerSettings, args, {}).models == (
        ServedModel("llama", "/m/l", ("gpt-4o-mini", "gpt-4o")),
        ServedModel("qwen", "/m/q", ("o1",)),
    )
    for aliases in ("x=nobody", "qwen=llama", "x=llama,x=qwen", "=llama"):
        with pytest.raises(ValueError, match=r"model_alias .* is invalid: expected ALIAS=NAME"):
            PlannerSettings(model="llama=/m/l,qwen=/m/q", model_alias=aliases)


def test_a_worker_takes_several_served_names_and_leases_from_the_first() -> None:
    """vLLM's `--served-model-name NAME ALIAS...`, as flags or one variable."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings)
    args = parser.parse_args(["--served-model-name", "llama", "gpt-4o-mini"])
    assert cfg.load(WorkerSettings, args, {}).served_name == "llama"
    env = {"PREFIXGROVE_SERVED_MODEL_NAME": "llama,gpt-4o-mini"}
    assert cfg.load(WorkerSettings, {}, env).served_name == "llama"


def test_engine_settings_take_fp8_quantization_from_the_environment() -> None:
    settings = cfg.load(EngineSettings, env={"PREFIXGROVE_QUANTIZATION": "fp8"})
    assert settings.quantization == "fp8"
    assert cfg.load(EngineSettings, env={}).quantization is None
    assert cfg.load(EngineSettings, env={"PREFIXGROVE_QUANTIZATION": ""}).quantization is None
    with pytest.raises(ValueError, match="quantization='awq'"):
        cfg.load(EngineSettings, env={"PREFIXGROVE_QUANTIZATION": "awq"})
