"""How `prefixgrove plan` prints a plan: a few lines on the job, then one line per device kind."""

from __future__ import annotations

from pathlib import Path

from prefixgrove.jobs.job_estimate import DeviceEstimate, JobEstimate


def duration(seconds: float) -> str:
    """Seconds as a person reads them: 42 s, 3.5 min, 2.1 h."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def plan_text(
    estimate: JobEstimate, source: Path | str, model: str, chosen: str, read_s: float
) -> str:
    e = estimate
    groups = ", ".join(f"{size}: {count}" for size, count in e.group_sizes.items()) or "none"
    lines = [
        f"plan of {source} on {model} (read, tokenized and grouped in {duration(read_s)})",
        f"requests        {e.requests:,} ({e.invalid_lines:,} invalid lines fail as error lines)",
        f"prompt tokens   {e.prompt_tokens:,}",
        f"prefill tokens  {e.prefill_tokens:,} after grouping ({100 * e.saved_share:.1f}% saved)",
        f"groups          {e.groups:,} holding {e.grouped_requests:,} requests (by size {groups};"
        f" largest {e.largest_group:,}); {e.requests - e.grouped_requests:,} in no group",
        f"output tokens   {_outputs(e)}",
        "",
        f"{'kind':<6} {'GPUs':>4} {'TP':>3} {'prefill':>9} {'decode':>9} {'GPU-hours':>10} "
        f"{'wall':>9}  {'wall range':<21} {'cost':>10}  calibration",
    ]
    for kind, device in e.devices.items():
        mark = "*" if kind == chosen else ""
        if isinstance(device, str):
            lines.append(f"{kind + mark:<6} cannot run: {device}")
        else:
            lines.append(_device_line(kind + mark, device))
    return "\n".join(lines)


def _outputs(e: JobEstimate) -> str:
    low, high = e.output_tokens_range
    if e.output_exact:
        return f"{e.output_tokens:,}, exact (every request ignores EOS: its max_tokens binds)"
    basis = (
        f"at an observed mean of {e.mean_output_tokens:g} a request"
        if e.mean_output_tokens is not None
        else "at max_tokens (pass --mean-output-tokens from an earlier run for a closer figure)"
    )
    return f"{e.output_tokens:,} {basis}; between {low:,} and {high:,}"


def _device_line(kind: str, d: DeviceEstimate) -> str:
    low, high = d.wall_s_range
    span = f"{duration(low)} - {duration(high)}"
    cost = "-" if d.cost is None else f"{d.cost:,.2f}"
    notes = " (no run of this kind: borrowed)" if d.borrowed else ""
    if not d.all_reduces_measured:
        notes += " (its all-reduces not measured: left out)"
    return (
        f"{kind:<6} {d.gpus:>4} {d.tensor_parallel:>3} {duration(d.prefill_s):>9} "
        f"{duration(d.decode_s):>9} {d.gpu_hours:>10.3f} {duration(d.wall_s):>9}  {span:<21} "
        f"{cost:>10}  {d.calibration}{notes}"
    )
