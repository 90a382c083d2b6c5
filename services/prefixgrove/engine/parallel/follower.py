"""A follower rank of a tensor-parallel engine: `python -m prefixgrove.engine.parallel.follower`.

It builds its shard of the model (the runner of its rank), then does what rank 0 tells it, in the
order rank 0 does it: allocate the cache, profile it, capture the decode graphs, and run each step
on the inputs rank 0 broadcasts. It never schedules or samples; in a decode window it takes each
step's tokens from rank 0 to advance its inputs as rank 0 advances its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..config import EngineConfig
from ..runner import kv_sizing
from ..runner.input_builder import StepInputs, StepShape
from ..runner.model_runner import ModelRunner
from .launch import join_group

logger = logging.getLogger("prefixgrove.engine.parallel.follower")


class Follower:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.last: StepInputs | None = None  # the last step's inputs: a window advances them
        self.graph: tuple[int, bool] | None = None  # the graph the last step replayed

    def handlers(self) -> dict[str, Any]:
        r = self.runner
        return {
            "allocate": r.allocate_local,
            "profile_begin": lambda: kv_sizing.begin_profile(r),
            "profile_end": lambda: kv_sizing.blocks_after_profile(r),
            "capture": r.capture_graphs,
            "step": self.step,
            "window": self.window,
        }

    @torch.inference_mode()
    def step(
        self, shape: StepShape, graph: tuple[int, bool] | None, slices: list[tuple[int, int]]
    ) -> None:
        r = self.runner
        r.parallel.broadcast(r.builder.arena.device)
        self.last, self.graph = r.builder.views([], shape), graph
        if graph is not None:
            assert r.graphs is not None, "rank 0 replays graphs this rank did not capture"
            r.graphs.replay(graph)
        else:
            self._eager(self.last, slices)

    def _eager(self, inputs: StepInputs, slices: list[tuple[int, int]]) -> None:
        r = self.runner
        hidden = r.hidden_states(inputs)
        if inputs.sampled is None:
            for row, n in slices:  # the prompt rows rank 0 scores, in its order
                r.model.compute_logits(hidden[row : row + n])
            hidden = hidden[inputs.logits_indices]
        r.model.compute_logits(hidden)

    @torch.inference_mode()
    def window(self, steps: int, rows: int) -> None:
        """The rest of a decode window whose first step was the last `step`."""
        r, inputs = self.runner, self.last
        assert inputs is not None
        tokens = torch.empty(rows, dtype=torch.float32, device=r.device)
        for _ in range(steps):
            r.parallel.broadcast(tokens)
            r.advance_inputs(inputs, tokens, rows)
            if self.graph is not None and r.graphs is not None:
                r.graphs.replay_last()
            else:
                self._eager(inputs, [])


def follow(runner: ModelRunner, connection: Connection) -> int:
    """Runs rank 0's commands until 'stop' (0) or until rank 0 is gone (1)."""
    handlers = Follower(runner).handlers()
    while True:
        try:
            op, args = connection.recv()
        except (EOFError, OSError):
            logger.error("rank 0 is gone: this follower ends")
            return 1
        if op == "stop":
            # rank 0 tears the group down at the same time: NCCL's teardown needs both sides, and
            # it waits for the graphs that captured its collectives to be gone
            runner.release_graphs()
            torch.distributed.destroy_process_group()
            return 0
        handlers[op](*args)


def _exit_with_parent() -> None:
    """A follower blocked in a collective when rank 0 was killed would wait for the timeout."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    connection = Connection(int(os.environ["PREFIXGROVE_TP_FD"]))
    rank: int
    config: EngineConfig
    rank, config, init_method = connection.recv()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(message)s")
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    if config.device == "cpu":  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    parallel = join_group(
        rank,
        config.tensor_parallel_size,
        config.device,
        init_method,
        not config.disable_custom_all_reduce,
    )
    runner = ModelRunner(config, parallel)
    os._exit(follow(runner, connection))  # no interpreter teardown: the group is gone


if __name__ == "__main__":
    main()
