"""A line over the limit is handed to a parsing process cut to the limit, never whole: the
processes' memory stays within a ceiling however long the lines an upload sends."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from prefixgrove.jobs.line_parser import LineParser, LineRules
from prefixgrove.jobs.request_errors import RequestError

RULES = LineRules(max_line_bytes=1 << 20, default_max_tokens=16)
HUGE = 512 << 20
CEILING = 256 << 20  # a parsing process's peak memory, at most


def test_a_huge_line_fails_in_its_place_and_no_parsing_process_holds_it() -> None:
    parser = LineParser(RULES, processes=2)
    try:
        parser.warm_up()
        lines: list[bytes | str] = [b'{"custom_id": "r%d"}' % i for i in range(63)]
        lines.insert(40, b"x" * HUGE)
        parsed = parser.parse(lines, 0)
        assert isinstance(parsed[40], RequestError) and parsed[40].code == "line_too_large"
        assert len(parsed) == 64 and all(item.index == i for i, item in enumerate(parsed))
        peaks = [_peak(child.pid) for child in multiprocessing.active_children()]
        assert peaks and max(peaks) < CEILING, f"parsing processes' peaks: {peaks}"
    finally:
        parser.close()


def _peak(pid: int | None) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) * 1024
    raise AssertionError(f"process {pid} has no VmHWM")
