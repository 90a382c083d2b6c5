"""Tensor parallelism on real GPUs (NCCL, Triton kernels, CUDA graphs with their all-reduces
captured): 2 and 4 ranks compute what one computes in fp32, and a lost rank ends the engine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_checkpoints import assert_same_tokens_and_logprobs, run, save_checkpoint
from test_tensor_parallel import _job, _script

from prefixgrove import LLM
from prefixgrove.engine.parallel.launch import RANK_LOST_EXIT

pytestmark = pytest.mark.gpu


def _needs(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def _outputs(model: str, size: int) -> list:
    prompts, params = _job()
    llm = LLM(model, device="cuda", dtype="float32", tensor_parallel_size=size,
              gpu_memory_utilization=0.3)  # fmt: skip
    try:
        assert llm.engine.runner.graphs is not None, "the decode steps must replay graphs"
        if size > 1:
            assert llm.engine.runner.parallel.peer is not None, "these GPUs map each other's memory"
        return run(llm, prompts, params)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("size", [2, 4])
def test_fp32_ranks_with_graphs_compute_what_one_gpu_computes(qwen2_dir: str, size: int) -> None:
    _needs(size)
    one = _outputs(qwen2_dir, 1)
    assert_same_tokens_and_logprobs(one, _outputs(qwen2_dir, size), tolerance=1e-3)


@pytest.mark.parametrize("size", [2, 4])
def test_the_peer_all_reduce_sums_what_nccl_sums(size: int) -> None:
    _needs(size)
    check = Path(__file__).with_name("peer_allreduce_check.py")
    proc = subprocess.run(
        [sys.executable, str(check), str(size)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _signal_a_follower_mid_job(sig: str, within_s: float, **variables: str) -> tuple[int, str, int]:
    """A TP = 2 engine on a long job whose follower gets signal `sig` 3 s in: (the script's exit
    code, its stderr, the follower's pid), or an AssertionError if it runs past `within_s`."""
    proc = _script(
        f"""
        import os, signal, threading
        from prefixgrove import LLM, SamplingParams
        llm = LLM("tiny-random-llama", tensor_parallel_size=2, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.3)
        pid = llm.engine.followers.processes[0].pid
        threading.Timer(3.0, os.kill, (pid, signal.{sig})).start()
        print(pid, flush=True)
        while True:
            llm.generate([{{"prompt_token_ids": [1, 2, 3]}}] * 64,
                         SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
        """,
        **variables,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        raise AssertionError(f"the engine did not start: {proc.communicate()[1][-3000:]}")
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        raise AssertionError(f"the engine outlived its {sig} rank by {within_s} s") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line), signal.SIGKILL)  # a stopped follower outlives its rank 0
    print(f"ended {time.monotonic() - started - 3.0:.1f} s after the {sig}")
    return proc.returncode, err, int(line)


def test_a_rank_killed_mid_step_ends_the_engine_within_a_minute() -> None:
    _needs(2)
    code, err, _ = _signal_a_follower_mid_job("SIGKILL", within_s=60)
    assert code == RANK_LOST_EXIT, err[-3000:]
    assert "tensor-parallel rank 1" in err


def test_a_hung_rank_ends_the_engine_within_its_timeout() -> None:
    """A stopped follower answers nothing: rank 0's next collective times out (the peer
    all-reduce's barrier waits with it) and the engine ends, not waits; NCCL's watchdog may
    end it first, with its own message."""
    _needs(2)
    code, err, _ = _signal_a_follower_mid_job(
        "SIGSTOP", within_s=120, PREFIXGROVE_TP_TIMEOUT_S="20"
    )
    assert code != 0, err[-3000:]
