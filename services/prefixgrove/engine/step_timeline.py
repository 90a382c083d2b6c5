"""Where the device's time goes between steps, for benchmarks: on CUDA, an event as a step (or a window
of decode steps) starts to be enqueued and one after its last work. The device reaches a step's first
event when it has finished everything before it, or, if it was idle, when the host recorded it: the
time from one step's last event to the next one's first is time the device waited for the host. Only
while `enabled` is set; the events are read (and forgotten) by `summary`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepTimeline:
    enabled: bool = False
    # (kind, first event, last event) per step or window, in stream order
    _steps: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def begin(self, device: torch.device) -> torch.cuda.Event | None:
        """The event of a step about to be enqueued; None when not measuring."""
        if not self.enabled or device.type != "cuda":
            return None
        return _recorded()

    def end(self, kind: str, first: torch.cuda.Event | None) -> None:
        """Closes the step opened by `begin` (`kind`: "step" or "window")."""
        if first is not None:
            self._steps.append((kind, first, _recorded()))

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
        for i, (kind, first, last) in enumerate(steps):
            out[f"gpu_{kind}_seconds"] += first.elapsed_time(last) / 1000
            if i + 1 < len(steps):
                out[f"gpu_idle_after_{kind}s_seconds"] += last.elapsed_time(steps[i + 1][1]) / 1000
        return out


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
