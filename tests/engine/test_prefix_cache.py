"""The prefix cache: full KV blocks outlive their requests and are found again by content, so a prompt
that starts like an earlier one is prefilled only from where the cached blocks end, and every token
comes out as it would have without the cache."""

from __future__ import annotations

import pytest
from engine_checkpoints import (
    SMOLLM2,
    assert_no_leak,
    chat_ids,
    engine,
    greedy,
    random_prompts,
    run,
    shared_prefix_job,
    smollm2_file,
    token_ids,
)

from prefixgrove import SamplingParams
from prefixgrove.catalog.presets import load_tokenizer
from prefixgrove.engine.core.block_manager import ROOT_HASH, BlockManager
from prefixgrove.grouping import PrefixGroup

BS = 16
PARAMS = greedy(6, ignore_eos=True)
UNCACHED = {"enable_prefix_grouping": False, "enable_prefix_caching": False}


def block_of(token: int) -> tuple[int, ...]:
    return (token,) * BS


def cached_block(blocks: BlockManager, parent: int, tokens: tuple[int, ...]) -> tuple[int, int]:
    """A block registered with `tokens` after `parent` and released: (block, hash)."""
    [block] = blocks.allocate(1)
    block_hash = blocks.register(block, parent, tokens)
    blocks.release([block])
    return block, block_hash


# -- the block manager ------------------------------------------------------------------------------


def test_a_released_registered_block_is_cached_and_still_counts_as_free():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    block, _ = cached_block(blocks, ROOT_HASH, block_of(7))
    assert blocks.num_free == blocks.num_usable and blocks.num_cached == 1
    taken, _ = blocks.take_cached(ROOT_HASH, list(block_of(7)))
    assert taken == [block] and blocks.ref_count(block) == 1
    assert blocks.num_free == blocks.num_usable - 1


def test_take_cached_follows_the_chain_and_stops_at_the_first_miss():
    blocks = BlockManager(num_blocks=8, block_size=BS)
    first, h1 = cached_block(blocks, ROOT_HASH, block_of(1))
    second, h2 = cached_block(blocks, h1, block_of(2))
    tokens = [*block_of(1), *block_of(2), *block_of(3), 9]
    taken, hashes = blocks.take_cached(ROOT_HASH, tokens)
    assert taken == [first, second] and hashes == [h1, h2]


def test_equal_tokens_after_a_different_parent_are_not_a_hit():
    blocks = BlockManager(num_blocks=8, block_size=BS)
    _, h1 = cached_block(blocks, ROOT_HASH, block_of(1))
    cached_block(blocks, h1, block_of(2))
    assert blocks.take_cached(ROOT_HASH, list(block_of(2))) == ([], [])
    _, other = cached_block(blocks, ROOT_HASH, block_of(5))
    assert blocks.take_cached(other, list(block_of(2))) == ([], [])


def test_a_held_cached_block_is_shared_without_using_a_free_block():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    [block] = blocks.allocate(1)
    blocks.register(block, ROOT_HASH, block_of(4))
    free = blocks.num_free
    taken, _ = blocks.take_cached(ROOT_HASH, list(block_of(4)))
    assert taken == [block] and blocks.ref_count(block) == 2 and blocks.num_free == free


def test_allocation_takes_never_registered_blocks_before_evicting_cached_ones():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    block, _ = cached_block(blocks, ROOT_HASH, block_of(1))
    assert block not in blocks.allocate(2)
    assert blocks.num_cached == 1
    assert blocks.allocate(1) == [block]  # nothing else left: the cached block is evicted
    assert blocks.num_cached == 0


def test_eviction_takes_the_least_recently_released_block_and_forgets_its_content():
    blocks = BlockManager(num_blocks=3, block_size=BS)
    old, _ = cached_block(blocks, ROOT_HASH, block_of(1))
    new, _ = cached_block(blocks, ROOT_HASH, block_of(2))
    assert blocks.allocate(1) == [old]
    assert blocks.take_cached(ROOT_HASH, list(block_of(1))) == ([], [])
    assert blocks.take_cached(ROOT_HASH, list(block_of(2)))[0] == [new]


def test_a_released_sequence_is_evicted_from_its_last_block_on():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    table = blocks.allocate(3)
    parent = ROOT_HASH
    for block, token in zip(table, (1, 2, 3), strict=True):
        parent = blocks.register(block, parent, block_of(token))
    blocks.release(table)
    assert blocks.allocate(1) == [table[2]]
    assert blocks.allocate(1) == [table[1]]


def test_content_registered_twice_keeps_the_first_block_and_frees_the_second():
    blocks = BlockManager(num_blocks=3, block_size=BS)
    a, b = blocks.allocate(2)
    ha = blocks.register(a, ROOT_HASH, block_of(6))
    assert blocks.register(b, ROOT_HASH, block_of(6)) == ha
    blocks.release([a, b])
    assert blocks.num_cached == 1
    assert blocks.allocate(1) == [b]  # unregistered: free, taken before the cached one


def test_registering_an_unheld_or_partial_block_is_an_error():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="block 1 is not held"):
        blocks.register(1, ROOT_HASH, block_of(1))
    [block] = blocks.allocate(1)
    with pytest.raises(ValueError, match=f"block {block}: 3 token ids registered"):
        blocks.register(block, ROOT_HASH, (1, 2, 3))


def test_reset_cache_forgets_every_content_and_frees_cached_blocks():
    blocks = BlockManager(num_blocks=4, block_size=BS)
    cached_block(blocks, ROOT_HASH, block_of(1))
    [held] = blocks.allocate(1)
    blocks.register(held, ROOT_HASH, block_of(2))
    blocks.reset_cache()
    assert blocks.num_cached == 0 and blocks.num_free == blocks.num_usable - 1
    assert blocks.take_cached(ROOT_HASH, [*block_of(1), *block_of(2)]) == ([], [])
    blocks.release([held])
    assert blocks.num_free == blocks.num_usable


# -- the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def system_job() -> list[list[int]]:
    """One 70-token system prompt, three documents, four questions per document."""
    system = random_prompts([70], seed=21)[0]
    docs = random_prompts([40, 45, 50], seed=22)
    questions = random_prompts([5, 7, 9, 6], seed=23)
    return [system + doc + q for doc in docs for q in questions]


@pytest.fixture(scope="module")
def reference(llama_dir: str, system_job: list[list[int]]) -> list[list[int]]:
    return token_ids(run(engine(llama_dir, **UNCACHED), system_job, PARAMS))


def test_a_second_generate_takes_the_first_ones_blocks(llama_dir, system_job, reference):
    llm = engine(llama_dir)
    first = run(llm, system_job, PARAMS)
    prefilled = llm.engine.metrics.prefill_tokens
    second = run(llm, system_job, PARAMS)
    assert token_ids(first) == token_ids(second) == reference
    # all but each prompt's last token; the first call took only its group's prefix
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BS * BS for p in system_job]
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)
    # the second call computes only each prompt's last block
    assert llm.engine.metrics.prefill_tokens - prefilled < len(system_job) * BS
    assert_no_leak(llm)


def test_later_groups_take_the_shared_system_prompt_within_one_generate(
    llama_dir, system_job, reference
):
    """Each document's group prefix is system prompt + document; the second and third groups'
    prefixes start with the system prompt's 4 whole blocks, computed by the first."""
    uncached = engine(llama_dir, enable_prefix_caching=False)
    run(uncached, system_job, PARAMS)
    llm = engine(llama_dir)
    outs = run(llm, system_job, PARAMS)
    assert token_ids(outs) == reference
    system_blocks = 70 // BS * BS
    saved = uncached.engine.metrics.prefill_tokens - llm.engine.metrics.prefill_tokens
    assert saved == 2 * system_blocks
    assert_no_leak(llm)


def test_ungrouped_requests_take_what_an_earlier_one_computed(llama_dir, system_job, reference):
    llm = engine(llama_dir, enable_prefix_grouping=False)
    outs = run(llm, system_job, PARAMS)
    assert token_ids(outs) == reference
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0 and all(n >= 70 // BS * BS for n in cached[1:])
    assert_no_leak(llm)


def test_groups_of_later_leases_take_the_system_prompt_of_earlier_ones(llama_dir, system_job):
    """A worker adds each leased group to the same engine: the next lease's group prefix starts with
    the system prompt's cached blocks."""
    llm = engine(llama_dir)
    for lease, start in enumerate((0, 4)):
        members = [(f"{lease}/{i}", p, PARAMS) for i, p in enumerate(system_job[start : start + 4])]
        prefilled = llm.engine.metrics.prefill_tokens
        llm.engine.add_group(f"g{lease}", PrefixGroup(96, (0, 1, 2, 3)), members)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    suffixes = sum(len(p) - 96 for p in system_job[4:8])
    assert llm.engine.metrics.prefill_tokens - prefilled == 96 - 64 + suffixes
    assert_no_leak(llm)


def test_prefix_caching_off_keeps_nothing_across_calls(llama_dir, system_job, reference):
    llm = engine(llama_dir, enable_prefix_caching=False)
    first = run(llm, system_job, PARAMS)
    second = run(llm, system_job, PARAMS)
    assert [o.num_cached_tokens for o in first] == [o.num_cached_tokens for o in second]
    assert token_ids(second) == reference
    assert llm.engine.blocks.num_cached == 0


def test_reset_prefix_cache_makes_the_next_call_start_cold(llama_dir, system_job):
    llm = engine(llama_dir)
    first = run(llm, system_job, PARAMS)
    llm.engine.reset_prefix_cache()
    second = run(llm, system_job, PARAMS)
    assert [o.num_cached_tokens for o in second] == [o.num_cached_tokens for o in first]
    assert_no_leak(llm)


def test_a_whole_cached_prompt_recomputes_its_last_block(llama_dir):
    prompt = random_prompts([48], seed=24)[0]
    llm = engine(llama_dir)
    first = run(llm, [prompt], PARAMS)
    second = run(llm, [prompt], PARAMS)
    assert [first[0].num_cached_tokens, second[0].num_cached_tokens] == [0, 32]
    assert token_ids(second) == token_ids(first)


def test_eviction_under_memory_pressure_keeps_outputs_exact(llama_dir):
    prompts = shared_prefix_job(num_prefixes=12, per_prefix=3, prefix_len=64, seed=25)
    params = greedy(4, ignore_eos=True)
    expected = token_ids(run(engine(llama_dir, **UNCACHED), prompts, params))
    llm = engine(llama_dir, num_gpu_blocks_override=24, max_num_batched_tokens=256)
    assert token_ids(run(llm, prompts, params)) == expected
    prefilled = llm.engine.metrics.prefill_tokens
    assert token_ids(run(llm, prompts, params)) == expected
    # Were every block still cached, each prompt would compute only its last block's tokens.
    last_blocks = sum(len(p) - (len(p) - 1) // BS * BS for p in prompts)
    assert llm.engine.metrics.prefill_tokens - prefilled > last_blocks, "nothing was evicted"
    assert_no_leak(llm)


def test_preemption_with_cached_blocks_keeps_outputs_exact(llama_dir, system_job):
    params = greedy(24, ignore_eos=True)
    expected = token_ids(run(engine(llama_dir, **UNCACHED), system_job, params))
    llm = engine(llama_dir, num_gpu_blocks_override=20, max_num_batched_tokens=64, max_num_seqs=8)
    for _ in range(2):
        assert token_ids(run(llm, system_job, params)) == expected
    assert llm.engine.metrics.preemptions > 0
    assert_no_leak(llm)


def test_an_aborted_request_leaves_its_computed_blocks_to_the_next(llama_dir):
    prompt = random_prompts([60], seed=26)[0]
    llm = engine(llama_dir)
    llm.engine.add_request("a", prompt, greedy(50, ignore_eos=True))
    llm.engine.step()  # its prompt
    llm.engine.abort(["a"])
    assert_no_leak(llm)
    [out] = run(llm, [prompt], PARAMS)
    assert out.num_cached_tokens == 48
    alone = run(engine(llama_dir, **UNCACHED), [prompt], PARAMS)
    assert out.outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_request_scoring_its_prompt_takes_nothing_from_the_cache(llama_dir):
    prompt = random_prompts([60], seed=28)[0]
    llm = engine(llama_dir)
    run(llm, [prompt], PARAMS)
    [out] = run(llm, [prompt], greedy(6, ignore_eos=True, prompt_logprobs=1))
    assert out.num_cached_tokens == 0
    [again] = run(llm, [prompt], PARAMS)
    assert again.num_cached_tokens == 48


def test_cached_blocks_under_decode_windows_and_async_scheduling(llama_dir, system_job, reference):
    llm = engine(llama_dir, num_scheduler_steps=4, async_scheduling=True)
    for _ in range(2):
        assert token_ids(run(llm, system_job, PARAMS)) == reference
    assert_no_leak(llm)


def test_cached_suffix_blocks_under_the_triton_cascade_kernels(llama_dir):
    """Small on purpose: the kernels run in Triton's interpreter here. In the second call the
    members join their cached group prefix and take their own first block from the cache, so their
    prompt chunks start past the prefix in the fused prefill and one-pass decode kernels."""
    prefix = random_prompts([64], seed=29)[0]
    prompts = [prefix + suffix for suffix in random_prompts([20, 22], seed=30)]
    params = greedy(3, ignore_eos=True)
    llm = engine(
        llama_dir, attention_backend="triton", cascade_decode_kernel="one-pass",
        cascade_prefill_kernel="fused",
    )  # fmt: skip
    first = run(llm, prompts, params)
    second = run(llm, prompts, params)
    assert [o.num_cached_tokens for o in second] == [80, 80]
    alone = run(engine(llama_dir, **UNCACHED), prompts, params)
    assert token_ids(first) == token_ids(second) == token_ids(alone)
    assert_no_leak(llm)


def test_generated_tokens_blocks_are_cached_for_a_prompt_that_continues_them(llama_dir):
    """A multi-turn prompt that repeats an earlier answer finds the answer's blocks too."""
    prompt = random_prompts([40], seed=27)[0]
    llm = engine(llama_dir)
    [first] = run(llm, [prompt], greedy(40, ignore_eos=True))
    follow_up = [*prompt, *first.outputs[0].token_ids, 1, 2, 3]
    [second] = run(llm, [follow_up], PARAMS)
    assert second.num_cached_tokens == (len(follow_up) - 1) // BS * BS - BS  # all but the last one
    uncached = run(engine(llama_dir, **UNCACHED), [follow_up], PARAMS)
    assert second.outputs[0].token_ids == token_ids(uncached)[0]


# -- a trained model --------------------------------------------------------------------------------

SYSTEM = "You answer in one short sentence. The museum opens at ten and closes at six, daily."
DOCS = ["Room A shows Roman coins and glass.", "Room B shows Dutch paintings of ships."]
QUESTIONS = ["What is in this room?", "When does it open?", "Is it open on Sunday?"]


@pytest.fixture(scope="module")
def smollm2_prompts() -> list[list[int]]:
    smollm2_file()
    return chat_ids(
        load_tokenizer(SMOLLM2), [(f"{SYSTEM} {doc}", q) for doc in DOCS for q in QUESTIONS]
    )


def test_smollm2_grouped_ungrouped_and_cached_give_the_same_tokens(smollm2_prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = token_ids(run(engine(SMOLLM2, **UNCACHED), smollm2_prompts, params))
    llm = engine(SMOLLM2)
    grouped = run(llm, smollm2_prompts, params)
    first_prefill = llm.engine.metrics.prefill_tokens
    cached = run(llm, smollm2_prompts, params)
    assert token_ids(grouped) == token_ids(cached) == alone
    # the second call's group prefixes come whole from the cache
    assert llm.engine.metrics.prefill_tokens - first_prefill < first_prefill
    assert_no_leak(llm)
