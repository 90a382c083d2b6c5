"""A real worker process whose engine fails on one poisoned request: a request whose prompt holds
the token `--poison-token` makes every engine step that holds it raise (`--fault raise`) or kills
the process with SIGKILL (`--fault die`, as a segfault or the OOM killer would). Every other
request runs on the real engine. Run as a script: `python faulty_worker.py --redis-url ... [worker
flags]`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from prefixgrove import settings as cfg
from prefixgrove.cli_flags import add_arguments
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.runner import Worker, make_engine

FAULT = "injected fault: a poisoned request"


class FaultyEngine:
    def __init__(self, engine: Any, poison_token: int, fault: str) -> None:
        self.engine = engine
        self.poison_token = poison_token
        self.fault = fault
        self.poisoned: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str, tokens: Sequence[int], params: Any, **kw: Any) -> None:
        self._mark(request_id, tokens)
        self.engine.add_request(request_id, tokens, params, **kw)

    def add_group(self, group_id: str, group: Any, requests: Sequence[Any], **kw: Any) -> None:
        for request_id, tokens, _ in requests:
            self._mark(request_id, tokens)
        self.engine.add_group(group_id, group, requests, **kw)

    def abort(self, request_ids: Sequence[str]) -> None:
        self.poisoned.difference_update(request_ids)
        self.engine.abort(request_ids)

    def step(self) -> list[Any]:
        if self.poisoned:
            if self.fault == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(FAULT)
        return self.engine.step()

    def _mark(self, request_id: str, tokens: Sequence[int]) -> None:
        if self.poison_token in list(tokens):
            self.poisoned.add(request_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings, EngineSettings)
    parser.add_argument("--poison-token", type=int, required=True)
    parser.add_argument("--fault", choices=["raise", "die"], required=True)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = cfg.load(WorkerSettings, args)
    engine = make_engine(settings.model, cfg.load(EngineSettings, args))
    worker = Worker(settings, FaultyEngine(engine, args.poison_token, args.fault))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker.run(stop)


if __name__ == "__main__":
    main()
