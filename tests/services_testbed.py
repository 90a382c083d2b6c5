"""Real components for the services tests: a redis-server per test, planner and worker processes (a
module's whole stack: service_stack), a planner in process, batch files and the local run whose
answers the services must give. A test that needs redis-server fails without it under CI=true,
skips otherwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from polling import wait_for
from ports import free_port

if TYPE_CHECKING:
    from prefixgrove.planner.client import PlannerClient
    from prefixgrove.planner.server import PlannerServer
    from prefixgrove.settings import IngestSettings, SecuritySettings

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-random-llama"
MAX_MODEL_LEN = 1024


def need_redis() -> str:
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (scripts/ci/install-redis.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class RedisServer:
    """A redis-server of our own on a free loopback port; `aof=True` fsyncs every write."""

    def __init__(
        self, binary: str, workdir: Path, aof: bool = False, password: str | None = None
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.aof = aof
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.workdir), "--daemonize", "no", "--loglevel", "warning"]  # fmt: skip
        args += (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.aof
            else ["--appendonly", "no"]
        )
        if self.password:
            args += ["--requirepass", self.password]
        with (self.workdir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    log_text = (self.workdir / "redis.log").read_text()
                    raise RuntimeError(f"redis-server exited: {log_text}") from None
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start in 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis.from_url(self.url)


def service_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGROVE_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    return env


class Process:
    """A `prefixgrove serve ...` child process (or another Python program) with its log in a file."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str],
        program: tuple[str, ...] = ("-m", "prefixgrove.cli"),
    ) -> None:
        self.log = log
        cmd = [sys.executable, *program, *args]
        with log.open("ab") as handle:
            self.proc = subprocess.Popen(
                cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        """Kills the process and reaps it (teardown)."""
        self.kill()
        self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start_worker(redis_url: str, log: Path, *extra: str) -> Process:
    args = ["serve", "worker", "--redis-url", redis_url, "--model", MODEL, "--device", "cpu",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), *extra]  # fmt: skip
    return Process(args, log, service_env())


def start_planner(redis_url: str, port: int, log: Path, *extra: str) -> Process:
    args = ["serve", "planner", "--redis-url", redis_url, "--host", "127.0.0.1", "--port", str(port),
            "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), *extra]  # fmt: skip
    return Process(args, log, service_env())


def wait_for_port(port: int, proc: Process, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"process exited: {proc.text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port} after {timeout}s: {proc.text()[-3000:]}")


@dataclass
class ServiceStack:
    """A redis-server with planner and worker processes, each logging to `dir`/NAME.log: what the
    services tests run for a module (service_stack starts one). Every planner is started with
    `planner_args`, every worker with `worker_args`."""

    dir: Path
    redis: RedisServer
    planner_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    ports: dict[str, int] = field(default_factory=dict)  # each planner's gRPC port, by name
    planners: dict[str, Process] = field(default_factory=dict)
    workers: dict[str, Process] = field(default_factory=dict)

    @property
    def port(self) -> int:
        """The first planner's gRPC port."""
        return next(iter(self.ports.values()))

    @property
    def planner(self) -> Process:
        """The first planner."""
        return next(iter(self.planners.values()))

    def start_planner(self, name: str = "planner", wait: bool = True) -> Process:
        """Starts planner `name` on its port (a free one the first time it starts)."""
        port = self.ports.setdefault(name, free_port())
        log = self.dir / f"{name}.log"
        planner = self.planners[name] = start_planner(self.redis.url, port, log, *self.planner_args)
        if wait:
            wait_for_port(port, planner)
        return planner

    def restart_planner(self, name: str = "planner") -> None:
        """Kills planner `name` (SIGKILL) and starts it again on its port."""
        self.planners[name].kill()
        self.planners[name].wait(10)
        self.start_planner(name)

    def add_worker(self, name: str, *extra: str) -> Process:
        """Starts worker `name` (its consumer name too) with `worker_args` and `extra`."""
        worker = start_worker(self.redis.url, self.dir / f"{name}.log", "--consumer", name,
                              *self.worker_args, *extra)  # fmt: skip
        self.workers[name] = worker
        return worker

    def client(self, *names: str) -> PlannerClient:
        """A client of the first planner, of planner `name`, or of several planners behind one
        target (`ipv4:A,B`, what a Service's name that resolves to several pods gives gRPC)."""
        from prefixgrove.planner.client import PlannerClient

        addresses = [f"127.0.0.1:{self.ports[n]}" for n in names or [next(iter(self.ports))]]
        return PlannerClient(addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses))

    def stop(self) -> None:
        for proc in [*self.planners.values(), *self.workers.values()]:
            proc.stop()
        self.redis.kill()


@contextmanager
def service_stack(
    d: Path,
    *,
    planners: tuple[str, ...] = ("planner",),
    workers: dict[str, tuple[str, ...]] | None = None,
    planner_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    aof: bool = False,
) -> Iterator[ServiceStack]:
    """A redis-server in `d` (`aof`: fsync on every write), the planners named and the workers
    named (each with its own extra flags), once every planner's gRPC port answers; everything is
    stopped at the end."""
    redis = RedisServer(need_redis(), d, aof=aof)
    redis.start()
    stack = ServiceStack(d, redis, planner_args, worker_args)
    try:
        for name in planners:
            stack.start_planner(name, wait=False)
        for name, extra in (workers or {}).items():
            stack.add_worker(name, *extra)
        for name in planners:
            wait_for_port(stack.ports[name], stack.planners[name])
        yield stack
    finally:
        stack.stop()


@contextmanager
def planner_in_process(
    redis_url: str,
    ingest: IngestSettings | None = None,
    security: SecuritySettings | None = None,
    **settings: Any,
) -> Iterator[tuple[PlannerServer, PlannerClient]]:
    """A planner server in this process on a free gRPC port, serving MODEL unless `settings` (more
    PlannerSettings fields) name other models, and a client of it; both closed at the end."""
    from prefixgrove.planner.client import PlannerClient
    from prefixgrove.planner.server import build_server
    from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings

    planner = PlannerSettings(redis_url=redis_url, port=0, **{"model": MODEL, **settings})
    server = build_server(planner, ingest or IngestSettings(), security or SecuritySettings())
    client = PlannerClient(f"127.0.0.1:{server.port}")
    try:
        yield server, client
    finally:
        client.close()
        server.stop(0)


def local_run(job: Path, d: Path, *extra: str) -> tuple[Path, Path]:
    """`prefixgrove run` of `job` on the services' model (CPU, float32) with `extra` flags: the
    answers the services must give, in `d` (made where missing) as its output and error files."""
    d.mkdir(parents=True, exist_ok=True)
    out, err = d / "local.jsonl", d / "local.errors.jsonl"
    args = ["run", str(job), "-o", str(out), "--errors", str(err), "--model", MODEL, "--device", "cpu",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--json", *extra]  # fmt: skip
    # A process of its own, with one math thread like the workers: 2 busy cores oversubscribed
    # by torch's default threads run ten times slower.
    run = subprocess.run([sys.executable, "-m", "prefixgrove.cli", *args], env=service_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return out, err


def batch_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def shared_prefix_job(
    path: Path,
    n: int,
    *,
    docs: int = 6,
    max_tokens: int = 4,
    seed: int = 0,
    with_errors: bool = False,
) -> Path:
    """n requests over a few long shared documents: completions, chats, a sampled and a logprobs one."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    documents = [f"Doc {d}: " + " ".join(rng.choice(words) for _ in range(50)) for d in range(docs)]
    lines = []
    for i in range(n):
        doc = documents[i % docs]
        if i % 7 == 3:
            body = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": f"Q{i}?"}],
                    "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
            lines.append(batch_line(f"req-{i}", body, "/v1/chat/completions"))
            continue
        body = {
            "prompt": f"{doc}\nQuestion {i}: what follows?",
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if i % 11 == 5:
            body.update(temperature=0.7, seed=i)
        if i % 13 == 6:
            body["logprobs"] = 2
        lines.append(batch_line(f"req-{i}", body))
    if with_errors:
        lines[n // 3] = '{"custom_id": "broken", '
        lines.insert(n // 2, batch_line("req-1", {"prompt": "a duplicate id", "max_tokens": 2}))
        lines.insert(
            n // 2, batch_line("too-long", {"prompt": "z" * MAX_MODEL_LEN, "max_tokens": 2})
        )
        lines.insert(n // 4, batch_line("bad-token", {"prompt": [1, 2, 10**6], "max_tokens": 2}))
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    """Polls `predicate` every 0.1 s until it holds (the shared poller, with the services' cadence)."""
    wait_for(what, predicate, timeout, every=0.1)


def logprobs_job(path: Path, n: int, *, seed: int = 1, max_tokens: int = 6) -> Path:
    """n requests that all ask for logprobs: completions (logprobs 0..5) and chats (top_logprobs
    0..5), two in three over four shared documents (groups), the rest each on its own text, one
    completion in ten sampled with a seed, one request in seven n = 2 or 3 seeded samples."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    documents = [f"Doc {d}: " + " ".join(rng.choice(words) for _ in range(40)) for d in range(4)]
    lines = []
    for i in range(n):
        if i % 3 == 2:
            text = f"Lone {i}: " + " ".join(rng.choice(words) for _ in range(10 + i % 17))
        else:
            text = documents[i % 4]
        top = i % 6
        samples = {"n": 2 + i % 2, "temperature": 0.7, "seed": i} if i % 7 == 3 else {}
        if i % 2:
            messages = [{"role": "system", "content": text}, {"role": "user", "content": f"Q{i}?"}]
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "logprobs": True, "top_logprobs": top, **samples}  # fmt: skip
            lines.append(batch_line(f"req-{i}", body, "/v1/chat/completions"))
            continue
        body = {"prompt": f"{text}\nQuestion {i}:", "max_tokens": max_tokens, "temperature": 0,
                "logprobs": top}  # fmt: skip
        if i % 10 == 4:
            body.update(temperature=0.8, seed=i)
        body.update(samples)
        lines.append(batch_line(f"req-{i}", body))
    path.write_text("\n".join(lines) + "\n")
    return path
