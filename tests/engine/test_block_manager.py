"""The block manager's reference counting: shared prefix blocks live until their last holder lets go."""

from __future__ import annotations

import pytest

from prefixgrove.engine.core.block_manager import NULL_BLOCK, BlockManager, OutOfBlocks


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    blocks = BlockManager(num_blocks=8, block_size=16)
    taken = blocks.allocate(3)
    assert len(set(taken)) == 3
    assert all(blocks.ref_count(b) == 1 for b in taken)
    assert blocks.num_free == blocks.num_usable - 3


def test_block_zero_is_never_handed_out():
    blocks = BlockManager(num_blocks=5, block_size=16)
    taken = blocks.allocate(blocks.num_usable)
    assert NULL_BLOCK not in taken
    assert blocks.num_usable == 4 and blocks.num_free == 0
    blocks.release(taken)
    assert NULL_BLOCK not in blocks.allocate(4)


def test_shared_blocks_return_only_when_the_last_holder_releases():
    blocks = BlockManager(num_blocks=8, block_size=16)
    prefix = blocks.allocate(2)
    blocks.share(prefix)
    blocks.share(prefix)
    assert [blocks.ref_count(b) for b in prefix] == [3, 3]
    assert blocks.num_shared() == 2
    blocks.release(prefix)
    blocks.release(prefix)
    assert blocks.num_free == blocks.num_usable - 2
    blocks.release(prefix)
    assert blocks.num_free == blocks.num_usable
    assert blocks.num_shared() == 0


def test_double_release_is_an_error():
    blocks = BlockManager(num_blocks=4, block_size=16)
    taken = blocks.allocate(1)
    blocks.release(taken)
    with pytest.raises(ValueError, match=f"block {taken[0]} released more often"):
        blocks.release(taken)
    assert blocks.num_free == blocks.num_usable


def test_sharing_a_free_block_is_an_error():
    blocks = BlockManager(num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="block 2 is not allocated"):
        blocks.share([2])


def test_over_allocation_raises_out_of_blocks_and_takes_nothing():
    blocks = BlockManager(num_blocks=4, block_size=16)
    with pytest.raises(OutOfBlocks, match="need 4 blocks, 3 free"):
        blocks.allocate(4)
    assert blocks.num_free == 3


def test_blocks_for_rounds_up_to_whole_blocks():
    blocks = BlockManager(num_blocks=4, block_size=16)
    assert [blocks.blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_a_cache_needs_two_blocks():
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockManager(num_blocks=1, block_size=16)
