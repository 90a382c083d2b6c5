"""`prefixgrove run`: one process, no Redis, no gRPC; the same validation, grouping, engine and output
lines as the planner and the workers.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixgrove.grouping import PrefixGroup
from prefixgrove.jobs.ingest import JobIngestor, JobPlan
from prefixgrove.jobs.output_lines import success_line
from prefixgrove.jobs.requests import BatchRequest, RequestError, engine_error
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings

if TYPE_CHECKING:
    from prefixgrove.engine import LLM, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
_READ_LINES = 4096


class JobInputError(ValueError):
    """The whole input is not a batch (empty, or not JSONL)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RunSummary:
    """What a local run did (the CLI prints it)."""

    total: int  # request lines
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    prefix_tokens_saved: int
    num_groups: int
    seconds: float
    errors_by_code: dict[str, int]


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
    from prefixgrove.engine import LLM, EngineConfig

    start = time.perf_counter()
    engine_args = {**engine_args, "max_model_len": ingest.max_model_len}
    limit = EngineConfig.create(model, **engine_args).model.max_model_len  # no weights yet
    ingestor = JobIngestor(PromptTokenizer(model, limit), ingest)
    requests, errors = _read_job(ingestor, input_path)
    plan = ingestor.plan()
    llm = LLM(model, **engine_args)
    runnable = _runnable(llm, requests, errors)
    outputs = llm.generate(
        [{"prompt_token_ids": tokens.tolist()} for _, tokens, _ in runnable],
        [params for _, _, params in runnable],
        use_tqdm=use_tqdm,
        groups=_engine_groups(plan, [request.index for request, _, _ in runnable]),
    )
    lines = _output_lines(runnable, outputs, model, llm.get_tokenizer(), errors)
    _write(output_path, lines)
    _write(errors_path, {e.index: e.to_line() for e in errors})
    return RunSummary(
        total=ingestor.total,
        completed=len(lines),
        failed=len(errors),
        prompt_tokens=ingestor.prompt_tokens,
        completion_tokens=sum(len(out.outputs[0].token_ids) for out in outputs),
        prefix_tokens_saved=plan.prefix_tokens_saved,
        num_groups=plan.num_groups,
        seconds=time.perf_counter() - start,
        errors_by_code=dict(Counter(e.code for e in errors)),
    )


def _read_job(
    ingestor: JobIngestor, path: Path
) -> tuple[list[tuple[BatchRequest, Any]], list[RequestError]]:
    """The job's valid requests with their tokens, and the lines that failed; raises JobInputError
    when the whole input is not a batch."""
    requests: list[tuple[BatchRequest, Any]] = []
    errors: list[RequestError] = []
    for lines in read_lines(path):
        batch = ingestor.add(lines)
        requests.extend(batch.requests)
        errors.extend(batch.errors)
    problem = ingestor.job_error()
    if problem is not None:
        raise JobInputError(*problem)
    return requests, errors


def _runnable(
    llm: LLM, requests: list[tuple[BatchRequest, Any]], errors: list[RequestError]
) -> list[tuple[BatchRequest, Any, SamplingParams]]:
    """The requests the engine accepts, with their sampling settings; the others join `errors`."""
    from prefixgrove.engine import SamplingParams

    runnable = []
    for request, tokens in requests:
        try:
            params = SamplingParams(**request.params)
            llm.engine.validate(tokens, params)
        except ValueError as exc:
            errors.append(engine_error(request.index, request.custom_id, exc))
            continue
        runnable.append((request, tokens, params))
    return runnable


def _output_lines(
    runnable: list[tuple[BatchRequest, Any, SamplingParams]],
    outputs: list[RequestOutput],
    model: str,
    tokenizer: Any,
    errors: list[RequestError],
) -> dict[int, str]:
    """Each answered request's output line, by line index; a request whose line cannot be written
    joins `errors` alone."""
    lines = {}
    for (request, _, _), out in zip(runnable, outputs, strict=True):
        try:
            lines[request.index] = success_line(
                request.index,
                request.custom_id,
                request.endpoint,
                request.params,
                model,
                out,
                tokenizer,
            )
        except Exception as exc:  # NOTE: one request's output never costs the others theirs
            log.exception("request %r: its output line failed", request.custom_id)
            errors.append(
                RequestError(
                    request.index,
                    request.custom_id,
                    "output_failed",
                    f"the request ran but its output line could not be written: {exc!r}",
                )
            )
    return lines


def _engine_groups(plan: JobPlan, lines: list[int]) -> list[PrefixGroup]:
    """The plan's groups over the positions of the requests the engine accepted (line indices in
    `lines`), as the workers form them: a group left with one request runs it alone."""
    position = {line: pos for pos, line in enumerate(lines)}
    groups = []
    for unit in plan.units:
        members = tuple(position[i] for i in unit.indices if i in position)
        if unit.prefix_len and len(members) >= 2:
            groups.append(PrefixGroup(unit.prefix_len, members))
    return groups


def _write(path: Path, lines: dict[int, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for index in sorted(lines):
            f.write(lines[index])
            f.write("\n")
