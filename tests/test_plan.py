"""`prefixgrove plan`: the job read, tokenized and grouped as `run` reads it, its counts and output
tokens exact where they can be, and a prediction for every device kind; no device, no Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line

from prefixgrove.cli import main as cli
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.local import run_local
from prefixgrove.settings import IngestSettings

SHARED = "You grade answers. Be brief and exact. " * 4  # with "Answer ": 10 whole KV blocks


def job(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def exact_lines(n: int, max_tokens: int = 5) -> list[str]:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [batch_line(f"c{i}", {**body, "prompt": f"{SHARED}Answer {i}"}) for i in range(n)]


def plan(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    args = ["plan", str(path), "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--json"]
    assert cli([*args, *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_counts_what_grouping_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [*exact_lines(6), batch_line("alone", {"prompt": "xyz", "max_tokens": 2})]
    result = plan(job(tmp_path, lines), capsys)
    prompts = [len(f"{SHARED}Answer {i}".encode()) for i in range(6)] + [3]  # a token a byte
    assert result["requests"] == 7 and result["prompt_tokens"] == sum(prompts)
    assert (result["groups"], result["grouped_requests"], result["largest_group"]) == (1, 6, 6)
    assert result["group_sizes"] == {"4-7": 1}
    shared = 160  # the longest whole-block prefix the six share
    assert result["prefill_tokens"] == sum(prompts) - 5 * shared
    assert result["saved_share"] == pytest.approx(5 * shared / sum(prompts))


def test_plan_groups_the_job_as_a_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = job(tmp_path, [*exact_lines(5), '{"custom_id": "bad"'])
    result = plan(path, capsys)
    engine = EngineSettings(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    ran = run_local(path, tmp_path / "out.jsonl", tmp_path / "err.jsonl", MODEL, IngestSettings(),
                    engine, use_tqdm=False)  # fmt: skip
    assert result["groups"] == ran.num_groups
    assert result["prompt_tokens"] - result["prefill_tokens"] == ran.prefix_tokens_saved
    assert result["output_tokens"] == ran.completion_tokens == 25
    assert result["invalid_lines"] == ran.failed == 1


def test_a_system_prompt_shared_by_grouped_documents_is_prefilled_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # token ids: a 64-token system prompt, four 48-token documents, two 3-token questions each
    system, docs = list(range(1, 65)), [[60 + 48 * d + j for j in range(48)] for d in range(4)]
    lines = [batch_line(f"d{d}q{i}", {"prompt": [*system, *docs[d], 20 + 2 * d + i, 7, 9],
                                      "max_tokens": 2}) for d in range(4) for i in range(2)]  # fmt: skip
    result = plan(job(tmp_path, lines), capsys)
    assert (result["groups"], result["group_sizes"]) == (4, {"2-3": 4})
    assert result["prefill_tokens"] == 64 + 4 * 48 + 8 * 3  # the engine's own count of this job


def test_outputs_are_exact_where_max_tokens_binds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    result = plan(job(tmp_path, exact_lines(4, max_tokens=7)), capsys)
    assert result["output_exact"] and result["output_tokens"] == 28
    assert result["output_tokens_range"] == [28, 28]


def test_outputs_that_may_stop_early_are_a_range_and_an_observed_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    free = batch_line("free", {"prompt": "a poem", "max_tokens": 50, "n": 2})
    stops = batch_line("stops", {"prompt": "a list", "max_tokens": 30, "ignore_eos": True,
                                 "stop": ["\n"], "min_tokens": 4})  # fmt: skip
    path = job(tmp_path, [*exact_lines(1, max_tokens=10), free, stops])
    bounded = plan(path, capsys)
    assert not bounded["output_exact"]
    assert bounded["output_tokens_range"] == [10 + 2 * 1 + 4, 10 + 2 * 50 + 30]
    assert bounded["output_tokens"] == 10 + 2 * 50 + 30  # no mean observed: max_tokens
    observed = plan(path, capsys, "--mean-output-tokens", "20")
    assert observed["output_tokens"] == 10 + 2 * 20 + 20 and observed["mean_output_tokens"] == 20


def test_every_kind_is_predicted_and_the_cost_follows_the_price(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = job(tmp_path, exact_lines(8, max_tokens=20))
    result = plan(path, capsys, "--gpu", "h200", "--gpus", "2", "--price-per-gpu-hour", "3.5")
    assert sorted(result["devices"]) == ["a100", "h100", "h200", "l40s"]
    h200 = result["devices"]["h200"]
    assert h200["gpus"] == 2 and h200["wall_s"] == pytest.approx((h200["prefill_s"] + h200["decode_s"]) / 2)  # fmt: skip
    assert h200["cost"] == pytest.approx(h200["gpu_hours"] * 3.5)
    low, high = h200["wall_s_range"]
    assert low <= h200["wall_s"] <= high
    assert result["devices"]["a100"]["borrowed"]


def test_tensor_parallel_plans_add_the_measured_all_reduces_or_say_they_are_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = job(tmp_path, exact_lines(8, max_tokens=20))
    devices = plan(path, capsys, "--gpus", "2", "--tensor-parallel-size", "2")["devices"]
    assert devices["h200"]["all_reduces_measured"] and devices["h100"]["all_reduces_measured"]
    assert not devices["a100"]["all_reduces_measured"]
    assert cli(["plan", str(path), "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
                "--gpus", "2", "--tensor-parallel-size", "2"]) == 0  # fmt: skip
    lines = {line.split()[0].rstrip("*"): line for line in capsys.readouterr().out.splitlines()
             if line.split() and line.split()[0].rstrip("*") in devices}  # fmt: skip
    assert "all-reduces not measured" in lines["a100"]
    assert "all-reduces not measured" not in lines["h200"]


def test_a_kind_that_cannot_run_the_engine_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    result = plan(job(tmp_path, exact_lines(2)), capsys, "--quantization", "fp8")
    assert "a100 has none" in result["devices"]["a100"]
    assert isinstance(result["devices"]["h100"], dict)


def test_the_text_plan_marks_the_chosen_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = job(tmp_path, exact_lines(3))
    assert (
        cli(["plan", str(path), "--model", MODEL, "--gpu", "l40s", "--max-model-len", "512"]) == 0
    )
    out = capsys.readouterr().out
    assert "prefill tokens" in out and "exact" in out
    assert any(line.startswith("l40s*") for line in out.splitlines())


def test_an_input_that_is_not_a_batch_fails_with_its_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = job(tmp_path, ["not json at all"])
    assert cli(["plan", str(path), "--model", MODEL]) == 2
    assert "invalid_file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--gpu", "tpu"], "h100, h200, a100, l40s, cpu"), (["--gpus", "0"], "gpus=0"),
     (["--price-per-gpu-hour", "-1"], "price_per_gpu_hour=-1.0")],
)  # fmt: skip
def test_a_bad_plan_setting_is_named_with_what_is_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    path = job(tmp_path, exact_lines(1))
    assert cli(["plan", str(path), "--model", MODEL, *flags]) == 2
    assert named in capsys.readouterr().err


def test_the_cpu_kind_is_planned_only_when_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = job(tmp_path, exact_lines(2))
    assert "cpu" not in plan(path, capsys)["devices"]
    cpu = plan(path, capsys, "--gpu", "cpu")["devices"]["cpu"]
    assert cpu["calibration"] == "cpu/float32" and cpu["gpus"] == 1
