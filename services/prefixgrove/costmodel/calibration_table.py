"""The cost model's calibrated coefficients, one row per device kind and weight dtype
(costmodel/calibration.py says what each means). Written by benchmarks/calibrate.py; each
row names the runs it was fitted to; a kind fitted together with another names that
kind's row."""

from typing import Any

TABLE: dict[str, dict[str, Any] | str] = {
    "cpu/float32": {
        "prefill_compute": 73.77524641929651,
        "decode_compute": 0.0,
        "decode_memory": 303.7415534902902,
        "steps": 0.0,
        "decode_tokens": 0.0,
        "source": "calibrate.py on cpu, 2026-11-28: canonical,no-sharing,decode-heavy,structured at scale 0.01, lengths 0.1, tiny-random-llama (2 shared cores; its checks: RESULTS.md)",
        "peak_flops": 50091340664.32327,
        "bytes_per_s": 14156423213.298061,
    },
    "h100/bfloat16": {
        "prefill_compute": 1.642007523925874,
        "decode_compute": 1.5168653920040491,
        "decode_memory": 0.9289054838552787,
        "steps": 0.0,
        "decode_tokens": 0.0,
        "source": "RESULTS.md: h100 canonical table, group-cascade, 2489b63; h100 batch limits table, cascade 1,600, 0776c6a; h100 throughput.py table, 7236583; h100 decode.py table, 8 graphs bf16, 0e7a272; h100 structured.py table, jump-forward, 04d7366; h200 entry points table, batchllm.py, dbddf2e; h200 decode.py table, H200 defaults, dbddf2e",
    },
    "h100/fp8": {
        "prefill_compute": 1.5391629301544556,
        "decode_compute": 4.254966230421722,
        "decode_memory": 0.5958889535078544,
        "steps": 0.0,
        "decode_tokens": 0.0,
        "source": "RESULTS.md: h100 canonical table, group-cascade-fp8, 2489b63; h100 canonical table, group-cascade-fp8-kv, 2489b63; h100 decode.py table, FP8 weights and KV, 022bc5d",
    },
    "h200/bfloat16": "h100/bfloat16",
}
