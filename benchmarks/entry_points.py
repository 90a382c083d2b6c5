"""The canonical job (DESIGN.md) through each way a user runs the engine, side by side on one machine:
  batchllm      benchmarks/batchllm.py's group-cascade mode (the engine's figure)
  llm-defaults  `LLM(model)` with no engine arguments at all, then `generate` on the job's prompts
  run           `prefixgrove run JOB.jsonl --model M --device cuda` in its own process, on the job as
                OpenAI Batch JSONL with token-id prompts (its JSON summary's decode time, and its
                whole time: reading, grouping and loading included)
Each runs in a process of its own, one after the other, so that one's memory is gone before the next.
Prints one JSON line per way, then one with the ratios to batchllm's figure.
Usage: python benchmarks/entry_points.py [--groups 400] [--ways batchllm,llm-defaults,run]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    add_canonical_workload_args,
    device_name,
    emit,
    greedy_params,
    shared_prefix_prompts,
    timed,
)

WAYS = ("batchllm", "llm-defaults", "run")


def canonical_prompts(args: argparse.Namespace) -> list[list[int]]:
    prompts = shared_prefix_prompts(
        args.groups, args.per_group, args.prefix_len, args.suffix_len, args.vocab, seed=0
    )
    random.Random(1).shuffle(prompts)  # as batchllm.py's job
    return prompts


def llm_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(model)` as a user writes it; warmed up as batchllm.py warms its engine."""
    from batchllm import warm_up

    from prefixgrove import LLM

    prompts = canonical_prompts(args)
    llm = LLM(args.model)
    warm_up(llm, prompts, args)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    _, seconds = timed(lambda: llm.generate(inputs, greedy_params(args.output_len), use_tqdm=False))
    scheduler = llm.config.scheduler
    return {
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(prompts) / seconds, 2),
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
    }


def write_job(path: Path, prompts: list[list[int]], output_len: int) -> None:
    with path.open("w") as f:
        for i, prompt in enumerate(prompts):
            body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line) + "\n")


def run_command(args: argparse.Namespace) -> dict[str, Any]:
    """`prefixgrove run` in a process of its own: the command a user types."""
    with tempfile.TemporaryDirectory() as d:
        job = Path(d) / "job.jsonl"
        write_job(job, canonical_prompts(args), args.output_len)
        command = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o",
                   str(Path(d) / "out.jsonl"), "--model", args.model, "--device", args.device, "--json",
                   "--quiet"]  # fmt: skip
        summary = last_json_line(command)
    ran = summary["completed"] + summary["failed"]
    return {
        "decode_seconds": round(summary["decode_seconds"], 2),
        "requests_per_s": round(ran / summary["decode_seconds"], 2),
        "whole_seconds": round(summary["seconds"], 2),
        "whole_requests_per_s": round(ran / summary["seconds"], 2),
        "failed": summary["failed"],
    }


def last_json_line(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def batchllm(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "benchmarks" / "batchllm.py"), "--modes",
               "group-cascade", "--groups", str(args.groups), "--model", args.model]  # fmt: skip
    record = last_json_line(command)
    keep = ("seconds", "requests_per_s", "max_num_seqs", "max_num_batched_tokens")
    return {k: record[k] for k in keep}


def one_way(way: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs `way` in a process of its own (this script again, with --only)."""
    if way != "llm-defaults":
        return batchllm(args) if way == "batchllm" else run_command(args)
    command = [sys.executable, __file__, "--only", way, *sys.argv[1:]]
    return last_json_line(command)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-3.1-8b-random")
    add_canonical_workload_args(ap, groups=400)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--vocab", type=int, default=128256, help="prompt token ids are below it")
    ap.add_argument("--device", default="cuda", help="run's --device (cpu: a smoke test)")
    ap.add_argument("--only", choices=["llm-defaults"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        emit(llm_defaults(args))
        return
    results = {}
    for way in args.ways.split(","):
        results[way] = one_way(way, args)
        emit({"benchmark": "entry_points", "way": way, "device": device_name(), **results[way]})
    if "batchllm" in results:
        base = results["batchllm"]["requests_per_s"]
        ratios = {w: round(r["requests_per_s"] / base, 3) for w, r in results.items()}
        emit({"benchmark": "entry_points", "ratio_to_batchllm": ratios})


if __name__ == "__main__":
    main()
