"""Request lines parsed in several processes: JSON decoding and validation are pure Python and hold
the GIL, so one process parses one line at a time however many cores the machine has. A job of
long token-id prompts spends most of its upload there, while the GPU waits for the seal
(benchmarks/services.py; benchmarks/HISTORY.md, "The deployed path").

Lines go out in slices, one per process, and come back in order: the result is exactly what
`parse_line` gives line by line (tests/jobs/test_line_parser.py checks it on fuzzed lines).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass

from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line

# Fewer lines than this are parsed here: handing them out would cost more than it saves.
_MIN_LINES_TO_SHARE = 64


@dataclass(frozen=True)
class LineRules:
    """What parse_line needs besides the line."""

    max_line_bytes: int
    default_max_tokens: int


def parse_slice(
    lines: Sequence[bytes | str], first: int, rules: LineRules
) -> list[BatchRequest | RequestError]:
    """Lines `first`, `first + 1`, ... parsed in order (what each process runs)."""
    return [
        parse_line(line, first + k, max_line_bytes=rules.max_line_bytes,
                   default_max_tokens=rules.default_max_tokens)
        for k, line in enumerate(lines)
    ]  # fmt: skip


def default_processes() -> int:
    """Half the cores, at most 8: the other half serves gRPC, Redis and tokenization."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


class LineParser:
    """Parses lines inline (processes=1) or across `processes` worker processes."""

    def __init__(self, rules: LineRules, processes: int = 1) -> None:
        self.rules = rules
        self.processes = processes
        self._pool: Executor | None = None
        if processes > 1:
            # NOTE: spawned, not forked: a fork of a process running gRPC's threads is unsafe.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(processes, mp_context=context)

    def parse(self, lines: Sequence[bytes | str], first: int) -> list[BatchRequest | RequestError]:
        if self._pool is None or len(lines) < _MIN_LINES_TO_SHARE:
            return parse_slice(lines, first, self.rules)
        lines = self._bounded(lines)
        step = -(-len(lines) // self.processes)
        futures = [
            self._pool.submit(parse_slice, lines[start : start + step], first + start, self.rules)
            for start in range(0, len(lines), step)
        ]
        return [item for future in futures for item in future.result()]

    def _bounded(self, lines: Sequence[bytes | str]) -> list[bytes | str]:
        """The lines as another process needs them: one over the limit fails on its length
        alone, so only its first max_line_bytes + 1 go (not the whole line, copied and pickled)."""
        cap = self.rules.max_line_bytes + 1
        return [line if len(line) <= cap else line[:cap] for line in lines]

    def warm_up(self) -> None:
        """Starts every process now, so the first upload does not wait for them."""
        if self._pool is not None:
            futures = [self._pool.submit(os.getpid) for _ in range(self.processes * 2)]
            for future in futures:
                future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
