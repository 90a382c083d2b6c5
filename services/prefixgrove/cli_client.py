"""The `prefixgrove` commands that talk to a planner: submit, status, cancel, results, list."""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from prefixgrove import settings as cfg
from prefixgrove.settings import ClientSettings, LogSettings, SecuritySettings
from prefixgrove.storage.locations import errors_beside, is_url

log = logging.getLogger("prefixgrove.client")


def check_input(path: Path | str) -> None:
    """A missing input is one line of error (exit 2), not a traceback; so is an object that
    cannot be found (its URL and why: no such bucket, access denied, ...)."""
    if is_url(path):
        from prefixgrove.storage.locations import ObjectLocation
        from prefixgrove.storage.objects import size_of

        if size_of(ObjectLocation.parse(str(path))) is None:
            raise ValueError(f"{path}: no such object")
        return
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")


def progress_bars(args: argparse.Namespace) -> bool:
    """Whether a progress bar may draw on stderr: text logs, not quiet, no JSON output."""
    return not (args.quiet or args.json or cfg.load(LogSettings, args).log_format == "json")


def _client(args: argparse.Namespace) -> Any:
    from prefixgrove.planner.client import PlannerClient

    target = cfg.load(ClientSettings, args).planner
    return PlannerClient(target, cfg.load(SecuritySettings, args), tls=args.tls)


def submit(args: argparse.Namespace) -> int:
    check_input(args.input)
    if args.wait and args.output is None:
        raise ValueError("--wait needs -o OUTPUT")
    if str(args.input).endswith(".parquet"):
        return _submit_parquet(args)
    return _submit(args, args.input)


def _submit_parquet(args: argparse.Namespace) -> int:
    """A Parquet dataset: its rows sent as a batch file (made in the temp folder, row group by
    row group); with --wait, the answers joined to the rows in OUTPUT (Parquet), the job's
    JSONL results beside it (OUTPUT.jsonl, OUTPUT.errors.jsonl), as `run` leaves them."""
    import tempfile

    from prefixgrove import parquet_jobs

    if args.wait and not str(args.output).endswith(".parquet"):
        raise ValueError(f"{args.output}: a Parquet input's output is Parquet too (OUTPUT.parquet)")
    columns = parquet_jobs.columns_of(args)
    answers = _jsonl_beside(args) if args.wait else args
    with tempfile.TemporaryDirectory(prefix="prefixgrove-parquet-") as scratch:
        requests = parquet_jobs.write_jsonl(args.input, columns, Path(scratch) / "requests.jsonl")
        status = _submit(answers, requests)
    if args.wait and status == 0:  # a job that ended unfinished keeps its JSONL results alone
        _write_parquet(args.input, answers, args.output)
    return status


def _jsonl_beside(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments with the job's JSONL results beside OUTPUT.parquet: OUTPUT.parquet.jsonl
    and (without --errors) OUTPUT.parquet.errors.jsonl, as `run` leaves them."""
    answers = argparse.Namespace(**vars(args))
    answers.output = f"{args.output}.jsonl"
    answers.errors = args.errors or f"{args.output}.errors.jsonl"
    return answers


def _write_parquet(
    rows: Path | str | None, answers: argparse.Namespace, target: Path | str
) -> None:
    """The answers in JSONL as Parquet: joined to the dataset's rows, or without one the result
    columns alone."""
    from prefixgrove import parquet_jobs

    if rows is None:
        parquet_jobs.write_result_columns(answers.output, answers.errors, target)
        log.info("the answers' columns -> %s", target)
        return
    parquet_jobs.write_results(rows, answers.output, answers.errors, target)
    log.info("the rows with their answers -> %s", target)


def _submit(args: argparse.Namespace, source: Path | str) -> int:
    client = _client(args)
    if args.wait:  # before the job exists: a path that would be refused submits nothing
        from prefixgrove.planner.download import check_paths

        check_paths(args.output, errors_path(args))
    job = client.submit_file(source, args.model, args.idempotency_key)
    _show(job, args.json)
    if not args.wait:
        return 1 if _ended_unanswered(job) else 0
    # The results stream into the files while the job runs; the progress bar follows it meanwhile.
    download = _Download(client, job.id, args)
    download.start()
    job = _follow(client, job.id, args)
    download.join()
    return download.report(job, args)


def _ended_unanswered(job: Any) -> bool:
    """A submit that gives back a failed or cancelled job (its key's, say) did not submit it."""
    from prefixgrove_proto import planner_pb2 as pb

    return job.state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLING, pb.JOB_STATE_CANCELLED)


def status(args: argparse.Namespace) -> int:
    client = _client(args)
    job = _follow(client, args.job, args) if args.watch else client.get(args.job)
    _show(job, args.json)
    return 0


def cancel(args: argparse.Namespace) -> int:
    _show(_client(args).cancel(args.job), args.json)
    return 0


def list(args: argparse.Namespace) -> int:
    for job in _client(args).list():
        _show(job, args.json)
    return 0


def results(args: argparse.Namespace) -> int:
    """The job's results as JSONL; into OUTPUT.parquet, as Parquet too (the JSONL beside it):
    joined to the rows of --input, the dataset the job was submitted from, or without it the
    result columns alone. A job that ended unfinished keeps its JSONL results alone."""
    if not str(args.output).endswith(".parquet"):
        if args.input is not None:
            raise ValueError(f"--input {args.input}: the rows are joined only into OUTPUT.parquet")
        client = _client(args)
        return _download(client, client.get(args.job), args)
    if args.input is not None:
        check_input(args.input)
        if not str(args.input).endswith(".parquet"):
            raise ValueError(f"--input {args.input}: not a Parquet dataset (*.parquet)")
    client, answers = _client(args), _jsonl_beside(args)
    status = _download(client, client.get(args.job), answers)
    if status == 0:
        _write_parquet(args.input, answers, args.output)
    return status


def _download(client: Any, job: Any, args: argparse.Namespace) -> int:
    download = _Download(client, job.id, args)
    download.run()
    if download.failure is None:
        job = client.get(job.id)  # the download followed it to its end
    return download.report(job, args)


def errors_path(args: argparse.Namespace) -> Path | str:
    """--errors, else OUTPUT with .errors.jsonl."""
    return args.errors or errors_beside(args.output)


class _Download(threading.Thread):
    """A job's results into its output and error files (resumable, and never through a link:
    see planner/download.py), on a thread of its own so that `submit --wait` writes them while
    the job runs."""

    def __init__(self, client: Any, job_id: str, args: argparse.Namespace) -> None:
        super().__init__(name="download", daemon=True)
        self.client, self.job_id, self.output = client, job_id, args.output
        self.errors = errors_path(args)
        self.counts: tuple[int, int] | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.counts = self.client.download(self.job_id, self.output, self.errors)
        except BaseException as exc:  # raised again on the caller's thread, in report()
            self.failure = exc

    def report(self, job: Any, args: argparse.Namespace) -> int:
        from prefixgrove_proto import planner_pb2 as pb

        if self.failure is not None:
            raise self.failure
        assert self.counts is not None
        done, failed = self.counts
        if args.json:
            print(json.dumps({"job": job.id, "output": str(self.output), "errors": str(self.errors),
                              "completed": done, "failed": failed}))  # fmt: skip
        else:
            print(f"{done} results -> {self.output}, {failed} errors -> {self.errors}")
        return 0 if job.state == pb.JOB_STATE_COMPLETED else 1


def _follow(client: Any, job_id: str, args: argparse.Namespace) -> Any:
    """Watches a job to its end with a progress bar (requests, req/s, tokens/s, ETA); with --json,
    prints each update; with JSON logs (or --quiet), logs the progress every few seconds."""
    from tqdm import tqdm

    from prefixgrove.planner.client import state_name

    bar = tqdm(unit="req", desc=job_id, dynamic_ncols=True) if progress_bars(args) else None
    start, job, logged, state = time.monotonic(), None, 0.0, -1
    for job in client.watch(job_id):
        counts = job.request_counts
        if args.json:
            _show(job, True)
            continue
        if bar is None:
            if time.monotonic() - logged >= _LOG_EVERY_S or job.state != state:
                logged, state = time.monotonic(), job.state
                log.info("job %s %s: %d/%d done (%d failed)", job_id, state_name(job.state),
                         counts.completed + counts.failed, counts.total, counts.failed)  # fmt: skip
            continue
        bar.total = counts.total or None
        bar.n = counts.completed + counts.failed
        elapsed = max(time.monotonic() - start, 1e-9)
        bar.set_postfix(state=state_name(job.state), failed=counts.failed,
                        tok_s=f"{job.completion_tokens / elapsed:.0f}", refresh=False)  # fmt: skip
        bar.refresh()
    if bar is not None:
        bar.close()
    return job


_LOG_EVERY_S = 2.0


def _show(job: Any, as_json: bool) -> None:
    from google.protobuf.json_format import MessageToDict

    from prefixgrove.plan_report import duration
    from prefixgrove.planner.client import state_name
    from prefixgrove_proto import planner_pb2 as pb

    if as_json:
        print(json.dumps(MessageToDict(job, preserving_proto_field_name=True)), flush=True)
        return
    c = job.request_counts
    line = (f"{job.id}  {state_name(job.state):<11} {c.completed + c.failed}/{c.total} done "
            f"({c.failed} failed)  queue {job.queue.depth}  model {job.model}")  # fmt: skip
    if "namespace" in job.metadata and "name" in job.metadata:  # the operator's BatchJob
        line += f"  batchjob {job.metadata['namespace']}/{job.metadata['name']}"
    if job.state == pb.JOB_STATE_IN_PROGRESS and job.eta_s >= 0:
        line += f"  ETA {duration(job.eta_s)}"
    if job.error.code:
        line += f"  error {job.error.code}: {job.error.message}"
    print(line, flush=True)
