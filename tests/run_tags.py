"""Answer lines compared across runs: every job tags its ids with a run tag of its own
(output_lines.run_tag), so a local run's lines equal a job's once they carry the job's tag."""

from __future__ import annotations

import re
from pathlib import Path

from prefixgrove.jobs.output_lines import run_tag

_RUN_TAGGED = re.compile(r'("id": "(?:batch_req_|chatcmpl-|cmpl-)|"request_id": ")[0-9a-f]{12}')


def as_job(answers: str | Path, job_id: str) -> str:
    """Answer lines (a file's, or text) under job `job_id`'s run tag, which the services put in
    every id of the job's lines: what the services write for the same requests."""
    text = answers.read_text() if isinstance(answers, Path) else answers
    return _RUN_TAGGED.sub(lambda m: m.group(1) + run_tag(job_id), text)
