"""Block pool: allocation, reference counts, prefix hits through the hash chain, LRU eviction."""

from kt_cli.engine.block_manager import BlockManager, chain_hash
from kt_cli.engine.sampling_params import SamplingParams
from kt_cli.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams(), BS)


def compute_all(manager: BlockManager, s: Sequence) -> None:
    s.num_computed = len(s)
    manager.commit_computed(s)


class Recorder:
    def __init__(self):
        self.evicted = []

    def block_evicted(self, block_hash, token_ids, block_id):
        self.evicted.append((block_hash, token_ids, block_id))


def test_admit_allocates_enough_blocks_and_free_returns_them():
    manager = BlockManager(8, BS)
    s = seq(list(range(10)))
    assert manager.admit(s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert manager.num_free_blocks == 5
    manager.free(s)
    assert manager.num_free_blocks == 8 and s.block_table == [] and s.num_computed == 0


def test_admit_can_cover_only_a_chunk_then_grow():
    manager = BlockManager(8, BS)
    s = seq(list(range(10)))
    assert manager.admit(s, 5)
    assert len(s.block_table) == 2
    s.num_computed = 5
    assert manager.grow(s, 5)
    assert len(s.block_table) == 3


def test_admit_refuses_without_changing_anything_when_the_pool_is_short():
    manager = BlockManager(2, BS)
    s = seq(list(range(10)))
    assert not manager.admit(s, 10)
    assert manager.num_free_blocks == 2 and s.block_table == []
    assert not manager.grow(s, 10)


def test_shared_prefix_is_found_and_reference_counted():
    manager = BlockManager(8, BS)
    first = seq(list(range(10)), "a")
    manager.admit(first, 10)
    compute_all(manager, first)
    second = seq(list(range(9)) + [99, 98], "b")
    assert manager.admit(second, 11)
    assert second.num_computed == second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    manager.free(first)
    assert [manager.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    assert manager.num_free_blocks == 8 - 3


def test_hit_leaves_the_last_token_to_compute():
    manager = BlockManager(8, BS)
    first = seq(list(range(8)), "a")
    manager.admit(first, 8)
    compute_all(manager, first)
    again = seq(list(range(8)), "b")
    manager.admit(again, 8)
    assert again.num_computed == 4


def test_different_earlier_blocks_break_the_chain():
    manager = BlockManager(8, BS)
    first = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    manager.admit(first, 9)
    compute_all(manager, first)
    other = seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    manager.admit(other, 9)
    assert other.num_computed == 0


def test_hash_chain_depends_on_the_whole_prefix():
    assert chain_hash(None, [1, 2]) != chain_hash(chain_hash(None, [0]), [1, 2])
    assert chain_hash(None, [1, 2]) == chain_hash(None, [1, 2])
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1])


def test_freed_cached_blocks_are_found_again_before_eviction():
    manager = BlockManager(4, BS)
    first = seq(list(range(9)), "a")
    manager.admit(first, 9)
    compute_all(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = seq(list(range(9)), "b")
    assert manager.admit(again, 9)
    assert again.num_computed == 8
    assert manager.num_free_blocks == 1


def test_reclaimed_hits_count_against_the_free_pool():
    manager = BlockManager(3, BS)
    first = seq(list(range(9)), "a")
    manager.admit(first, 9)
    compute_all(manager, first)
    manager.free(first)
    # 2 cached blocks are free but would be taken as hits: 1 block left for 2 new ones
    again = seq(list(range(8)) + list(range(50, 57)), "b")
    assert not manager.admit(again, 15)
    assert manager.num_free_blocks == 3 and again.block_table == []


def test_eviction_takes_plain_blocks_first_then_least_recently_freed():
    recorder = Recorder()
    manager = BlockManager(4, BS, eviction_listener=recorder)
    old = seq([1] * 4 + [9], "old")
    manager.admit(old, 5)
    compute_all(manager, old)
    manager.free(old)
    new = seq([2] * 4 + [9], "new")
    manager.admit(new, 5)
    compute_all(manager, new)
    manager.free(new)
    assert recorder.evicted == []
    filler = seq([3] * 12, "filler")
    assert manager.admit(filler, 12)
    assert len(recorder.evicted) == 1 and recorder.evicted[0][1] == (1, 1, 1, 1)
    still_cached = seq([2] * 4 + [7], "again")
    manager.free(filler)
    manager.admit(still_cached, 5)
    assert still_cached.num_computed == 4


def test_duplicate_blocks_computed_twice_are_not_registered_twice():
    manager = BlockManager(8, BS)
    a, b = seq([5] * 6, "a"), seq([5] * 6, "b")
    manager.admit(a, 6)
    manager.admit(b, 6)
    compute_all(manager, a)
    compute_all(manager, b)
    assert len(manager.hash_to_block) == 1
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8 and len(manager.free_cached) == 1


def test_prefix_caching_off_never_hits():
    manager = BlockManager(8, BS, prefix_caching=False)
    first = seq(list(range(9)), "a")
    manager.admit(first, 9)
    compute_all(manager, first)
    again = seq(list(range(9)), "b")
    manager.admit(again, 9)
    assert again.num_computed == 0 and manager.hash_to_block == {}
