"""Where the device's time goes between steps, for benchmarks: on CUDA, an event as a step (or a window
of decode steps) starts to be enqueued and one after its last work. The device reaches a step's first
event when it has finished everything before it, or, if it was idle, when the host recorded it: the
time from one step's last event to the next one's first is time the device waited for the host. Only
while `enabled` is set; the events are read (and forgotten) by `summary`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.cuda import Event


@dataclass
class StepTimeline:
    enabled: bool = False
    # (kind, first event, last event, rows, tokens, mask waits) per step or window, in stream order
    _steps: list[tuple[str, Event, Event, int, int, list[tuple[Event, Event]]]] = field(
        default_factory=list
    )
    _waits: list[tuple[Event, Event]] = field(default_factory=list)  # of the step being enqueued
    # with keep_steps, summary also fills `steps`: one dict per step (a benchmark's step log)
    keep_steps: bool = False
    steps: list[dict[str, Any]] = field(default_factory=list)

    def begin(self, device: torch.device) -> Event | None:
        """The event of a step about to be enqueued; None when not measuring."""
        if not self.enabled or device.type != "cuda":
            return None
        return recorded_event()

    def end(self, kind: str, first: Event | None, rows: int, tokens: int) -> None:
        """Closes the step opened by `begin` (`kind`: "step" or "window"; its batch's rows and
        tokens, for the step log)."""
        if first is not None:
            self._steps.append((kind, first, recorded_event(), rows, tokens, self._waits))
            self._waits = []

    def mask_wait(self, pair: tuple[Event, Event]) -> None:
        """Events around the device's wait for a mask in the step being enqueued (MaskStats)."""
        if self.enabled:
            self._waits.append(pair)

    def summary(self) -> dict[str, float]:
        """Seconds the device spent in steps and windows, and idle after each kind, since the last
        call (which also drops the earlier steps: a gap is counted only between steps both seen)."""
        steps, self._steps = self._steps, []
        out = {
            "gpu_step_seconds": 0.0,
            "gpu_window_seconds": 0.0,
            "gpu_idle_after_steps_seconds": 0.0,
            "gpu_idle_after_windows_seconds": 0.0,
        }
        if steps:
            steps[-1][2].synchronize()
        self.steps = []
        for i, (kind, first, last, rows, tokens, waits) in enumerate(steps):
            busy = first.elapsed_time(last) / 1000
            idle = last.elapsed_time(steps[i + 1][1]) / 1000 if i + 1 < len(steps) else 0.0
            out[f"gpu_{kind}_seconds"] += busy
            out[f"gpu_idle_after_{kind}s_seconds"] += idle
            if self.keep_steps:
                waited = sum(a.elapsed_time(b) for a, b in waits)
                self.steps.append(
                    {
                        "kind": kind,
                        "rows": rows,
                        "tokens": tokens,
                        "ms": 1000 * busy,
                        "mask_idle_ms": waited,
                        "idle_after_ms": 1000 * idle,
                    }
                )
        return out


def recorded_event() -> Event:
    """A timing event, recorded on the current stream now."""
    event = Event(enable_timing=True)
    event.record()
    return event
