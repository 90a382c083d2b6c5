"""Tensor parallelism on the CPU (gloo): each rank's shard is the cut of the whole model, and an
engine of 2 or 4 ranks computes what one rank computes, through every way of running a step.

The model is the tiny Qwen2 checkpoint: biases on q/k/v (cut with their heads), an untied LM head,
and a vocabulary of 261 rows (no multiple of 2 or 4: the last slice is padded). At 4 ranks its 2 KV
heads are fewer than the ranks, so each KV head is held by two ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from engine_checkpoints import (
    assert_same_tokens_and_logprobs,
    engine,
    greedy,
    run,
    save_checkpoint,
    shared_prefix_job,
    smollm2_file,
)
from sharded_loads import assert_shard_is_cut_of_whole, load_on_cpu
from test_fp8 import write_compressed_tensors

from prefixgrove import LLM, SamplingParams, StructuredOutputsParams
from prefixgrove.engine.parallel.group import TensorParallel
from prefixgrove.engine.parallel.launch import RANK_LOST_EXIT

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def _assert_shards_are_cuts_of_the_whole(
    model: str, size: int, ranks: list[int], quantization: str | None = None
) -> None:
    whole = dict(load_on_cpu(model, TensorParallel.single(), quantization).named_parameters())
    for rank in ranks:
        shard = load_on_cpu(model, TensorParallel(rank, size), quantization)
        assert_shard_is_cut_of_whole(shard, whole, f"rank {rank} of {size}")


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_the_cut_of_every_safetensors_tensor(qwen2_dir: str, size: int) -> None:
    _assert_shards_are_cuts_of_the_whole(qwen2_dir, size, list(range(size)))


@pytest.mark.parametrize("arch", ["phi3", "qwen2-moe", "mixtral", "olmoe"])
def test_a_rank_cuts_fused_tensors_and_experts(arch: str, tmp_path: Path) -> None:
    """Phi-3's fused q/k/v and gate/up; every expert's width and a shared expert's."""
    _assert_shards_are_cuts_of_the_whole(save_checkpoint(arch, tmp_path), 2, [0, 1])


@pytest.mark.parametrize(("arch", "size"), [("qwen2-moe", 2), ("olmoe", 4)])
def test_experts_split_over_ranks_compute_what_one_rank_computes(
    arch: str, size: int, tmp_path: Path
) -> None:
    """Experts and a shared expert split by width; OLMoE's whole-projection q/k norms summed
    over the ranks, at 4 ranks over 2 KV heads each held twice."""
    _assert_ranks_agree(save_checkpoint(arch, tmp_path), size)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_layers_over_ranks_compute_what_one_rank_computes(arch: str, tmp_path: Path) -> None:
    """Gemma's layer cut as Llama's (its four norms, q/k norms and soft-caps whole on every
    rank), with the shared prefix longer than the sliding window."""
    _assert_ranks_agree(save_checkpoint(arch, tmp_path), 2)


def _assert_ranks_agree(model: str, size: int) -> None:
    prompts = shared_prefix_job(num_prefixes=1, per_prefix=3, prefix_len=70)
    outputs = []
    for ranks in (1, size):
        llm = engine(model, tensor_parallel_size=ranks)
        outputs.append(run(llm, prompts, greedy(8, logprobs=2)))
        llm.engine.close()
    assert_same_tokens_and_logprobs(*outputs, tolerance=1e-4)


def test_a_rank_dequantizes_only_its_rows_of_a_gguf_and_matches_the_whole() -> None:
    # SmolLM2-135M: 9 heads, 3 KV heads; rank 2 of 3 holds the last slice of every cut
    _assert_shards_are_cuts_of_the_whole(smollm2_file(), 3, [2])


def test_fp8_checkpoint_weights_are_cut_with_their_scales(llama_dir: str, tmp_path: Path) -> None:
    """e4m3 weights as stored, per-channel scales cut with the columns of q/k/v and gate/up and
    kept whole for o_proj's and down_proj's rows."""
    stored = write_compressed_tensors(llama_dir, tmp_path / "fp8")
    _assert_shards_are_cuts_of_the_whole(stored, 2, [0, 1], quantization="fp8")


def test_random_weights_are_drawn_whole_and_cut() -> None:
    _assert_shards_are_cuts_of_the_whole("tiny-random-llama", 4, [1, 3])


def _job() -> tuple[list[list[int]], list[SamplingParams]]:
    """Grouped prompts (the cascade), plain ones, prompt logprobs and a constrained request."""
    prompts = shared_prefix_job(num_prefixes=2, per_prefix=4, prefix_len=70)
    prompts += [list(range(30, 30 + n)) for n in (5, 17)]
    params = [greedy(10, logprobs=2) for _ in prompts]
    params[-2] = greedy(6, logprobs=2, prompt_logprobs=1)
    params[-1] = greedy(
        8, logprobs=2, structured_outputs=StructuredOutputsParams(regex="[a-d]{4}x")
    )
    return prompts, params


@pytest.fixture(scope="module")
def one_rank(qwen2_dir: str) -> list:
    prompts, params = _job()
    return run(engine(qwen2_dir, num_scheduler_steps=4), prompts, params)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_compute_what_one_rank_computes(qwen2_dir: str, one_rank: list, size: int) -> None:
    prompts, params = _job()
    llm = engine(qwen2_dir, num_scheduler_steps=4, tensor_parallel_size=size)
    try:
        outputs = run(llm, prompts, params)
    finally:
        llm.engine.close()
    # row-parallel sums add their parts in another order: equal to rounding
    assert_same_tokens_and_logprobs(one_rank, outputs, tolerance=1e-4)
    for a, b in zip(one_rank[-2].prompt_logprobs[1:], outputs[-2].prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        for token, entry in a.items():
            assert b[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert outputs[-1].outputs[0].text.startswith(one_rank[-1].outputs[0].text)


def test_a_size_that_does_not_divide_the_heads_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 does not divide .*num_attention_heads=4"
    ):
        LLM("tiny-random-llama", device="cpu", tensor_parallel_size=3)


def _script(body: str, **variables: str) -> subprocess.Popen[str]:
    """`body` in a Python process of its own (with environment `variables`), the checkout's roots
    first on its path, then the path this one was given (a machine's folder of wheels)."""
    roots = [str(REPO / p) for p in ("services", "kernels", "operator", "proto")]
    path = os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **variables, "PYTHONPATH": path}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_lost_rank_ends_the_engine_with_a_clear_error() -> None:
    proc = _script(
        """
        import os, signal
        from prefixgrove import LLM, SamplingParams
        llm = LLM("tiny-random-llama", device="cpu", tensor_parallel_size=2, skip_tokenizer_init=True)
        os.kill(llm.engine.followers.processes[0].pid, signal.SIGKILL)
        while True:  # a job that would run for ever: only the lost rank can end it
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=50), use_tqdm=False)
        """
    )
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == RANK_LOST_EXIT, err[-2000:]
    assert "tensor-parallel rank 1" in err and "exited with code -9" in err


def test_followers_end_when_rank_zero_is_killed() -> None:
    proc = _script(
        """
        import time
        from prefixgrove import LLM
        llm = LLM("tiny-random-llama", device="cpu", tensor_parallel_size=2, skip_tokenizer_init=True)
        print(llm.engine.followers.processes[0].pid, flush=True)
        time.sleep(600)
        """
    )
    assert proc.stdout is not None
    follower = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    _assert_gone(follower, "a follower outlived its rank 0")


def _assert_gone(pid: int, what: str) -> None:
    """A liveness bound, far above the follower's 1 s poll of its rank 0 and a killed process's
    exit (which under load can take a moment to let go of its memory)."""
    deadline = time.monotonic() + 120
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(pid), what


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a child of the killed script is reparented, not reaped by us: a zombie counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_worker_spans_every_gpu_it_was_given_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixgrove.engine_settings import EngineSettings
    from prefixgrove.worker.runner import make_engine, visible_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert (visible_gpus("cuda"), visible_gpus("cuda:1"), visible_gpus("cpu")) == (4, 3, 1)
    monkeypatch.undo()
    engine = make_engine("tiny-random-llama", EngineSettings(device="cpu", tensor_parallel_size=2))
    try:
        assert engine.config.tensor_parallel_size == 2 and engine.followers is not None
    finally:
        engine.close()
    assert make_engine("tiny-random-llama", EngineSettings(device="cpu")).followers is None


def test_a_hung_rank_ends_the_engine_with_a_clear_error() -> None:
    proc = _script(
        """
        import os, signal
        from prefixgrove import LLM, SamplingParams
        llm = LLM("tiny-random-llama", device="cpu", tensor_parallel_size=2, skip_tokenizer_init=True)
        follower = llm.engine.followers.processes[0].pid
        print(follower, flush=True)
        os.kill(follower, signal.SIGSTOP)  # alive, and answering nothing
        while True:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=50), use_tqdm=False)
        """,
        PREFIXGROVE_TP_TIMEOUT_S="5",
    )
    assert proc.stdout is not None
    follower = int(proc.stdout.readline())
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == RANK_LOST_EXIT, err[-2000:]
    assert "collective failed with every rank alive" in err and "PREFIXGROVE_TP_TIMEOUT_S" in err
    _assert_gone(follower, "the hung rank was left behind")


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "still-exiting"])
def test_a_broken_pipe_to_a_follower_ends_the_engine_naming_it(
    monkeypatch: pytest.MonkeyPatch, reaped: bool
) -> None:
    """A follower's pipe breaks a moment before its process can be reaped (its sockets close first
    as it exits; a GPU process may take seconds to let go of its memory): rank 0's next send must
    end the engine as for a lost rank, naming it, not raise into the caller (who would tear down a
    group with a rank missing), and never call a rank that closed its pipe hung."""
    import socket
    from multiprocessing.connection import Connection

    from prefixgrove.engine.parallel import launch
    from prefixgrove.engine.parallel.leader import FollowerLink

    ours, theirs = socket.socketpair()
    code = "pass" if reaped else "import time; time.sleep(60)"
    follower = subprocess.Popen([sys.executable, "-c", code])
    if reaped:
        follower.wait()
    theirs.close()
    followers = launch.Followers([follower], FollowerLink([Connection(ours.detach())]))
    followers.link.on_lost = followers.pipe_broke
    said: list[str] = []

    def exit_(message: str) -> None:
        said.append(message)
        raise SystemExit(RANK_LOST_EXIT)

    monkeypatch.setattr(launch.Followers, "_exit", staticmethod(exit_))
    monkeypatch.setattr(launch, "_REAP_WAIT_S", 0.5)
    try:
        with pytest.raises(SystemExit):
            for _ in range(64):  # the first sends may land in the socket's buffer
                followers.link.send("step", b"x" * 65536)
    finally:
        follower.kill()
    how = "with code 0" if reaped else "(its pipe closed)"
    assert len(said) == 1 and f"rank 1 (pid {follower.pid}) exited {how}" in said[0]
