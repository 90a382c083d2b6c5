"""The `prefixgrove` command: run a batch locally, serve the planner or a worker, and talk to a planner."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prefixgrove import settings as cfg
from prefixgrove.settings import (
    ClientSettings,
    IngestSettings,
    LogSettings,
    PlannerSettings,
    SecuritySettings,
    WorkerSettings,
)

log = logging.getLogger("prefixgrove.client")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _configure_logging(cfg.load(LogSettings, args).log_format, args.quiet)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad settings or input: say what, no traceback
        return _fail(parser, str(exc), 2)
    except OSError as exc:  # a file that cannot be read or written
        return _fail(parser, str(exc), 1)
    except Exception as exc:
        # NOTE: imported here so that `run` starts without gRPC
        from prefixgrove.planner.client import PlannerError

        if isinstance(exc, PlannerError):
            return _fail(parser, str(exc), 1)
        raise


def _fail(parser: argparse.ArgumentParser, message: str, status: int) -> int:
    """One line on stderr in argparse's own words (`prefixgrove: error: ...`)."""
    print(f"{parser.prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return status


def _configure_logging(log_format: str, quiet: bool = False) -> None:
    """Logs (and the progress of `run`, logger prefixgrove.run) on stderr as text or JSON lines;
    quiet: warnings and errors only. Python's warnings go through the same handler."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)


def _bars(args: argparse.Namespace) -> bool:
    """Whether a progress bar may draw on stderr: text logs, not quiet, no JSON output."""
    return not (args.quiet or args.json or cfg.load(LogSettings, args).log_format == "json")


class _JsonFormatter(logging.Formatter):
    """One JSON object a line, for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _check_input(path: Path) -> None:
    """A missing input is one line of error (exit 2), not a traceback."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")


CLIENT_COMMANDS = ("submit", "status", "cancel", "results", "list")
# The settings each command loads: its flags are these classes' fields (settings.add_arguments),
# each with its default and its PREFIXGROVE_* variable; every command has LogSettings' too.
SETTINGS: dict[tuple[str, ...], tuple[type, ...]] = {
    ("run",): (IngestSettings,),
    ("serve", "planner"): (PlannerSettings, IngestSettings, SecuritySettings),
    ("serve", "worker"): (WorkerSettings,),
    **{(name,): (ClientSettings, SecuritySettings) for name in CLIENT_COMMANDS},
}


def _parser() -> argparse.ArgumentParser:
    from prefixgrove import __version__

    parser = argparse.ArgumentParser(
        prog="prefixgrove",
        description=f"{__doc__} Every option can come before or after the command; each setting "
        "is also read from its PREFIXGROVE_* variable (the flag wins).",
    )
    parser.add_argument("--version", action="version", version=f"prefixgrove {__version__}")
    _global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    run = _command(sub, ("run",), "run a batch file in this process (no Redis, no planner)", _run)
    run.add_argument("input", type=Path, help="OpenAI Batch JSONL")
    run.add_argument("-o", "--output", type=Path, required=True, help="the output JSONL")
    run.add_argument("--errors", type=Path, default=None,
                     help="the error JSONL; default: OUTPUT with .errors.jsonl")  # fmt: skip
    run.add_argument("--model", required=True, help="a preset, a Hugging Face directory or a .gguf")
    run.add_argument("--served-model-name", default="",
                     help="the name lines' body.model call the model by; default: --model")  # fmt: skip
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto: cuda when there is a GPU")  # fmt: skip
    run.add_argument("--dtype", default="auto", help="the weights' and activations' dtype")
    run.add_argument("--seed", type=int, default=0, help="the engine's random seed")
    run.add_argument("--json", action="store_true",
                     help="print a JSON summary on stdout, no progress bar")  # fmt: skip
    resume = "keep what OUTPUT and ERRORS answer of this input, run the rest (else overwrite)"
    run.add_argument("--resume", action="store_true", help=resume)

    serve = sub.add_parser("serve", help="serve the planner or a worker")
    roles = serve.add_subparsers(dest="role", required=True)
    _command(roles, ("serve", "planner"), "the planner (gRPC, and HTTP if --http-port)",
             _serve_planner)  # fmt: skip
    _command(roles, ("serve", "worker"), "a worker: leases groups and runs the engine",
             _serve_worker)  # fmt: skip

    submit = _command(sub, ("submit",), "send a batch file to the planner", _submit)
    submit.add_argument("input", type=Path, help="OpenAI Batch JSONL")
    submit.add_argument("--model", default="",
                        help="the job's model; default: the planner's first")  # fmt: skip
    submit.add_argument("--idempotency-key", default="",
                        help="a second submit with this key returns the first's job; default: none")  # fmt: skip
    submit.add_argument(
        "--wait", action="store_true", help="follow the job, then download its results"
    )
    submit.add_argument("-o", "--output", type=Path,
                        help="with --wait: the output JSONL; default: none")  # fmt: skip
    submit.add_argument("--errors", type=Path,
                        help="with --wait: the error JSONL; default: OUTPUT with .errors.jsonl")  # fmt: skip
    for name, helptext, func in (
        ("status", "show a job (follow it with --watch)", _status),
        ("cancel", "cancel a job", _cancel),
        ("results", "download a job's output and error files", _results),
        ("list", "list recent jobs", _list),
    ):
        command = _command(sub, (name,), helptext, func)
        if name != "list":
            command.add_argument("job", help="the job's id")
        if name == "status":
            command.add_argument("--watch", action="store_true", help="follow the job to its end")
        if name == "results":
            command.add_argument(
                "-o", "--output", type=Path, required=True, help="the output JSONL"
            )
            command.add_argument("--errors", type=Path,
                                 help="the error JSONL; default: OUTPUT with .errors.jsonl")  # fmt: skip
    _note_defaults(parser)
    return parser


def _global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-format and --quiet, on the top parser and again on each command, so that they may
    come before or after it; a command's copy leaves alone what the top one was given."""
    cfg.add_arguments(parser, LogSettings, suppress=not top)
    quiet = "only warnings and errors on stderr: no progress"
    parser.add_argument("-q", "--quiet", action="store_true",
                        default=False if top else argparse.SUPPRESS, help=quiet)  # fmt: skip


def _command(sub: Any, path: tuple[str, ...], helptext: str, func: Any) -> argparse.ArgumentParser:
    command: argparse.ArgumentParser = sub.add_parser(path[-1], help=helptext, description=helptext)
    cfg.add_arguments(command, *SETTINGS[path])
    if path[0] in CLIENT_COMMANDS:
        command.add_argument("--tls", action="store_true", help="TLS with the system's roots")
        command.add_argument("--json", action="store_true", help="machine-readable output")
    _global_options(command, top=False)
    command.set_defaults(func=func)
    return command


def _note_defaults(parser: argparse.ArgumentParser) -> None:
    """Ends the help of every option that does not name its default yet with it (a switch: off),
    in every command, so that no option's help leaves its default out."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _note_defaults(command)
            continue
        if not action.option_strings or action.required or action.help is None:
            continue
        if action.help == argparse.SUPPRESS or "default:" in action.help:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.default in (None, "", argparse.SUPPRESS):
            continue  # says nothing of a default: the structural test fails it
        else:
            default = str(action.default)
        action.help = f"{action.help}; default: {default}"


# --- local run ---------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    from prefixgrove.local import JobInputError, run_local

    _check_input(args.input)
    ingest = cfg.load(IngestSettings, args)
    errors = args.errors or args.output.with_name(args.output.stem + ".errors.jsonl")
    engine = {"device": args.device, "dtype": args.dtype, "seed": args.seed}
    try:
        summary = run_local(
            args.input,
            args.output,
            errors,
            args.model,
            ingest,
            engine,
            # a bar on a terminal; elsewhere (and under it) the prefixgrove.run log says how it goes
            use_tqdm=_bars(args) and sys.stderr.isatty(),
            resume=args.resume,
            served_model_name=args.served_model_name,
        )
    except JobInputError as exc:
        raise ValueError(f"{exc.code}: {exc}") from None
    info = {**summary.__dict__, "output": str(args.output), "errors": str(errors)}
    if args.json:
        print(json.dumps(info))
    else:
        ran = summary.completed + summary.failed
        rate = ran / max(summary.seconds, 1e-9)
        if summary.skipped:
            print(f"{summary.skipped} of {summary.total} already answered, skipped")
        print(f"{summary.completed} completed, {summary.failed} failed of {summary.total} in "
              f"{summary.seconds:.1f}s ({rate:.1f} req/s); output {args.output}, errors {errors}")  # fmt: skip
    return 0


# --- services ----------------------------------------------------------------------------------
def _serve_planner(args: argparse.Namespace) -> int:
    from prefixgrove.planner.server import serve

    serve(
        cfg.load(PlannerSettings, args),
        cfg.load(IngestSettings, args),
        cfg.load(SecuritySettings, args),
    )
    return 0


def _serve_worker(args: argparse.Namespace) -> int:
    from prefixgrove.worker.runner import Worker

    settings = cfg.load(WorkerSettings, args)
    worker = Worker(settings)
    if settings.metrics_port:
        worker.metrics.serve(settings.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.run(stop)
    return 0


# --- client ------------------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> Any:
    from prefixgrove.planner.client import PlannerClient

    target = cfg.load(ClientSettings, args).planner
    return PlannerClient(target, cfg.load(SecuritySettings, args), tls=args.tls)


def _submit(args: argparse.Namespace) -> int:
    _check_input(args.input)
    client = _client(args)
    if args.wait and args.output is None:
        raise ValueError("--wait needs -o OUTPUT")
    job = client.submit_file(args.input, args.model, args.idempotency_key)
    _show(job, args.json)
    if not args.wait:
        return 0
    # The results stream into the files while the job runs; the progress bar follows it meanwhile.
    download = _Download(client, job.id, args)
    download.start()
    job = _follow(client, job.id, args)
    download.join()
    return download.report(job, args)


def _status(args: argparse.Namespace) -> int:
    client = _client(args)
    job = _follow(client, args.job, args) if args.watch else client.get(args.job)
    _show(job, args.json)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    _show(_client(args).cancel(args.job), args.json)
    return 0


def _list(args: argparse.Namespace) -> int:
    for job in _client(args).list():
        _show(job, args.json)
    return 0


def _results(args: argparse.Namespace) -> int:
    client = _client(args)
    return _download(client, client.get(args.job), args)


def _download(client: Any, job: Any, args: argparse.Namespace) -> int:
    download = _Download(client, job.id, args)
    download.run()
    return download.report(job, args)


class _Download(threading.Thread):
    """A job's results into its output and error files (resumable: see PlannerClient.download),
    on a thread of its own so that `submit --wait` writes them while the job runs."""

    def __init__(self, client: Any, job_id: str, args: argparse.Namespace) -> None:
        super().__init__(name="download", daemon=True)
        self.client, self.job_id, self.output = client, job_id, args.output
        self.errors = args.errors or args.output.with_name(args.output.stem + ".errors.jsonl")
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

    bar = tqdm(unit="req", desc=job_id, dynamic_ncols=True) if _bars(args) else None
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

    from prefixgrove.planner.client import state_name

    if as_json:
        print(json.dumps(MessageToDict(job, preserving_proto_field_name=True)), flush=True)
        return
    c = job.request_counts
    line = (f"{job.id}  {state_name(job.state):<11} {c.completed + c.failed}/{c.total} done "
            f"({c.failed} failed)  queue {job.queue.depth}  model {job.model}")  # fmt: skip
    if "namespace" in job.metadata and "name" in job.metadata:  # the operator's BatchJob
        line += f"  batchjob {job.metadata['namespace']}/{job.metadata['name']}"
    if job.error.code:
        line += f"  error {job.error.code}: {job.error.message}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
