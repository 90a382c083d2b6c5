"""Prefix grouping speed on one CPU core; prints one JSON object.

Workloads: the canonical shape (groups of 16 sharing a 2,000-token prefix, 200 unique tokens each,
shuffled) as numpy rows at several sizes and once as Python lists, and a mixed job (system prompts,
documents under them, duplicates and unrelated prompts of varied lengths).
Run: `.venv/bin/python benchmarks/grouping.py [--sizes 6400,100000]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from dataclasses import asdict

import numpy as np

from prefixgrove.grouping import GroupingConfig, GroupingResult, group_prompts

VOCAB = 128_256


def canonical(n_requests: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Groups of 16 sharing 2,000 random tokens, each with 200 unique ones, in shuffled order."""
    n_groups = n_requests // 16
    job = np.empty((n_groups * 16, 2200), dtype=np.int32)
    group_of = rng.permutation(np.repeat(np.arange(n_groups), 16))
    prefixes = rng.integers(0, VOCAB, (n_groups, 2000), dtype=np.int32)
    job[:, :2000] = prefixes[group_of]
    job[:, 2000:] = rng.integers(0, VOCAB, (len(job), 200), dtype=np.int32)
    return list(job)


def mixed(n_requests: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Nested prefixes (system prompt, then document), duplicates and unrelated prompts."""
    systems = [rng.integers(0, VOCAB, 600) for _ in range(8)]
    documents = [rng.integers(0, VOCAB, int(rng.integers(200, 3000))) for _ in range(400)]
    prompts: list[np.ndarray] = []
    for _ in range(n_requests):
        kind = rng.random()
        question = rng.integers(0, VOCAB, int(rng.integers(20, 400)))
        system = systems[int(rng.integers(len(systems)))]
        if kind < 0.6:
            document = documents[int(rng.integers(len(documents)))]
            prompts.append(np.concatenate([system, document, question]))
        elif kind < 0.8:
            prompts.append(np.concatenate([system, question]))
        elif kind < 0.85 and prompts:
            prompts.append(prompts[int(rng.integers(len(prompts)))].copy())
        else:
            prompts.append(rng.integers(0, VOCAB, int(rng.integers(20, 3000))))
    return [p.astype(np.int32) for p in prompts]


def measure(
    name: str, prompts: list[np.ndarray], config: GroupingConfig
) -> tuple[dict[str, object], GroupingResult]:
    start = time.perf_counter()
    result = group_prompts(prompts, config)
    seconds = time.perf_counter() - start
    stats = result.stats
    row = {
        "workload": name,
        "requests": stats.num_requests,
        "tokens": stats.num_tokens,
        "groups": stats.num_groups,
        "grouped_requests": stats.grouped_requests,
        "mean_group_size": round(stats.mean_group_size, 2),
        "tokens_saved": stats.tokens_saved,
        "saved_fraction": round(stats.tokens_saved / max(stats.num_tokens, 1), 4),
        "seconds": round(seconds, 3),
        "requests_per_s": round(stats.num_requests / seconds),
    }
    return row, result


def check_canonical(result: GroupingResult, n_requests: int) -> None:
    n_groups = n_requests // 16
    assert len(result.groups) == n_groups, (len(result.groups), n_groups)
    assert result.tokens_saved == n_groups * 15 * 2000, result.tokens_saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sizes", default="6400,100000", help="canonical job sizes, comma-separated"
    )
    parser.add_argument("--lists", type=int, default=6400, help="canonical job as list[int]")
    parser.add_argument("--mixed", type=int, default=20_000, help="requests in the mixed job")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    config = GroupingConfig()
    runs = []
    for n_requests in (int(s) for s in args.sizes.split(",")):
        prompts = canonical(n_requests, rng)
        row, result = measure(f"canonical-{n_requests}", prompts, config)
        check_canonical(result, n_requests)
        runs.append(row)
        del prompts, result
    as_lists = [row.tolist() for row in canonical(args.lists, rng)]
    row, result = measure(f"canonical-{args.lists}-python-lists", as_lists, config)
    check_canonical(result, args.lists)
    runs.append(row)
    del as_lists, result
    runs.append(measure(f"mixed-{args.mixed}", mixed(args.mixed, rng), config)[0])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"config": asdict(config), "runs": runs, "peak_rss_mib": round(peak_mib)}))


if __name__ == "__main__":
    main()
