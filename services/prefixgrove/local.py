"""`prefixgrove run`: one process, no Redis, no gRPC; the same validation, grouping, engine and output
lines as the planner and the workers.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from prefixgrove import local_resume
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.grouping import PrefixGroup
from prefixgrove.held_answers import drop_held
from prefixgrove.input_lines import line_batches
from prefixgrove.jobs.ingest import JobIngestor, JobPlan
from prefixgrove.jobs.ordered_writer import OrderedWriter, Resumed
from prefixgrove.jobs.output_lines import failed_output, run_tag, success_line
from prefixgrove.jobs.prompt_parts import PartsEngine, split
from prefixgrove.jobs.request_errors import RequestError, engine_error
from prefixgrove.jobs.requests import BatchRequest
from prefixgrove.jobs.sampling_fields import sampling_kwargs
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.local_resume import Rerun
from prefixgrove.output_files import check_outputs
from prefixgrove.settings import IngestSettings, served_names

if TYPE_CHECKING:
    from prefixgrove.engine import LLM, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
# what the run is doing, phase by phase (the CLI's --log-format and --quiet apply to it)
progress = logging.getLogger("prefixgrove.run")
_READ_LINES = 4096
PROGRESS_EVERY_S = 2.0  # the least time between two progress lines of one phase


class JobInputError(ValueError):
    """The whole input is not a batch (empty, or not JSONL)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RunSummary:
    """What a local run did (the CLI prints it)."""

    total: int  # request lines
    completed: int  # by this run, as are failed and errors_by_code
    failed: int
    skipped: int  # answered by an earlier run (--resume); total = skipped + completed + failed
    rerun: tuple[Rerun, ...]  # answered by an earlier run, but run again: their answers were stale
    prompt_tokens: int
    completion_tokens: int
    prefix_tokens_saved: int
    num_groups: int
    seconds: float  # the whole run, loading included
    decode_seconds: float  # running the requests through the engine
    errors_by_code: dict[str, int]


def read_lines(
    path: Path | str, max_line_bytes: int, chunk: int = _READ_LINES
) -> Iterator[list[bytes]]:
    """The input's lines (a file, or an object by URL) in batches, in bounded memory: a line over
    `max_line_bytes` is never held whole (input_lines.py), and it fails alone as
    `line_too_large`."""
    return line_batches(path, max_line_bytes, chunk)


def run_local(
    input_path: Path | str,
    output_path: Path | str,
    errors_path: Path | str,
    model: str,
    ingest: IngestSettings,
    engine: EngineSettings,
    use_tqdm: bool | Callable[..., tqdm] = True,
    resume: bool = False,
    served_model_name: str | Sequence[str] = "",
    progress_every_s: float = PROGRESS_EVERY_S,
    run_id: str = "",
) -> RunSummary:
    """Runs the job, appending each answer to its file once every line before it is answered.
    engine: the engine's knobs, as `LLM(...)` and a worker take them; the job's context limit is
    ingest's max_model_len where set, else the engine's. resume: keep the files' answers to this
    input's unchanged requests (kept_answers.py; ResumeMismatch if they answer another input) and
    run the rest; otherwise they are overwritten (a link at an output path is refused first).
    served_model_name: the names lines call the model by, the first its own, the others aliases
    (default: `model`); a line naming another model is `model_not_found`, as a worker answers it.
    run_id: its run tag is in every id the run writes (output_lines.run_tag); default: the tag of
    the answers a resume keeps, else a new one, so that no two runs share an id.

    Each phase logs its progress on logger prefixgrove.run (at most every progress_every_s) and
    its end: loading the tokenizer and the model, reading and tokenizing the lines, grouping
    them, and (when use_tqdm is False: no bar shows it) decoding."""
    start = time.perf_counter()
    check_outputs(output_path, errors_path)
    if not resume:
        drop_held(output_path)  # answers a stopped run held are for its --resume, not a fresh run
    engine = engine.replace(max_model_len=ingest.max_model_len or engine.max_model_len)
    names = served_names(_joined(served_model_name)) or [model]
    ingestor = _ingestor(model, names, ingest, engine)
    requests, errors = _read_job(ingestor, input_path, progress_every_s)
    plan = _plan(ingestor, names[0])
    llm = _load(model, engine)
    runnable = _runnable(llm, requests, errors)
    # read once the engine said which requests it refuses: their error lines are known then
    outputs = (output_path, errors_path)
    found = local_resume.resume(*outputs, ingestor.total, runnable, errors) if resume else None
    done, reruns, kept_tag = found or local_resume.FRESH
    todo = [item for item in runnable if done.runs(item[0].index)]
    failures = [e for e in errors if done.runs(e.index)]
    decoding = time.perf_counter()
    how = _Decoding(names[0], _tag(run_id, kept_tag), plan, use_tqdm, progress_every_s)
    written, completion_tokens = _answer_all(llm, outputs, done, todo, failures, how)
    return RunSummary(
        total=ingestor.total,
        completed=written[0],
        failed=written[1],
        skipped=done.skipped,
        rerun=reruns,
        prompt_tokens=ingestor.prompt_tokens,
        completion_tokens=completion_tokens,
        prefix_tokens_saved=plan.prefix_tokens_saved,
        num_groups=plan.num_groups,
        seconds=time.perf_counter() - start,
        decode_seconds=time.perf_counter() - decoding,
        errors_by_code=dict(Counter(e.code for e in failures)),
    )


def _tag(run_id: str, kept: str | None) -> str:
    """The run tag of the run's ids: its run id's, else the answers kept's, else a new one."""
    return run_tag(run_id) if run_id else kept or run_tag(uuid.uuid4().hex)


def _joined(names: str | Sequence[str]) -> str:
    return names if isinstance(names, str) else ",".join(names)


@dataclass(frozen=True)
class _Decoding:
    """How the requests are run and answered: the served name the answers give, the run tag of
    their ids, the job's plan, the progress bar and how often progress is logged."""

    name: str
    tag: str
    plan: JobPlan
    use_tqdm: bool | Callable[..., tqdm]
    progress_every_s: float


def _answer_all(
    llm: LLM,
    outputs: tuple[Path | str, Path | str],
    done: Resumed,
    todo: list[tuple[BatchRequest, list[int], SamplingParams]],
    failures: list[RequestError],
    how: _Decoding,
) -> tuple[list[int], int]:
    """Writes the failures' lines and runs `todo`, each answer written once every line before it
    is; returns the lines written (output, errors) and the completion tokens. A run stopped by
    anything, Ctrl-C too, writes what it can and keeps the rest for --resume."""
    with local_resume.open_writer(*outputs, done) as writer:
        try:
            for e in failures:
                writer.put(e.index, e.to_line(how.tag), failed=True)
            writer.flush()
            answer = _Answer(how.name, how.tag, llm.get_tokenizer(), writer, failures)
            groups = _engine_groups(how.plan, [request.index for request, _, _ in todo])
            tokens = _generate(llm, todo, groups, answer, how.use_tqdm, how.progress_every_s)
        except BaseException:
            local_resume.hold(outputs[0], writer)
            raise
    drop_held(outputs[0])
    return writer.written, tokens


def _ingestor(
    model: str, names: list[str], ingest: IngestSettings, engine: EngineSettings
) -> JobIngestor:
    """Reads and tokenizes lines under the engine's context limit (known before any weights);
    lines naming any of `names` run on the model, called by the first."""
    from prefixgrove.engine import EngineConfig

    start = time.perf_counter()
    progress.info("loading the tokenizer of %s", model)
    limit = EngineConfig.from_settings(model, engine).model.max_model_len
    aliases = dict.fromkeys(names[1:], names[0])
    ingestor = JobIngestor({names[0]: PromptTokenizer(model, limit)}, ingest, aliases=aliases)
    progress.info("tokenizer loaded in %.1fs", time.perf_counter() - start)
    return ingestor


def _load(model: str, engine: EngineSettings) -> LLM:
    from prefixgrove.engine import LLM

    defaults = EngineSettings().as_kwargs()
    changed = {k: v for k, v in engine.as_kwargs().items() if v != defaults[k]}
    progress.info("loading model %s (%s)", model, _engine_text(changed) or "engine defaults")
    start = time.perf_counter()
    llm = LLM(model, **engine.as_kwargs())
    # a completions line of several prompts runs each as a request of its own, as on a worker
    llm.engine = PartsEngine(llm.engine)  # type: ignore[assignment]
    progress.info("model %s loaded in %.1fs", model, time.perf_counter() - start)
    return llm


class _Every:
    """Says yes at most once every `seconds` (the first time `seconds` after it was made)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.last = seconds, time.perf_counter()

    def __call__(self) -> bool:
        now = time.perf_counter()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


def _engine_text(engine_args: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in engine_args.items() if v is not None)


def _read_job(
    ingestor: JobIngestor, path: Path | str, every_s: float = PROGRESS_EVERY_S
) -> tuple[list[tuple[BatchRequest, Any]], list[RequestError]]:
    """The job's valid requests with their tokens, and the lines that failed; raises JobInputError
    when the whole input is not a batch."""
    requests: list[tuple[BatchRequest, Any]] = []
    errors: list[RequestError] = []
    progress.info("reading and tokenizing %s", path)
    start, due, count = time.perf_counter(), _Every(every_s), 0
    for lines in read_lines(path, ingestor.settings.max_line_bytes, _READ_LINES):
        batch = ingestor.add(lines)
        requests.extend(batch.requests)
        errors.extend(batch.errors)
        count += len(lines)
        if due():
            rate = count / max(time.perf_counter() - start, 1e-9)
            progress.info("read %d lines (%.0f lines/s), %d invalid so far", count, rate, len(errors))  # fmt: skip
    seconds = time.perf_counter() - start
    progress.info(
        "read %d lines in %.1fs (%.0f lines/s): %d requests, %d prompt tokens, %d invalid lines",
        count, seconds, count / max(seconds, 1e-9), len(requests), ingestor.prompt_tokens,
        len(errors),
    )  # fmt: skip
    problem = ingestor.job_error()
    if problem is not None:
        raise JobInputError(*problem)
    return requests, errors


def _runnable(
    llm: LLM, requests: list[tuple[BatchRequest, Any]], errors: list[RequestError]
) -> list[tuple[BatchRequest, list[int], SamplingParams]]:
    """The requests the engine accepts, with their checked token ids and sampling settings; the
    others join `errors`. Requests asking alike share one SamplingParams (the engine takes its
    own copy of each as it runs): held for a whole job, one each took 2.4 KB a request."""
    from prefixgrove.engine import SamplingParams

    runnable = []
    shared: dict[str, SamplingParams] = {}
    for request, tokens in requests:
        try:
            key = json.dumps(request.params)  # key order counts: a schema's is its output's
            if key not in shared:
                shared[key] = SamplingParams(**sampling_kwargs(request.params))
            params = shared[key]
            ids = llm.engine.validate(split(tokens, request.params), params)
        except ValueError as exc:
            errors.append(engine_error(request.index, request.custom_id, exc))
            continue
        runnable.append((request, ids, params))
    return runnable


def _plan(ingestor: JobIngestor, name: str) -> JobPlan:
    """The job's prefix groups (of model `name`), with what grouping found."""
    start = time.perf_counter()
    progress.info("grouping %d requests by shared prefix", ingestor.total)
    plan = ingestor.plan()[name]
    tokens = ingestor.prompt_tokens
    share = 100 * plan.prefix_tokens_saved / tokens if tokens else 0.0
    progress.info(
        "grouped in %.1fs: %d groups, %d shared-prefix tokens computed once (%.1f%% of %d prompt "
        "tokens)", time.perf_counter() - start, plan.num_groups, plan.prefix_tokens_saved, share,
        tokens,
    )  # fmt: skip
    return plan


def _generate(
    llm: LLM,
    todo: list[tuple[BatchRequest, list[int], SamplingParams]],
    groups: list[PrefixGroup],
    answer: _Answer,
    use_tqdm: bool | Callable[..., tqdm],
    every_s: float = PROGRESS_EVERY_S,
) -> int:
    """Runs `todo` through the engine, handing each finished request to `answer` and flushing
    after every step that finished some; returns the completion tokens. Without a bar
    (use_tqdm False), logs the requests done every `every_s`."""
    ids = [str(pos) for pos in range(len(todo))]
    token_ids = [tokens for _, tokens, _ in todo]
    params = [sp for _, _, sp in todo]
    tokens, done, due = 0, 0, _Every(every_s)
    progress.info("decoding %d requests in %d prefix groups", len(todo), len(groups))
    start = time.perf_counter()
    for finished in llm.run_requests(ids, token_ids, params, groups, use_tqdm):
        for out in finished:
            answer(todo[int(out.request_id)][0], out)
            tokens += sum(len(c.token_ids) for c in out.outputs)
        answer.writer.flush()
        done += len(finished)
        if not use_tqdm and done < len(todo) and due():
            elapsed = max(time.perf_counter() - start, 1e-9)
            progress.info("decoded %d/%d requests (%.1f req/s, %.0f tokens/s)", done, len(todo),
                          done / elapsed, tokens / elapsed)  # fmt: skip
    elapsed = max(time.perf_counter() - start, 1e-9)
    progress.info("decoded %d/%d requests in %.1fs (%.1f req/s, %.0f tokens/s)", done, len(todo),
                  elapsed, done / elapsed, tokens / elapsed)  # fmt: skip
    return tokens


@dataclass
class _Answer:
    """Turns a finished request into its output line (or, if that fails, its error line)."""

    model: str
    tag: str  # the run's, in every id
    tokenizer: Any
    writer: OrderedWriter
    failures: list[RequestError]

    def __call__(self, request: BatchRequest, out: RequestOutput) -> None:
        failed = failed_output(out)
        if failed is not None:  # the engine ended it as an error: no answer to write
            self._fail(RequestError(request.index, request.custom_id, *failed))
            return
        try:
            line = success_line(
                request.index,
                request.custom_id,
                request.endpoint,
                request.params,
                self.model,
                out,
                self.tokenizer,
                requested_model=request.model,
                tag=self.tag,
            )
        except Exception as exc:  # NOTE: one request's output never costs the others theirs
            log.exception("request %r: its output line failed", request.custom_id)
            error = RequestError(
                request.index,
                request.custom_id,
                "output_failed",
                f"the request ran but its output line could not be written: {exc!r}",
            )
            self._fail(error)
            return
        self.writer.put(request.index, line)

    def _fail(self, error: RequestError) -> None:
        self.failures.append(error)
        self.writer.put(error.index, error.to_line(self.tag), failed=True)


def _engine_groups(plan: JobPlan, lines: list[int]) -> list[PrefixGroup]:
    """The plan's groups over the positions of the requests to run (line indices in `lines`), as
    the workers form them: a group left with one request runs it alone."""
    position = {line: pos for pos, line in enumerate(lines)}
    groups = []
    for unit in plan.units:
        members = tuple(position[i] for i in unit.indices if i in position)
        if unit.prefix_len and len(members) >= 2:
            groups.append(PrefixGroup(unit.prefix_len, members))
    return groups
