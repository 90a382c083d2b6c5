"""`prefixgrove run`: one process, no Redis, no gRPC; the same validation, grouping, engine and output
lines as the planner and the workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixgrove.jobs.ingest import JobIngestor, JobPlan
from prefixgrove.jobs.output_lines import success_line
from prefixgrove.jobs.requests import BatchRequest, RequestError, engine_error
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings

log = logging.getLogger(__name__)
_READ_LINES = 4096


class JobInputError(ValueError):
    """The whole input is not a batch (empty, or not JSONL)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RunSummary:
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_tokens_saved: int = 0
    num_groups: int = 0
    seconds: float = 0.0
    errors_by_code: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Group:
    prefix_len: int
    request_indices: tuple[int, ...]


@dataclass(frozen=True)
class _Groups:
    groups: list[_Group]


def read_lines(path: Path, chunk: int = _READ_LINES) -> Iterator[list[bytes]]:
    with path.open("rb") as f:
        lines: list[bytes] = []
        for line in f:
            lines.append(line.rstrip(b"\r\n"))
            if len(lines) >= chunk:
                yield lines
                lines = []
        if lines:
            yield lines


def run_local(
    input_path: Path,
    output_path: Path,
    errors_path: Path,
    model: str,
    ingest: IngestSettings,
    engine_args: dict[str, Any],
    use_tqdm: bool = True,
) -> RunSummary:
    import time

    from prefixgrove.engine import LLM, EngineConfig, SamplingParams

    start = time.perf_counter()
    engine_args = {**engine_args, "max_model_len": ingest.max_model_len}
    limit = EngineConfig.create(model, **engine_args).model.max_model_len  # no weights yet
    ingestor = JobIngestor(PromptTokenizer(model, limit), ingest)
    requests: list[tuple[BatchRequest, Any]] = []
    errors: list[RequestError] = []
    for lines in read_lines(input_path):
        batch = ingestor.add(lines)
        requests.extend(batch.requests)
        errors.extend(batch.errors)
    problem = ingestor.job_error()
    if problem is not None:
        raise JobInputError(*problem)
    plan = ingestor.plan()
    llm = LLM(model, **engine_args)
    runnable: list[tuple[BatchRequest, Any, Any]] = []
    for request, tokens in requests:
        params = SamplingParams(**request.params)
        try:
            llm.engine.validate(tokens, params)
        except ValueError as exc:
            errors.append(engine_error(request.index, request.custom_id, exc))
            continue
        runnable.append((request, tokens, params))
    outputs = llm.generate(
        [{"prompt_token_ids": tokens.tolist()} for _, tokens, _ in runnable],
        [params for _, _, params in runnable],
        use_tqdm=use_tqdm,
        groups=_engine_groups(plan, [(r.index, tokens) for r, tokens, _ in runnable]),
    )
    tokenizer = llm.get_tokenizer()
    lines_by_index: dict[int, str] = {}
    summary = RunSummary(total=ingestor.total, prompt_tokens=ingestor.prompt_tokens)
    for (request, _, _), out in zip(runnable, outputs, strict=True):
        lines_by_index[request.index] = success_line(
            request.index,
            request.custom_id,
            request.endpoint,
            request.params,
            model,
            out,
            tokenizer,
        )
        summary.completion_tokens += len(out.outputs[0].token_ids)
    _write(output_path, lines_by_index)
    _write(errors_path, {e.index: e.to_line() for e in errors})
    summary.completed = len(lines_by_index)
    summary.failed = len(errors)
    summary.prefix_tokens_saved = plan.prefix_tokens_saved
    summary.num_groups = plan.num_groups
    for e in errors:
        summary.errors_by_code[e.code] = summary.errors_by_code.get(e.code, 0) + 1
    summary.seconds = time.perf_counter() - start
    return summary


def _engine_groups(plan: JobPlan, runnable: list[tuple[int, Any]]) -> _Groups:
    """The plan's groups over the requests the engine accepted (as the workers form them)."""
    position = {line: pos for pos, (line, _) in enumerate(runnable)}
    groups = []
    for unit in plan.units:
        members = tuple(position[i] for i in unit.indices if i in position)
        if unit.prefix_len and len(members) >= 2:
            first = runnable[members[0]][1][: unit.prefix_len]
            prompts = [runnable[m][1] for m in members]
            if all(
                len(p) > unit.prefix_len and np.array_equal(p[: unit.prefix_len], first)
                for p in prompts
            ):
                groups.append(_Group(unit.prefix_len, members))
    return _Groups(groups)


def _write(path: Path, lines: dict[int, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for index in sorted(lines):
            f.write(lines[index])
            f.write("\n")
