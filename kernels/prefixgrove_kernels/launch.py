"""A kernel launch as data: what a launcher decided, so it can be run, or compiled ahead of time."""

from __future__ import annotations

from typing import Any, NamedTuple


class KernelLaunch(NamedTuple):
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]  # constexprs, num_warps, num_stages

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.options)

    def compile(self) -> Any:
        """Compiles for the active Triton target without launching (tests, warm-up)."""
        return self.kernel.warmup(*self.args, grid=self.grid, **self.options)
