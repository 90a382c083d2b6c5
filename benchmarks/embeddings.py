"""Embedding jobs on the CPU: a /v1/embeddings batch file of many short texts through `prefixgrove run`
(its peak memory, which must not grow with the answers it writes), and LLM.embed with and without
prefix grouping on texts that share an instruction prefix.

  python benchmarks/embeddings.py stream --requests 10000 100000
  python benchmarks/embeddings.py grouping --requests 2000 --prefix-words 48

Each run is a fresh process; one JSON line per run. The model is a tiny random checkpoint (the
tokens' count and the job's shape are what is measured, not a model's quality).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "tiny-random-llama"
INSTRUCT = "Instruct: Given a web search query, retrieve relevant passages that answer it. "
WORDS = [
    "apple",
    "river",
    "stone",
    "light",
    "quiet",
    "north",
    "paper",
    "green",
    "seven",
    "table",
    "music",
    "cloud",
]


def texts(n: int, seed: int, prefix_words: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefix = INSTRUCT + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    return [f"{prefix} Query: {' '.join(rng.choices(WORDS, k=4))}" for _ in range(n)]


def stream(requests: int, work: Path) -> dict[str, object]:
    """`prefixgrove run` of `requests` short texts (no shared prefix) in a child process."""
    job, out = work / "in.jsonl", work / "out.jsonl"
    with job.open("w") as f:
        for i, text in enumerate(texts(requests, seed=1)):
            body = {"input": text[len(INSTRUCT) :]}  # short texts, no shared instruction
            f.write(json.dumps({"custom_id": f"e{i}", "url": "/v1/embeddings", "body": body}))
            f.write("\n")
    start = time.perf_counter()
    args = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o", str(out),
            "--model", MODEL, "--device", "cpu", "--dtype", "float32", "--json", "--quiet"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    summary = json.loads(done.stdout.splitlines()[-1])
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"mode": "stream", "requests": requests, "completed": summary["completed"],
            "seconds": round(seconds, 1), "req_per_s": round(requests / seconds, 1),
            "input_mb": round(job.stat().st_size / 2**20, 1),
            "output_mb": round(out.stat().st_size / 2**20, 1), "peak_rss_mb": round(peak_mb)}  # fmt: skip


def grouping(requests: int, prefix_words: int) -> list[dict[str, object]]:
    """LLM.embed of texts sharing an instruction prefix, grouped and not (prefix cache off)."""
    import torch

    from prefixgrove import LLM

    torch.set_num_threads(1)
    batch = texts(requests, seed=2, prefix_words=prefix_words)
    rows = []
    for grouped in (False, True):
        llm = LLM(MODEL, device="cpu", dtype="float32", enable_prefix_grouping=grouped,
                  enable_prefix_caching=False)  # fmt: skip
        llm.embed(batch[:16], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.embed(batch, use_tqdm=False)
        seconds = time.perf_counter() - start
        prompt = sum(len(llm.get_tokenizer().encode(t)) for t in batch)
        rows.append({"mode": "grouping", "grouped": grouped, "requests": requests,
                     "prompt_tokens": prompt, "seconds": round(seconds, 2),
                     "req_per_s": round(requests / seconds, 1),
                     "prefix_tokens_reused": llm.engine.metrics.prefix_tokens_reused})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["stream", "grouping"])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000])
    parser.add_argument("--prefix-words", type=int, default=48)
    args = parser.parse_args()
    for n in args.requests:
        if args.mode == "stream":
            with tempfile.TemporaryDirectory() as work:
                print(json.dumps(stream(n, Path(work))), flush=True)
        else:
            for row in grouping(n, args.prefix_words):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
