"""benchmarks/profile_steps.py runs end to end on the tiny preset (CPU) and accounts for every token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_steps.py"


def test_profile_steps_accounts_for_every_prompt_and_output_token() -> None:
    args = "--model tiny-random-llama --groups 3 --per-group 4 --prefix-len 128 --suffix-len 16"
    args += " --output-len 12 --max-num-seqs 8 --max-num-batched-tokens 256"
    args += " --trace-mixed 1 --trace-decode 1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args.split()],
        cwd=SCRIPT.parent,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["requests"] == 12
    mixed, decode = report["mixed"], report["decode"]
    # 3 prefixes of 128 tokens computed once, 12 suffixes of 16; the first output token of each
    # request comes from its prefill step, the other 11 from decode.
    assert mixed["prefill_tokens"] + decode["prefill_tokens"] == 3 * 128 + 12 * 16
    assert mixed["decode_tokens"] + decode["decode_tokens"] == 12 * 11
    assert {"schedule", "fill_and_upload", "sampling_settings"} <= set(mixed["host_ms_per_call"])
    assert report["slowest_mixed_steps"][0]["ms"] >= report["fastest_mixed_steps"][-1]["ms"]
