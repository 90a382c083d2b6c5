"""Starts the processes of a tensor-parallel engine and watches them.

Rank 0 is the process that builds the engine (`LLM(...)`, `prefixgrove run`, a worker). It starts one
follower process per further device (`python -m prefixgrove.engine.parallel.follower`, not a fork: a
CUDA context does not survive one, and a spawned interpreter would run the user's script again),
hands each its rank and the engine's config over a socket pair, and joins them in one process group:
NCCL on GPUs, gloo on the CPU.

A lost rank is a lost engine: every step needs every shard. When a follower exits while the engine
runs (its process watched, or its pipe broken under rank 0's next send, whichever comes first),
rank 0 logs which one and how, and ends its own process with RANK_LOST_EXIT (a collective it may be
blocked in would otherwise wait for the timeout). A follower ends when rank 0's pipe closes.
A rank that hangs makes rank 0's next collective time out (PREFIXGROVE_TP_TIMEOUT_S): rank 0 then
kills the followers and ends the same way, saying so. (On GPUs NCCL's own watchdog may end rank 0
first, with its timeout message; the followers then end with it.)
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..runner.model_runner import ModelRunner
from .group import TensorParallel
from .leader import FollowerLink
from .peer_allreduce import PeerAllReduce

logger = logging.getLogger(__name__)

RANK_LOST_EXIT = 75
_STOP_GRACE_S = 30.0
_REAP_WAIT_S = 10.0


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("PREFIXGROVE_TP_TIMEOUT_S", "300")))


def join_group(
    rank: int, size: int, engine_device: str, init_method: str, peer_all_reduce: bool = True
) -> TensorParallel:
    """This process as rank `rank` of `size`, on its device of the engine's; on GPUs, with the
    all-reduce over peer memory unless `peer_all_reduce` is off (the same on every rank)."""
    device = TensorParallel(rank, size).device_of(engine_device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=collective_timeout(),
        device_id=torch.device(device) if cuda else None,
    )
    parallel = TensorParallel(rank, size, dist.group.WORLD)
    if cuda and peer_all_reduce:
        parallel.peer = PeerAllReduce.create(parallel, torch.device(device))
    return parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Followers:
    """Rank 0's handle on the other ranks: their processes and their command pipes."""

    processes: list[subprocess.Popen[bytes]]
    link: FollowerLink
    closing: bool = False
    _watchers: list[threading.Thread] = field(default_factory=list)
    # Rank 0's runner, weakly (the exit hook must not keep an engine's memory alive): its decode
    # graphs go before the group's teardown, which waits for them
    runner: weakref.ref[ModelRunner] | None = None

    def watch(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            thread = threading.Thread(
                target=self._watch, args=(rank, process), name=f"tp-rank-{rank}", daemon=True
            )
            thread.start()
            self._watchers.append(thread)

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        if not self.closing:
            self._end(rank, process.pid, code)

    def collective_failed(self, error: BaseException) -> None:
        """A collective of rank 0 failed. If a follower is gone (it may take a moment to be
        reaped), the engine ends as for any lost rank. If every follower lives, one of them hangs
        (the collective timed out) or the group broke: a failed group cannot be used again, so
        the followers are killed and the engine ends all the same, naming the error."""
        deadline = time.monotonic() + _REAP_WAIT_S
        while time.monotonic() < deadline:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    self._end(rank, process.pid, process.returncode)
            time.sleep(0.05)
        self.closing = True  # the watchers are not to report the kills below as lost ranks
        for process in self.processes:
            process.kill()
        self._exit(
            f"prefixgrove: a tensor-parallel collective failed with every rank alive ({error}); "
            f"a rank that does not answer within PREFIXGROVE_TP_TIMEOUT_S "
            f"({collective_timeout().total_seconds():.0f} s) hangs, and every step needs every "
            f"rank: its processes were killed and this one ends too (exit {RANK_LOST_EXIT})"
        )

    def pipe_broke(self, rank: int, error: BaseException) -> None:
        """Rank `rank`'s pipe broke: its process closed it, so it is exiting, never hung. Its
        sockets close before it can be reaped (a GPU process may take seconds to let go of its
        memory), so it gets that long to give its exit code; the engine ends either way."""
        process = self.processes[rank - 1]
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=_REAP_WAIT_S)
        self._end(rank, process.pid, process.returncode)

    def _end(self, rank: int, pid: int, code: int | None) -> None:
        how = f"with code {code}" if code is not None else "(its pipe closed)"
        self._exit(
            f"prefixgrove: tensor-parallel rank {rank} (pid {pid}) exited {how} "
            f"while the engine ran; every step needs every rank, so this process ends too "
            f"(exit {RANK_LOST_EXIT})"
        )

    @staticmethod
    def _exit(message: str) -> None:
        logger.critical(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(RANK_LOST_EXIT)

    def close(self) -> None:
        """Stops the followers and tears the group down with them (NCCL's teardown is collective:
        every rank at once), then waits for them to end."""
        if self.closing:
            return
        self.closing = True
        runner = self.runner() if self.runner is not None else None
        if runner is not None:
            runner.release_graphs()
        # a follower already gone ends this process as a lost rank (link.on_lost): its group could
        # not be torn down; without the hook (a link not started here) its error is ignored
        with contextlib.suppress(OSError):
            self.link.send("stop")
        if dist.is_initialized():
            _within(_STOP_GRACE_S, dist.destroy_process_group)
        for process in self.processes:
            try:
                process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()


def _within(seconds: float, call: Callable[[], object]) -> None:
    """Runs `call` for at most `seconds`: a teardown that does not end (NCCL's can wait forever on
    a rank that never joins it) must not keep the engine's process from ending."""
    thread = threading.Thread(target=call, daemon=True, name="tensor-parallel-teardown")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        logger.warning("the tensor-parallel group's teardown did not end in %.0f s: left", seconds)


def start_followers(config: EngineConfig) -> tuple[TensorParallel, Followers]:
    """Rank 0: starts ranks 1..N-1, joins them in one process group, returns this rank's place
    and the followers' handle (watched from here on; closed at exit at the latest)."""
    size = config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes, connections = [], []
    for rank in range(1, size):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PREFIXGROVE_TP_FD": str(theirs.fileno())}
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "prefixgrove.engine.parallel.follower"],
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        )
        theirs.close()
        connection = Connection(ours.detach())
        connection.send((rank, config, init_method))
        connections.append(connection)
    followers = Followers(processes, FollowerLink(connections))
    followers.watch()
    atexit.register(followers.close)
    parallel = join_group(0, size, config.device, init_method, not config.disable_custom_all_reduce)
    parallel.on_error = followers.collective_failed
    followers.link.on_lost = followers.pipe_broke
    logger.info("tensor parallelism: %d ranks (%s)", size, dist.get_backend())
    return parallel, followers


def start_runner(config: EngineConfig) -> tuple[ModelRunner, Followers | None]:
    """Rank 0's runner, with its followers started and linked when the engine spans devices."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config), None
    parallel, followers = start_followers(config)
    runner = ModelRunner(config, parallel)
    runner.link = followers.link
    followers.runner = weakref.ref(runner)  # closed at exit too, where no one closed the engine
    return runner, followers
