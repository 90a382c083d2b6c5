"""The `prefixgrove` command: run a batch locally, serve the planner or a worker, and talk to a planner."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefixgrove import cli_client
from prefixgrove import settings as cfg
from prefixgrove.affinity_settings import AffinitySettings
from prefixgrove.cli_client import check_input, progress_bars
from prefixgrove.cli_flags import add_arguments
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.settings import (
    ClientSettings,
    IngestSettings,
    LogSettings,
    PlannerSettings,
    PlanSettings,
    SecuritySettings,
    WorkerSettings,
)
from prefixgrove.storage.locations import errors_beside, source_arg

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


CLIENT_COMMANDS = ("submit", "status", "cancel", "results", "list")
_URLS = "a path, or an object's URL: s3://BUCKET/KEY, gs://BUCKET/KEY (docs/object-storage.md)"
# The settings each command loads: its flags are these classes' fields (cli_flags.add_arguments),
# each with its default and its PREFIXGROVE_* variable; every command has LogSettings' too. `run`
# and `serve worker` take every engine knob (EngineSettings), as `LLM(...)` does.
SETTINGS: dict[tuple[str, ...], tuple[type, ...]] = {
    ("run",): (IngestSettings, EngineSettings),
    ("plan",): (PlanSettings, IngestSettings, EngineSettings),
    ("serve", "planner"): (PlannerSettings, IngestSettings, SecuritySettings),
    ("serve", "worker"): (WorkerSettings, AffinitySettings, EngineSettings),
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
    _run_command(sub)
    _plan_command(sub)
    serve = sub.add_parser("serve", help="serve the planner or a worker")
    roles = serve.add_subparsers(dest="role", required=True)
    _command(roles, ("serve", "planner"), "the planner (gRPC, and HTTP if --http-port)",
             _serve_planner)  # fmt: skip
    _command(roles, ("serve", "worker"), "a worker: leases groups and runs the engine",
             _serve_worker)  # fmt: skip
    _submit_command(sub)
    _job_commands(sub)
    _note_defaults(parser)
    return parser


def _run_command(sub: Any) -> None:
    run = _command(sub, ("run",), "run a batch file in this process (no Redis, no planner)", _run)
    run.add_argument("input", type=source_arg, help=f"OpenAI Batch JSONL; {_URLS}")
    run.add_argument("-o", "--output", type=source_arg, required=True,
                     help=f"the output JSONL; {_URLS}")  # fmt: skip
    run.add_argument("--errors", type=source_arg, default=None,
                     help="the error JSONL; default: OUTPUT with .errors.jsonl")  # fmt: skip
    run.add_argument("--model", required=True, help="a preset, a Hugging Face directory or a .gguf")
    run.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                     help="the names lines' body.model call the model by: the first is its own, "
                     "the others aliases (gpt-4o-mini for a file written for another provider); "
                     "default: --model")  # fmt: skip
    run.add_argument("--json", action="store_true",
                     help="print a JSON summary on stdout, no progress bar")  # fmt: skip
    resume = "keep what OUTPUT and ERRORS answer of this input, run the rest (else overwrite)"
    run.add_argument("--resume", action="store_true", help=resume)
    run.add_argument("--run-id", default="",
                     help="an id whose tag is in every answer id, so that runs never share ids "
                     "(the services use the job id: a job's id gives the bytes the services "
                     "write); default: a new one, or on --resume the kept answers' tag")  # fmt: skip
    _parquet_arguments(run, "OUTPUT *.parquet too")


def _parquet_arguments(command: argparse.ArgumentParser, output: str) -> None:
    parquet = f"a Parquet INPUT (*.parquet, {output}): "
    command.add_argument("--prompt-column", default="",
                         help=parquet + "the column of prompts (completions); default: none")  # fmt: skip
    command.add_argument("--messages-column", default="",
                         help=parquet + "the column of chat messages, instead; default: none")  # fmt: skip
    command.add_argument("--id-column", default="",
                         help=parquet + "an id column that must be there; default: none")  # fmt: skip
    command.add_argument("--sampling-json", default="{}",
                         help=parquet + "body fields for every row, as JSON")  # fmt: skip


def _plan_command(sub: Any) -> None:
    helptext = "predict a batch's time and cost before it runs (no device, no Redis)"
    plan = _command(sub, ("plan",), helptext, _plan)
    plan.add_argument("input", type=source_arg, help=f"OpenAI Batch JSONL; {_URLS}")
    plan.add_argument(
        "--model", required=True, help="a preset, a Hugging Face directory or a .gguf"
    )
    plan.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                      help="the names lines call the model by, as `run` takes them; default: --model")  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _submit_command(sub: Any) -> None:
    submit = _command(sub, ("submit",), "send a batch file to the planner", cli_client.submit)
    submit.add_argument("input", type=source_arg, help=f"OpenAI Batch JSONL; {_URLS}")
    submit.add_argument("--model", default="",
                        help="the job's model; default: the planner's first")  # fmt: skip
    submit.add_argument("--idempotency-key", default="",
                        help="a second submit with this key returns the first's job; default: none")  # fmt: skip
    submit.add_argument(
        "--wait", action="store_true", help="follow the job, then download its results"
    )
    submit.add_argument("-o", "--output", type=source_arg,
                        help="with --wait: the output JSONL (a path or URL); default: none")  # fmt: skip
    submit.add_argument("--errors", type=source_arg,
                        help="with --wait: the error JSONL; default: OUTPUT with .errors.jsonl")  # fmt: skip
    _parquet_arguments(submit, "with --wait OUTPUT *.parquet too")


def _job_commands(sub: Any) -> None:
    for name, helptext, func in (
        ("status", "show a job (follow it with --watch)", cli_client.status),
        ("cancel", "cancel a job", cli_client.cancel),
        ("results", "download a job's output and error files", cli_client.results),
        ("list", "list recent jobs", cli_client.list),
    ):
        command = _command(sub, (name,), helptext, func)
        if name != "list":
            command.add_argument("job", help="the job's id")
        if name == "status":
            command.add_argument("--watch", action="store_true", help="follow the job to its end")
        if name == "results":
            _results_arguments(command)


def _results_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("-o", "--output", type=source_arg, required=True,
                         help=f"the output JSONL, or *.parquet (the JSONL beside it); {_URLS}")  # fmt: skip
    command.add_argument("--errors", type=source_arg,
                         help="the error JSONL; default: OUTPUT with .errors.jsonl")  # fmt: skip
    command.add_argument("--input", type=source_arg,
                         help="with OUTPUT *.parquet: the Parquet dataset the job was submitted "
                              "from, its rows joined to the answers; default: the result columns "
                              "alone")  # fmt: skip


def _global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-format and --quiet, on the top parser and again on each command, so that they may
    come before or after it; a command's copy leaves alone what the top one was given."""
    add_arguments(parser, LogSettings, suppress=not top)
    quiet = "only warnings and errors on stderr: no progress"
    parser.add_argument("-q", "--quiet", action="store_true",
                        default=False if top else argparse.SUPPRESS, help=quiet)  # fmt: skip


def _command(sub: Any, path: tuple[str, ...], helptext: str, func: Any) -> argparse.ArgumentParser:
    command: argparse.ArgumentParser = sub.add_parser(path[-1], help=helptext, description=helptext)
    add_arguments(command, *SETTINGS[path])
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
    check_input(args.input)
    if str(args.input).endswith(".parquet"):
        return _run_parquet(args)
    errors = args.errors or errors_beside(args.output)
    summary = _run_job(args, args.input, args.output, errors)
    _report(args, summary, args.output, errors)
    return _status(summary, errors)


def _run_job(
    args: argparse.Namespace, job: Path | str, output: Path | str, errors: Path | str
) -> Any:
    from prefixgrove.local import JobInputError, run_local

    try:
        return run_local(
            job,
            output,
            errors,
            args.model,
            cfg.load(IngestSettings, args),
            cfg.load(EngineSettings, args),
            # a bar on a terminal; elsewhere (and under it) the prefixgrove.run log says how it goes
            use_tqdm=progress_bars(args) and sys.stderr.isatty(),
            resume=args.resume,
            served_model_name=args.served_model_name,
            run_id=args.run_id,
        )
    except JobInputError as exc:
        raise ValueError(f"{exc.code}: {exc}") from None


def _run_parquet(args: argparse.Namespace) -> int:
    """A Parquet dataset: its rows as a batch file, run as one, the answers joined to the rows
    in OUTPUT (Parquet); the run's own JSONL files stay beside it, for --resume."""
    import tempfile

    from prefixgrove import parquet_jobs

    if not str(args.output).endswith(".parquet"):
        raise ValueError(f"{args.output}: a Parquet input's output is Parquet too (OUTPUT.parquet)")
    columns = parquet_jobs.columns_of(args)
    answers, errors = f"{args.output}.jsonl", args.errors or f"{args.output}.errors.jsonl"
    with tempfile.TemporaryDirectory(prefix="prefixgrove-parquet-") as scratch:
        job = parquet_jobs.write_jsonl(args.input, columns, Path(scratch) / "requests.jsonl")
        summary = _run_job(args, job, answers, errors)
    parquet_jobs.write_results(args.input, answers, errors, args.output)
    _report(args, summary, args.output, errors)
    return _status(summary, errors)


def _status(summary: Any, errors: Path | str) -> int:
    """The run's exit status: 1 when every line of the input failed (nothing was answered, now
    or by an earlier run), so that a script notices; else 0."""
    if summary.total and summary.failed == summary.total:
        print(f"prefixgrove: error: every line failed ({summary.total}): see {errors}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _report(args: argparse.Namespace, summary: Any, output: Path | str, errors: Path | str) -> None:
    from prefixgrove.local_resume import rerun_text

    info = {**asdict(summary), "output": str(output), "errors": str(errors)}
    if args.json:
        print(json.dumps(info))
        return
    ran = summary.completed + summary.failed
    rate = ran / max(summary.seconds, 1e-9)
    if summary.skipped:
        print(f"{summary.skipped} of {summary.total} already answered, skipped")
    if summary.rerun:
        print(f"{len(summary.rerun)} answered before, run again: {rerun_text(summary.rerun)}")
    print(f"{summary.completed} completed, {summary.failed} failed of {summary.total} in "
          f"{summary.seconds:.1f}s ({rate:.1f} req/s); output {output}, errors {errors}")  # fmt: skip


def _plan(args: argparse.Namespace) -> int:
    from prefixgrove.plan_job import plan_file
    from prefixgrove.plan_report import plan_text

    settings = cfg.load(PlanSettings, args)
    planned = plan_file(args.input, args.model, cfg.load(IngestSettings, args),
                        cfg.load(EngineSettings, args), settings, args.served_model_name)  # fmt: skip
    if args.json:
        print(json.dumps({**planned.estimate.as_dict(), "lines": planned.lines,
                          "read_s": planned.read_s, "gpu": settings.gpu}))  # fmt: skip
    else:
        print(plan_text(planned.estimate, args.input, args.model, settings.gpu, planned.read_s))
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
    from prefixgrove.worker.runner import Worker, make_engine

    settings = cfg.load(WorkerSettings, args)
    engine = make_engine(settings.model, cfg.load(EngineSettings, args))
    worker = Worker(settings, engine, cfg.load(AffinitySettings, args))
    if settings.metrics_port:
        worker.metrics.serve(settings.metrics_port, settings.host)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
