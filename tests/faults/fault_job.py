"""The campaign's batch file: requests over shared documents with the usual bad lines, plus a few
poison requests. A poison request is an ordinary completion whose prompt holds the faulty worker's
poison token in the middle of a document's question, so it lands in that document's group and kills
every worker process that runs it (tests/worker/faulty_worker.py, `--fault die`)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from services_testbed import MODEL, batch_line, shared_prefix_job

POISON_TOKEN = 3  # a control byte: no text prompt of shared_prefix_job holds it
MAX_TOKENS = 4


@dataclass(frozen=True)
class FaultJob:
    path: Path
    poison_ids: frozenset[str]


def build_job(path: Path, requests: int, poison: int, seed: int) -> FaultJob:
    """`requests` lines in all: those of shared_prefix_job (with its bad lines) and `poison`
    poison requests at seeded places among them."""
    if not 0 <= poison < requests // 10:
        raise ValueError(f"poison={poison}: want 0 <= poison < requests/10 ({requests // 10})")
    # shared_prefix_job adds 3 bad lines of its own (and turns one request into another)
    shared_prefix_job(path, requests - poison - 3, max_tokens=MAX_TOKENS, with_errors=True)
    lines = path.read_text().splitlines()
    rng = random.Random(seed)
    tokenizer = _tokenizer()
    poison_ids = []
    for k in range(poison):
        at = rng.randrange(len(lines))
        body = _completion_near(lines, at)
        ids = list(tokenizer(body["prompt"])["input_ids"])
        ids.insert(len(ids) - 4, POISON_TOKEN)  # after the document, inside the question
        custom_id = f"poison-{k}"
        lines.insert(at, batch_line(custom_id, {**body, "prompt": ids}))
        poison_ids.append(custom_id)
    path.write_text("\n".join(lines) + "\n")
    return FaultJob(path, frozenset(poison_ids))


def _completion_near(lines: list[str], at: int) -> dict:
    """The body of the first plain text completion at or after line `at` (wrapping around)."""
    for offset in range(len(lines)):
        line = lines[(at + offset) % len(lines)]
        try:
            body = json.loads(line)["body"]
        except (ValueError, KeyError):
            continue  # one of the deliberately broken lines
        if isinstance(body.get("prompt"), str) and "Question" in body["prompt"]:
            return dict(body)
    raise ValueError("the job holds no text completion to poison")


def _tokenizer():  # type: ignore[no-untyped-def]
    from prefixgrove.catalog.presets import load_tokenizer

    return load_tokenizer(MODEL)
