"""Prefix-sharing groups: the prefix is computed once, its blocks are shared, and nothing a request
generates depends on whether it ran in a group, with or without cascade attention."""

from __future__ import annotations

import dataclasses

import pytest
from engine_checkpoints import (
    assert_no_leak,
    engine,
    greedy,
    random_prompts,
    run,
    shared_prefix_job,
    token_ids,
)

from prefixgrove import LLM, SamplingParams
from prefixgrove.grouping import GroupingConfig, PrefixGroup, group_prompts

PREFIX_LEN = 80  # 5 blocks of 16, above the cascade pass's 64-token threshold
PARAMS = greedy(5, ignore_eos=True)


@pytest.fixture(scope="module")
def job() -> list[list[int]]:
    return shared_prefix_job(num_prefixes=4, per_prefix=4)


@pytest.fixture(scope="module")
def ungrouped(llama_dir: str, job: list[list[int]]) -> list[list[int]]:
    llm = engine(
        llama_dir,
        enable_prefix_grouping=False,
        enable_prefix_caching=False,
        enable_cascade_attention=False,
    )
    outs = run(llm, job, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0] * len(job)
    assert_no_leak(llm)
    return token_ids(outs)


def everyone(prefix_len: int, requests: list) -> PrefixGroup:
    """A group of all of `requests`."""
    return PrefixGroup(prefix_len, tuple(range(len(requests))))


def count_cascade_calls(llm: LLM) -> dict[str, int]:
    """Counts calls of the backend's cascade kernels (one per layer and step that uses them): the
    prefix pass (and how many of them finished suffix chunks), and the one-pass decode kernel when
    the engine has one."""
    calls = {"prefix": 0, "decode": 0, "fused": 0}
    runner = llm.engine.runner

    def counting(name: str, kernel):
        def count(*args, **kwargs):
            calls[name] += 1
            calls["fused"] += kwargs.get("suffix_chunks") is not None  # prefix passes that fuse
            return kernel(*args, **kwargs)

        return count

    backend = runner.backend
    decode = backend.decode and counting("decode", backend.decode)  # None: two-pass decode
    runner.backend = dataclasses.replace(
        backend, prefix=counting("prefix", backend.prefix), decode=decode
    )
    return calls


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "no-cascade"])
@pytest.mark.parametrize("grouping", [True, False], ids=["grouped", "ungrouped"])
def test_grouping_and_cascade_leave_greedy_tokens_unchanged(
    llama_dir, job, ungrouped, grouping, cascade
):
    llm = engine(llama_dir, enable_prefix_grouping=grouping, enable_cascade_attention=cascade)
    outs = run(llm, job, PARAMS)
    assert [o.prompt_token_ids for o in outs] == job  # input order
    assert token_ids(outs) == ungrouped
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("decode_kernel", "prefill_kernel"), [("two-pass", "two-pass"), ("one-pass", "fused")]
)
def test_grouped_cascade_on_triton_backend_matches_ungrouped(
    llama_dir, decode_kernel, prefill_kernel
):
    """Small on purpose: the kernels run in Triton's interpreter here."""
    prompts = shared_prefix_job(num_prefixes=2, per_prefix=2, prefix_len=64, seed=3)
    params = greedy(3, ignore_eos=True)
    llm = engine(
        llama_dir, attention_backend="triton", cascade_decode_kernel=decode_kernel,
        cascade_prefill_kernel=prefill_kernel,
    )  # fmt: skip
    assert llm.engine.runner.backend.name == "triton"
    calls = count_cascade_calls(llm)
    outs = run(llm, prompts, params)
    assert [o.num_cached_tokens for o in outs] == [64] * 4
    assert calls["prefix"] > 0
    assert (calls["decode"] > 0) == (decode_kernel == "one-pass")
    assert (calls["fused"] > 0) == (prefill_kernel == "fused")
    reference = engine(llama_dir, enable_prefix_grouping=False)
    assert token_ids(outs) == token_ids(run(reference, prompts, params))
    assert_no_leak(llm)


def test_cascade_kernels_run_only_when_enabled(llama_dir, job):
    on = engine(llama_dir, cascade_decode_kernel="one-pass")
    off = engine(llama_dir, enable_cascade_attention=False, cascade_decode_kernel="one-pass")
    on_calls, off_calls = count_cascade_calls(on), count_cascade_calls(off)
    run(on, job, PARAMS)
    run(off, job, PARAMS)
    assert on_calls["prefix"] > 0 and on_calls["decode"] > 0
    assert off_calls == {"prefix": 0, "decode": 0, "fused": 0}


def test_one_pass_decode_leaves_greedy_tokens_unchanged(llama_dir, job, ungrouped):
    llm = engine(llama_dir, cascade_decode_kernel="one-pass")
    assert token_ids(run(llm, job, PARAMS)) == ungrouped


def test_num_cached_tokens_reports_the_reused_prefix(llama_dir, job):
    outs = run(engine(llama_dir), job, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [PREFIX_LEN] * len(job)


def test_prefix_is_prefilled_once_per_group(llama_dir, job):
    llm = engine(llama_dir)
    outs = run(llm, job, PARAMS)
    m = llm.engine.metrics
    suffix_tokens = sum(len(p) - PREFIX_LEN for p in job)
    assert m.prefill_tokens == 4 * PREFIX_LEN + suffix_tokens
    assert m.prefix_tokens_reused == sum(o.num_cached_tokens for o in outs) == 16 * PREFIX_LEN
    assert m.kv_blocks_shared == 16 * (PREFIX_LEN // 16)
    assert m.requests_finished == len(job)


def test_a_system_prompt_before_grouped_documents_is_prefilled_once(llama_dir):
    # two requests a document behind one system prompt: a group a document, whose prefixes take
    # the system prompt from the prefix cache after the first; grouping counts what the engine does
    system, docs = random_prompts([64], seed=3)[0], random_prompts([48] * 4, seed=4)
    prompts = [
        system + doc + [200 + 2 * d + i, 7, 9] for d, doc in enumerate(docs) for i in range(2)
    ]
    plan = group_prompts(prompts, GroupingConfig(block_size=16))
    assert [g.prefix_len for g in plan.groups] == [112] * 4
    llm = engine(llama_dir)
    run(llm, prompts, PARAMS)
    assert llm.engine.metrics.prefill_tokens == 64 + 4 * 48 + 8 * 3
    assert llm.engine.metrics.prefill_tokens == sum(map(len, prompts)) - plan.tokens_saved


def test_ungrouped_uncached_run_shares_nothing(llama_dir, job):
    llm = engine(llama_dir, enable_prefix_grouping=False, enable_prefix_caching=False)
    run(llm, job, PARAMS)
    m = llm.engine.metrics
    assert m.prefix_tokens_reused == 0 and m.kv_blocks_shared == 0
    assert m.prefill_tokens == sum(len(p) for p in job)


def test_many_groups_through_a_small_cache_finish_without_leaking(llama_dir):
    # 60 groups of 3 (64-token prefixes); the cache holds only a few groups at a time.
    prompts = shared_prefix_job(num_prefixes=60, per_prefix=3, prefix_len=64, seed=5)
    params = greedy(4, ignore_eos=True)
    llm = engine(llama_dir, num_gpu_blocks_override=24, max_num_batched_tokens=256)
    outs = run(llm, prompts, params)
    assert llm.engine.metrics.prefix_tokens_reused >= 60 * 3 * 64
    assert [o.num_cached_tokens for o in outs] == [64] * len(prompts)
    reference = engine(llama_dir, enable_prefix_grouping=False)
    assert token_ids(outs) == token_ids(run(reference, prompts, params))
    assert_no_leak(llm)


def test_groups_under_preemption_give_the_same_tokens(llama_dir, job, ungrouped):
    # A member grows to ~105 tokens = 7 blocks, 5 of them the shared prefix; 9 usable blocks cannot hold
    # a whole group's own blocks, so members are preempted while their group's prefix is in use.
    llm = engine(llama_dir, num_gpu_blocks_override=10, max_num_batched_tokens=64, max_num_seqs=8)
    outs = run(llm, job, greedy(12, ignore_eos=True))
    assert llm.engine.metrics.preemptions > 0
    assert [t[: PARAMS.max_tokens] for t in token_ids(outs)] == ungrouped
    assert_no_leak(llm)


def test_planner_grouping_is_used_as_given(llama_dir, job):
    grouping = group_prompts(job, GroupingConfig(block_size=16))
    assert len(grouping.groups) == 4
    llm = engine(llama_dir, enable_prefix_grouping=False)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in job], PARAMS, use_tqdm=False, groups=grouping.groups
    )
    assert [o.num_cached_tokens for o in outs] == [PREFIX_LEN] * len(job)
    assert_no_leak(llm)


def test_add_group_streams_members_through_the_engine(llama_dir, job, ungrouped):
    llm = engine(llama_dir)
    first = job[0][:PREFIX_LEN]
    members = [i for i, p in enumerate(job) if p[:PREFIX_LEN] == first]
    requests = [(f"r{i}", p, PARAMS) for i, p in enumerate(job)]
    llm.engine.add_group("g", PrefixGroup(PREFIX_LEN, tuple(members)), requests)
    finished = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            finished[out.request_id] = out
    assert sorted(finished) == sorted(f"r{i}" for i in members)
    for i in members:
        assert finished[f"r{i}"].outputs[0].token_ids == ungrouped[i]
        assert finished[f"r{i}"].num_cached_tokens == PREFIX_LEN
    assert_no_leak(llm)


def test_add_group_cuts_the_prefix_to_whole_blocks(llama_dir, job):
    llm = engine(llama_dir)
    first = job[0][:PREFIX_LEN]
    members = [(f"r{i}", p, PARAMS) for i, p in enumerate(job) if p[:PREFIX_LEN] == first]
    llm.engine.add_group("g", everyone(PREFIX_LEN - 5, members), members)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert [o.num_cached_tokens for o in outs] == [PREFIX_LEN - 16] * len(members)
    assert_no_leak(llm)


def test_a_group_whose_request_lacks_the_prefix_runs_unshared(llama_dir, caplog):
    """The planner groups by block hashes: the engine checks the prefix, and a group that fails the
    check runs without sharing, its tokens those of requests run alone."""
    prefix = random_prompts([48], seed=7)[0]
    good = [*prefix, 1, 2, 3]
    bad = [*prefix[:5], (prefix[5] + 1) % 256, *prefix[6:], 4, 5]
    members = [("a", good, PARAMS), ("b", bad, PARAMS)]
    llm = engine(llama_dir)
    llm.engine.add_group("g", everyone(48, members), members)
    assert "request 'b' of group 'g' does not start with the group's 48-token prefix" in caplog.text
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.engine.step())
    assert [outs[r].num_cached_tokens for r in "ab"] == [0, 0]
    assert llm.engine.metrics.kv_blocks_shared == 0
    alone = run(engine(llama_dir, enable_prefix_grouping=False), [good, bad], PARAMS)
    assert [outs[r].outputs[0].token_ids for r in "ab"] == token_ids(alone)
    assert_no_leak(llm)


def test_chunked_prefix_prefill_gives_the_same_tokens(llama_dir, job, ungrouped):
    llm = engine(llama_dir, max_num_batched_tokens=32, max_num_seqs=8)
    outs = run(llm, job, PARAMS)
    assert token_ids(outs) == ungrouped
    assert [o.num_cached_tokens for o in outs] == [PREFIX_LEN] * len(job)
    assert_no_leak(llm)


def test_seeded_sampling_is_the_same_in_and_out_of_groups(llama_dir, job):
    params = [
        SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(len(job))
    ]
    grouped = token_ids(run(engine(llama_dir), job, params))
    alone = token_ids(run(engine(llama_dir, enable_prefix_grouping=False), job, params))
    assert grouped == alone


def test_identical_prompts_share_all_whole_blocks_but_the_last_token(llama_dir):
    prompt = random_prompts([50], seed=8)[0]
    llm = engine(llama_dir)
    outs = run(llm, [prompt] * 4, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [48] * 4
    reference = run(engine(llama_dir, enable_prefix_grouping=False), [prompt], PARAMS)
    assert token_ids(outs) == token_ids(reference) * 4
    assert_no_leak(llm)


def test_members_with_a_one_token_suffix(llama_dir):
    prefix = random_prompts([64], seed=9)[0]
    prompts = [[*prefix, t] for t in (3, 50, 97)]
    llm = engine(llama_dir)
    outs = run(llm, prompts, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [64] * 3
    reference = engine(llama_dir, enable_prefix_grouping=False)
    assert token_ids(outs) == token_ids(run(reference, prompts, PARAMS))
    assert_no_leak(llm)


def test_member_finishing_early_keeps_the_prefix_for_the_others(llama_dir, job, ungrouped):
    params = [greedy(1 if i % 2 else 5, ignore_eos=True) for i in range(len(job))]
    llm = engine(llama_dir)
    outs = token_ids(run(llm, job, params))
    assert outs == [u[: p.max_tokens] for u, p in zip(ungrouped, params, strict=True)]
    assert_no_leak(llm)


def _group_of_first_prefix(job: list[list[int]]) -> list[tuple[str, list[int], SamplingParams]]:
    first = job[0][:PREFIX_LEN]
    return [(f"r{i}", p, PARAMS) for i, p in enumerate(job) if p[:PREFIX_LEN] == first]


def test_aborting_every_member_of_a_running_group_frees_its_prefix(llama_dir, job):
    llm = engine(llama_dir)
    members = _group_of_first_prefix(job)
    llm.engine.add_group("g", everyone(PREFIX_LEN, members), members)
    llm.engine.step()  # the prefix
    llm.engine.step()  # members join
    assert llm.engine.blocks.num_shared() > 0
    llm.engine.abort([rid for rid, _, _ in members])
    assert_no_leak(llm)


def test_aborting_a_group_that_has_not_started(llama_dir, job):
    llm = engine(llama_dir)
    members = _group_of_first_prefix(job)
    llm.engine.add_group("g", everyone(PREFIX_LEN, members), members)
    llm.engine.abort([rid for rid, _, _ in members])
    assert_no_leak(llm)
    assert llm.engine.step() == []


def test_group_larger_than_the_cache_still_runs_when_each_request_fits(llama_dir):
    """Each request needs 4 of the 6 usable blocks (2 of them the shared prefix), so all of them can run
    one after another; a group must not wait for room that the cache can never have."""
    prefix = random_prompts([32], seed=15)[0]
    prompts = [[*prefix, *suffix] for suffix in random_prompts([20] * 4, seed=16)]
    params = greedy(10, ignore_eos=True)
    llm = engine(llama_dir, num_gpu_blocks_override=7)
    outs = run(llm, prompts, params)
    reference = engine(llama_dir, enable_prefix_grouping=False)
    assert token_ids(outs) == token_ids(run(reference, prompts, params))
    assert_no_leak(llm)


def _invalid_group(seed: int = 17) -> list[tuple[str, list[int], SamplingParams]]:
    prefix = random_prompts([40], seed=seed)[0]
    return [("a", [*prefix, 1], PARAMS), ("b", [*prefix, 999], PARAMS)]


def test_add_group_with_an_invalid_request_names_it(llama_dir):
    with pytest.raises(ValueError, match=r"'b'.*token id 999"):
        engine(llama_dir).engine.add_group("g", PrefixGroup(32, (0, 1)), _invalid_group())


def test_add_group_with_an_invalid_request_queues_none_of_its_requests(llama_dir):
    llm = engine(llama_dir)
    members = _invalid_group()
    with pytest.raises(ValueError, match="token id 999"):
        llm.engine.add_group("g", PrefixGroup(32, (0, 1)), members)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("a", members[0][1], PARAMS)  # the valid member's id is free again
    llm.engine.abort(["a"])
    assert_no_leak(llm)


def test_add_group_naming_a_request_that_did_not_come_with_it_is_refused(llama_dir):
    llm = engine(llama_dir)
    with pytest.raises(ValueError, match=r"group 'g' names request 2, but only 2 requests came"):
        llm.engine.add_group("g", PrefixGroup(32, (0, 2)), _invalid_group())
    assert not llm.engine.has_unfinished_requests()
