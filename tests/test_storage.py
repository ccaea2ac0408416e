import pytest
import torch

from landmark_memory.storage import DTYPES, STORES, HotCache, LmdbStore, MemoryStore, open_store

SHAPE = (2, 3, 6, 8)  # (k/v, H, block_size + 1, D)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", STORES)
def test_every_store_and_dtype_round_trips(kind, dtype, tmp_path):
    store = open_store(kind, SHAPE, tmp_path, dtype)
    blocks = {(s, layer, b): torch.randn(SHAPE) for s in range(2) for layer in range(2) for b in range(20)}
    store.put(dict(list(blocks.items())[:30]))
    store.put(dict(list(blocks.items())[30:]))
    keys = list(blocks)[::-1]
    for k, t in zip(keys, store.get(keys)):
        assert t.dtype == DTYPES[dtype] and torch.equal(t, blocks[k].to(DTYPES[dtype]))
    store.close()


@pytest.mark.parametrize("kind", ["lmdb", "mmap"])
def test_disk_stores_persist_across_reopening(kind, tmp_path):
    store = open_store(kind, SHAPE, tmp_path, "float32")
    blocks = {(0, 1, b): torch.randn(SHAPE) for b in range(5)}
    store.put(blocks)
    store.close()
    again = open_store(kind, SHAPE, tmp_path, "float32")
    assert all(torch.equal(a, blocks[k]) for k, a in zip(blocks, again.get(list(blocks))))
    again.close()


def test_lmdb_grows_its_map_when_full(tmp_path):
    store = LmdbStore(SHAPE, tmp_path, "float32", map_size=64 << 10)
    blocks = {(0, 0, b): torch.randn(SHAPE) for b in range(200)}  # ~900 KiB
    store.put(blocks)
    assert torch.equal(store.get([(0, 0, 199)])[0], blocks[(0, 0, 199)])
    store.close()


def test_missing_block_and_bad_shapes_are_explained(tmp_path):
    store = MemoryStore(SHAPE, "float32")
    with pytest.raises(KeyError, match="missing"):
        store.get([(0, 0, 0)])
    with pytest.raises(ValueError, match=r"\(2, 3, 6, 8\)"):
        store.put({(0, 0, 0): torch.zeros(2, 3, 5, 8)})
    with pytest.raises(ValueError, match="unknown store"):
        open_store("redis", SHAPE)
    with pytest.raises(ValueError, match="pass a path"):
        open_store("lmdb", SHAPE)
    with pytest.raises(ValueError, match="dtype"):
        open_store("memory", SHAPE, dtype="int8")


def test_hot_cache_stays_within_budget_and_evicts_least_recent():
    store = MemoryStore(SHAPE, "float32")
    blocks = {(0, 0, b): torch.randn(SHAPE) for b in range(10)}
    store.put(blocks)
    per_block = torch.zeros(SHAPE).numel() * 4
    cache = HotCache(store, "cpu", torch.float32, budget_bytes=3 * per_block + 10)
    for b in range(10):
        got = cache.get([(0, 0, b), (0, 0, 0)])  # block 0 stays recent
        assert torch.equal(got[0], blocks[(0, 0, b)]) and torch.equal(got[1], blocks[(0, 0, 0)])
        assert cache.bytes <= cache.budget and cache.arena.numel() * 4 <= cache.budget
    assert (0, 0, 0) in cache._slots and (0, 0, 1) not in cache._slots
    assert cache.hits == 9 and cache.misses == 10


def test_hot_cache_pool_is_the_arena_and_serves_requests_larger_than_it():
    store = MemoryStore(SHAPE, "float32")
    blocks = {(0, 0, b): torch.randn(SHAPE) for b in range(6)}
    store.put(blocks)
    per_block = torch.zeros(SHAPE).numel() * 4
    cache = HotCache(store, "cpu", torch.float32, budget_bytes=4 * per_block, prepare=lambda t: t * 2)
    keys = [(0, 0, 3), (0, 0, 1), (0, 0, 3)]
    pool, slots = cache.pool(keys)
    assert pool is cache.arena and slots[0] == slots[2]
    assert all(torch.equal(pool[s], blocks[k] * 2) for k, s in zip(keys, slots.tolist()))
    big = [(0, 0, b) for b in range(6)]  # more than fits: a one-off pool, arena untouched
    pool, slots = cache.pool(big)
    assert pool is not cache.arena and all(torch.equal(pool[s], blocks[k] * 2) for k, s in zip(big, slots.tolist()))
    nothing = HotCache(store, "cpu", torch.float32, budget_bytes=per_block - 1)
    assert torch.equal(nothing.get([(0, 0, 3)])[0], blocks[(0, 0, 3)]) and nothing.bytes == 0
