"""The work a job's requests take, counted by hand on small tables."""

from __future__ import annotations

import numpy as np

from prefixgrove.costmodel.workload import RequestTable, Workload


def table(prompt, prefix, group, samples=None, overlap=0) -> RequestTable:
    n = len(prompt)
    return RequestTable(np.array(prompt), np.array(prefix), np.array(group),
                        np.array(samples or [1] * n), overlap)  # fmt: skip


def test_a_groups_prefix_is_prefilled_once() -> None:
    # a group of two sharing 32 tokens (40 and 48 tokens each), and one request alone (10 tokens)
    work = Workload.of(table([40, 48, 10], [32, 32, 0], [0, 0, -1]), np.array([1, 1, 1]))
    assert work.prefill_tokens == 32 + 8 + 16 + 10
    assert work.prefill_pairs == 32 * 33 / 2 + (8 * 32 + 8 * 9 / 2) + (16 * 32 + 16 * 17 / 2) + 10 * 11 / 2  # fmt: skip


def test_prefix_blocks_two_groups_share_are_prefilled_once() -> None:
    # two documents' groups of two behind one 16-token system prompt: 32-token prefixes, 16 shared
    work = Workload.of(table([40] * 4, [32] * 4, [0, 0, 1, 1], overlap=16), np.array([1] * 4))
    assert work.prefill_tokens == 16 + 2 * 16 + 4 * 8


def test_the_first_output_token_takes_no_decode_step() -> None:
    work = Workload.of(table([10], [0], [-1]), np.array([4]))
    assert (work.output_tokens, work.decode_tokens, work.longest_decode) == (4, 3, 3)
    # steps 1..3 attend the prompt and 1..3 outputs
    assert work.decode_pairs == (10 + 1) + (10 + 2) + (10 + 3)


def test_every_sample_of_a_request_decodes() -> None:
    work = Workload.of(table([10], [0], [-1], [3]), np.array([5]))
    assert (work.sequences, work.output_tokens, work.decode_tokens) == (3, 15, 12)


def test_cascade_reads_a_prefix_once_per_step_for_its_group() -> None:
    requests = table([40, 40, 40], [32, 32, 32], [0, 0, 0])
    outputs = np.array([3, 5, 2])  # decode steps 2, 4, 1: the group decodes for 4 steps
    cascade = Workload.of(requests, outputs, cascade=True)
    plain = Workload.of(requests, outputs, cascade=False)
    own = sum(s * 8 + s * (s + 1) / 2 for s in (2, 4, 1))
    assert cascade.decode_kv_reads == own + 32 * 4
    assert plain.decode_kv_reads == own + 32 * (2 + 4 + 1)
