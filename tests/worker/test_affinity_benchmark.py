"""benchmarks/affinity.py runs end to end on the CPU (the tiny model, a real redis-server, a planner and
two workers, with prefix affinity and without): every request answered in both, and with affinity the
later jobs' documents are prefilled by no second worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services_testbed import need_redis

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "affinity.py"
SYSTEM, DOCUMENTS, DOCUMENT, QUESTIONS, QUESTION = 32, 8, 128, 2, 8
TINY = (f"--model tiny-random-llama --device cpu --vocab 256 --delay-s 1.5 --system-len {SYSTEM} "
        f"--documents {DOCUMENTS} --document-len {DOCUMENT} --questions {QUESTIONS} "
        f"--question-len {QUESTION} --output-len 2 --max-groups-in-flight 2")  # fmt: skip


def test_affinity_prefills_each_shared_document_once_and_no_affinity_more() -> None:
    redis_server = need_redis()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY.split(), "--redis-server", redis_server],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    on, off = report["affinity"], report["no_affinity"]
    for mode in (on, off):
        assert sum(mode["worker_requests"]) == 3 * DOCUMENTS * QUESTIONS
        assert len(mode["jobs"]) == 3 and all(job["seconds"] > 0 for job in mode["jobs"])
    # each worker its system prompt, each document once, every job's questions (a job takes a
    # tenth of the delay: one job's groups are all leased before the next comes)
    once = 2 * SYSTEM + DOCUMENTS * DOCUMENT + 3 * DOCUMENTS * QUESTIONS * QUESTION
    assert on["prefill_tokens"] <= once < off["prefill_tokens"]
    assert on["groups_sent"] > 0 and off["groups_sent"] == 0
