"""Prefix-cache tiers: disk files round-trip bit-exactly across a restart, stay inside their
byte budget (LRU), and anything foreign or corrupt is deleted, never loaded. Through the
engine: blocks evicted from a small pool come back from disk and the greedy output equals a
run with a pool large enough to never evict."""

import json
import os
import struct

import pytest
import torch

from kt_cli.engine.block_manager import chain_hash
from kt_cli.engine.forward_batch import ForwardBatch, KVCache, KVSpec
from kt_cli.engine.llm_engine import EngineConfig, LLMEngine
from kt_cli.engine.prefix_store import (FORMAT_VERSION, MAGIC, BlockLayout, DiskTier, PrefixStore, RamTier,
                                        StoredBlock, encode_block, read_block)
from kt_cli.engine.sampling_params import SamplingParams

BS = 4


def layout(model_id="model-a", dtype=torch.float32, block_size=BS) -> BlockLayout:
    kv = KVCache.allocate([KVSpec(((2, 3), (2, 3)), dtype), KVSpec(((5,),), dtype)], block_size, 2)
    return BlockLayout.of_cache(kv, model_id)


def random_block(lay: BlockLayout, seed: int) -> StoredBlock:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=g).to(getattr(torch, dtype)) for dtype, shape in lay.tensors]
    return StoredBlock(tuple(range(seed, seed + lay.block_size)), tensors)


def key(seed: int) -> bytes:
    return chain_hash(None, [seed])


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_disk_block_round_trips_bit_exactly_across_a_restart(tmp_path, dtype):
    lay = layout(dtype=dtype)
    blocks = {key(i): random_block(lay, i) for i in range(3)}
    tier = DiskTier(tmp_path, 1 << 20, lay)
    for k, block in blocks.items():
        tier.put(k, block)
    reopened = DiskTier(tmp_path, 1 << 20, lay)
    assert reopened.stats.blocks == 3 and reopened.stats.bytes_used == tier.stats.bytes_used
    for k, block in blocks.items():
        got = reopened.get(k)
        assert got.token_ids == block.token_ids
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got.tensors, block.tensors))


def test_files_are_named_by_key_and_carry_a_versioned_header(tmp_path):
    lay = layout()
    DiskTier(tmp_path, 1 << 20, lay).put(key(7), random_block(lay, 7))
    (path,) = tmp_path.iterdir()
    assert path.name == f"{key(7).hex()}.kvb"
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8:8 + length])
    assert data[:4] == MAGIC and header["format"] == FORMAT_VERSION and header["model"] == "model-a"
    assert header["block_size"] == BS and header["tokens"] == list(range(7, 7 + BS))
    assert len(data) == 8 + length + header["payload_bytes"] == 8 + length + lay.block_bytes


def test_a_corrupt_payload_is_rejected_and_deleted(tmp_path):
    lay = layout()
    DiskTier(tmp_path, 1 << 20, lay).put(key(1), random_block(lay, 1))
    path = tmp_path / f"{key(1).hex()}.kvb"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    tier = DiskTier(tmp_path, 1 << 20, lay)
    assert tier.has(key(1))              # the header is fine: found by the scan ...
    assert tier.get(key(1)) is None      # ... but the checksum fails on load
    assert not path.exists() and tier.stats.rejected == 1 and not tier.has(key(1))


def _rewrite_header(path, **changes):
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8:8 + length]) | changes
    encoded = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(encoded)) + encoded + data[8 + length:])


FOREIGN = {
    "other model": lambda p: _rewrite_header(p, model="model-b"),
    "other format version": lambda p: _rewrite_header(p, format=FORMAT_VERSION + 1),
    "other block size": lambda p: _rewrite_header(p, block_size=BS * 2),
    "other tensor shapes": lambda p: _rewrite_header(p, tensors=[["float32", [BS, 2, 4]]] * 3),
    "other dtype": lambda p: _rewrite_header(p, tensors=[["bfloat16", s] for _, s in json.loads(
        p.read_bytes()[8:8 + struct.unpack("<I", p.read_bytes()[4:8])[0]])["tensors"]]),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-10]),
    "garbage": lambda p: p.write_bytes(b"not a block at all"),
    "empty": lambda p: p.write_bytes(b""),
    "renamed to another key": lambda p: p.rename(p.with_name(f"{key(99).hex()}.kvb")),
}


@pytest.mark.parametrize("damage", FOREIGN.values(), ids=FOREIGN.keys())
def test_foreign_or_damaged_files_are_deleted_at_start(tmp_path, damage):
    lay = layout()
    first = DiskTier(tmp_path, 1 << 20, lay)
    first.put(key(1), random_block(lay, 1))
    first.put(key(2), random_block(lay, 2))
    damage(tmp_path / f"{key(1).hex()}.kvb")
    (tmp_path / "leftover.tmp123").write_bytes(b"half a write")
    tier = DiskTier(tmp_path, 1 << 20, lay)
    assert files(tmp_path) == [f"{key(2).hex()}.kvb"]
    assert tier.stats.blocks == 1 and tier.stats.rejected == 1
    assert tier.get(key(2)) is not None and not tier.has(key(1)) and not tier.has(key(99))


def test_disk_tier_keeps_to_its_budget_least_recently_used_first_even_after_restart(tmp_path):
    lay = layout()
    one = len(encode_block(lay, key(0), random_block(lay, 0)))
    tier = DiskTier(tmp_path, 3 * one, lay)
    for i in range(3):
        tier.put(key(i), random_block(lay, i))
    assert tier.get(key(0)) is not None          # 0 is now the most recent; 1 the oldest
    tier.put(key(3), random_block(lay, 3))
    assert [tier.has(key(i)) for i in range(4)] == [True, False, True, True]
    assert len(files(tmp_path)) == 3 and tier.stats.bytes_used <= 3 * one
    reopened = DiskTier(tmp_path, 3 * one, lay)  # order by mtime: 2, 0, 3
    reopened.put(key(4), random_block(lay, 4))
    assert [reopened.has(key(i)) for i in range(5)] == [True, False, False, True, True]
    smaller = DiskTier(tmp_path, 2 * one, lay)   # a smaller budget at start trims the oldest
    assert [smaller.has(key(i)) for i in range(5)] == [False, False, False, True, True]


def test_ram_tier_hands_its_least_recently_used_blocks_down(tmp_path):
    lay = layout()
    disk = DiskTier(tmp_path, 1 << 20, lay)
    ram = RamTier(2 * random_block(lay, 0).nbytes, disk)
    for i in range(3):
        ram.put(key(i), random_block(lay, i))
    assert ram.get(key(0)) is None and disk.has(key(0))
    assert ram.has(key(1)) and ram.has(key(2)) and not disk.has(key(1))
    assert ram.stats.bytes_used == 2 * random_block(lay, 0).nbytes


# --- through the engine -------------------------------------------------------------------

VOCAB, DIM = 40, 16


class CacheReadingLM:
    """One attention layer over the paged cache, so a wrong restored block changes the output."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.embed, self.pos = torch.randn(VOCAB, DIM, generator=g), torch.randn(256, DIM, generator=g)
        self.wk, self.wv = torch.randn(DIM, DIM, generator=g), torch.randn(DIM, DIM, generator=g)
        self.head = torch.randn(DIM, VOCAB, generator=g) * 3
        self.config = {"vocab_size": VOCAB}

    def kv_specs(self):
        return [KVSpec(((DIM,), (DIM,)))]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed[batch.input_ids] + self.pos[batch.positions]
        k_cache, v_cache = batch.kv.layers[0]
        k_cache[batch.slot_mapping], v_cache[batch.slot_mapping] = x @ self.wk, x @ self.wv
        out = torch.empty_like(x)
        for i in range(batch.num_seqs):
            rows, slots = batch.seq_rows(i), batch.seq_slots(i)
            n, length = rows.stop - rows.start, len(slots)
            scores = x[rows] @ k_cache[slots].T / DIM ** 0.5
            causal = torch.arange(length)[None, :] > torch.arange(length - n, length)[:, None]
            out[rows] = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v_cache[slots]
        return ((x + out) @ self.head)[batch.logits_rows]


class Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def engine(kv_blocks: int, store_dir=None, model_id="tiny", model=None) -> LLMEngine:
    kv_bytes = kv_blocks * BS * 2 * DIM * 4
    eng = LLMEngine(model or CacheReadingLM(), Chars(), EngineConfig(ctx=64, kv_bytes=kv_bytes, block_size=BS,
                                                                      max_batch=2, max_step_tokens=64))
    if store_dir is not None:
        PrefixStore.for_cache(eng.runner.kv, model_id, store_dir, 1 << 24).install(eng)
    return eng


def run(eng: LLMEngine, prompt: list[int]):
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outs = []
    for _ in range(200):
        outs += eng.step()
        if not eng.has_unfinished():
            break
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


PREFIX = [(7 * i + 3) % VOCAB for i in range(24)]
OTHERS = [[(5 * i + j) % VOCAB for i in range(30)] for j in range(4)]


def test_evicted_blocks_come_back_from_disk_with_the_same_output(tmp_path):
    reference = engine(kv_blocks=256)
    want = [run(reference, PREFIX + [1, 2])[0], run(reference, PREFIX + [3, 4])[0]]
    small = engine(kv_blocks=16, store_dir=tmp_path)
    assert run(small, PREFIX + [1, 2])[0] == want[0]
    for other in OTHERS:                  # push every PREFIX block out of the 16-block pool
        run(small, other)
    assert chain_hash(None, PREFIX[:BS]) not in small.block_manager.hash_to_block
    tokens, cached = run(small, PREFIX + [3, 4])
    assert tokens == want[1]
    assert cached == len(PREFIX) and small.block_manager.num_restored_blocks == len(PREFIX) // BS


def test_a_restart_finds_the_persisted_prefix_and_another_model_does_not(tmp_path):
    first = engine(kv_blocks=64, store_dir=tmp_path)
    want, _ = run(first, PREFIX + [1, 2])
    store = first.block_manager.prefix_source
    assert store.persist(first.block_manager) >= len(PREFIX) // BS
    again = engine(kv_blocks=64, store_dir=tmp_path)
    assert run(again, PREFIX + [1, 2]) == (want, len(PREFIX))
    other = engine(kv_blocks=64, store_dir=tmp_path, model_id="another-model")
    assert run(other, PREFIX + [1, 2]) == (want, 0)
    assert not any(tmp_path.iterdir())     # the other model deleted what it could not trust


def test_restored_block_content_equals_the_evicted_block(tmp_path):
    eng = engine(kv_blocks=16, store_dir=tmp_path)
    run(eng, PREFIX + [1, 2])
    first_block = eng.block_manager.hash_to_block[chain_hash(None, PREFIX[:BS])]
    before = read_block(eng.runner.kv, first_block)
    for other in OTHERS:
        run(eng, other)
    run(eng, PREFIX + [5])
    after = read_block(eng.runner.kv, eng.block_manager.hash_to_block[chain_hash(None, PREFIX[:BS])])
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert os.listdir(tmp_path)


def test_a_pool_off_the_host_gets_a_ram_tier_above_the_disk(tmp_path):
    kv = KVCache.allocate([KVSpec(((2, 3),))], BS, 4, device="meta")
    assert [t.name for t in PrefixStore.for_cache(kv, "m", tmp_path, 1 << 20, ram_bytes=1 << 20).tiers] == ["ram", "disk"]
    host = KVCache.allocate([KVSpec(((2, 3),))], BS, 4)
    assert [t.name for t in PrefixStore.for_cache(host, "m", tmp_path, 1 << 20, ram_bytes=1 << 20).tiers] == ["disk"]


def test_gpu_pool_spills_to_ram_then_disk_and_restores_exactly(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the KV pool on the device, evicted blocks in host RAM)")
    kv = KVCache.allocate([KVSpec(((2, 8), (2, 8)), torch.bfloat16)] * 2, BS, 8, device="cuda")
    for layer in kv.layers:
        for t in layer:
            t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    originals = {b: read_block(kv, b) for b in range(8)}
    one = sum(t.numel() * t.element_size() for t in originals[0])
    store = PrefixStore.for_cache(kv, "gpu-model", tmp_path, 1 << 20, ram_bytes=2 * one)
    for b in range(4):
        store.block_evicted(key(b), tuple(range(b, b + BS)), b)
    ram, disk = store.tiers
    assert ram.has(key(2)) and ram.has(key(3)) and disk.has(key(0)) and disk.has(key(1))
    for b in range(4):
        target = 4 + b
        assert store.restore_block(key(b), tuple(range(b, b + BS)), target)
        assert all(torch.equal(a, o) for a, o in zip(read_block(kv, target), originals[b]))
    assert not store.restore_block(key(0), (9, 9, 9, 9), 4)    # same key, other tokens: refused
