"""Draws the measured results under docs/ from the JSON the GPU benchmarks printed (kept in
benchmarks/results/): requests/s of the canonical workload by mode, and the cascade kernel's speed-up by
sharing degree and prefix length. Usage: python benchmarks/plot_results.py (needs matplotlib)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
MODE_LABELS = {
    "shuffled-nogroup": "shuffled,\nno grouping",
    "sorted-nogroup": "sorted,\nno grouping",
    "group-nocascade": "grouping,\nplain kernel",
    "group-cascade": "grouping +\ncascade",
    "group-cascade-two-pass": "grouping +\ncascade, two-pass\ndecode",
    "group-cascade-unfused": "grouping +\ncascade, two-pass\nprefill chunks",
}


def plot_modes() -> None:
    records = [
        json.loads(line)
        for line in (RESULTS / "batchllm.jsonl").read_text().splitlines()
        if line.strip()
    ]
    by_size: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_size[r["requests"]].append(r)
    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(by_size)
    modes = [m for m in MODE_LABELS if any(r["mode"] == m for r in records)]
    for i, (size, rs) in enumerate(sorted(by_size.items())):
        values = {r["mode"]: r["requests_per_s"] for r in rs}
        xs = [j + i * width for j, m in enumerate(modes) if m in values]
        ys = [values[m] for m in modes if m in values]
        bars = ax.bar(xs, ys, width, label=f"{size:,} requests")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(
        [j + width * (len(by_size) - 1) / 2 for j in range(len(modes))],
        [MODE_LABELS[m] for m in modes],
    )
    ax.set_ylabel("requests / s")
    device = records[0]["device"]
    ax.set_title(
        f"Canonical shared-prefix workload, Llama-3.1-8B shapes, bf16 ({device})", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "batchllm_modes.png", dpi=120)


def plot_kernels() -> None:
    report = json.loads((RESULTS / "attention_kernels.json").read_text())
    by_len: dict[int, list[tuple[int, float, float | None]]] = defaultdict(list)
    for r in report["results"]:
        if "speedup" in r:
            by_len[r["prefix_len"]].append((r["degree"], r["speedup"], r.get("speedup_bound")))
    fig, ax = plt.subplots(figsize=(6, 4))
    for prefix_len, points in sorted(by_len.items()):
        points.sort()
        (line,) = ax.plot(
            [d for d, _, _ in points],
            [s for _, s, _ in points],
            marker="o",
            label=f"{prefix_len:,}-token prefix",
        )
        bounds = [(d, b) for d, _, b in points if b is not None]
        if bounds:  # a kernel reading the same bytes at the machine's streaming-read ceiling
            ax.plot(*zip(*bounds, strict=True), linestyle="--", color=line.get_color(), alpha=0.6)
    if any(b is not None for points in by_len.values() for _, _, b in points):
        ax.plot([], [], linestyle="--", color="grey", label="read ceiling (same bytes)")
    ax.set_xscale("log", base=2)
    degrees = sorted({d for points in by_len.values() for d, _, _ in points})
    ax.set_xticks(degrees, [str(d) for d in degrees])
    ax.set_xlabel("requests sharing a prefix (degree)")
    ax.set_ylabel("speed-up of cascade over plain paged attention")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title(f"Decode attention, 8B shapes, bf16, cold L2 ({report['device']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "cascade_kernel_speedup.png", dpi=120)


if __name__ == "__main__":
    plot_modes()
    plot_kernels()
