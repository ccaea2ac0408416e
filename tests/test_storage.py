import threading
import time

import lmdb
import pytest
import torch

from landmark_memory.core.names import DISK_STORES
from landmark_memory.core.quant import dequantize, quantize
from landmark_memory.storage import (
    DTYPES,
    STORE_KINDS,
    STORES,
    CorruptBlockError,
    HotCache,
    LmdbStore,
    MemoryStore,
    MmapStore,
    open_store,
)

SHAPE = (2, 3, 6, 8)  # (k/v, H, block_size + 1, D)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", STORES)
def test_every_store_and_dtype_round_trips(kind, dtype, tmp_path):
    store = open_store(kind, SHAPE, tmp_path, dtype)
    blocks = {(s, layer, b): torch.randn(SHAPE) for s in range(2) for b in range(20) for layer in range(2)}
    store.put(dict(list(blocks.items())[:30]))  # whole blocks (every layer) in each put, as a memory writes them
    store.put(dict(list(blocks.items())[30:]))
    keys = list(blocks)[::-1]
    for k, t in zip(keys, store.get(keys)):
        want = dequantize(*quantize(blocks[k][None]))[0] if dtype == "int8" else blocks[k].to(DTYPES[dtype])
        assert t.dtype == want.dtype and torch.equal(t, want)
    data, scales = store.read(keys[:3])  # as stored: int8 with float32 scales, or the float dtype alone
    assert data.dtype == DTYPES[dtype] and data.shape == (3, *SHAPE)
    assert (scales is not None) == (dtype == "int8") and (scales is None or scales.shape == (3, 3, 8 + 6))
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


def test_the_store_registry_is_what_the_command_line_offers_and_each_kind_opens_its_own_store(tmp_path):
    assert tuple(STORE_KINDS) == STORES and tuple(k for k in STORES if STORE_KINDS[k].on_disk) == DISK_STORES
    for kind, cls in [("memory", MemoryStore), ("lmdb", LmdbStore), ("mmap", MmapStore)]:
        store = open_store(kind, SHAPE, tmp_path, "float32")
        assert type(store) is cls and (tmp_path / kind).is_dir() == STORE_KINDS[kind].on_disk
        store.close()
    with pytest.raises(ValueError, match="pass a path"):
        open_store("mmap", SHAPE)
    with pytest.raises(ValueError, match="unknown store 'tape'"):
        open_store("tape", SHAPE, tmp_path)


def test_lmdb_grows_its_map_when_full(tmp_path):
    store = LmdbStore(SHAPE, tmp_path, "float32", map_size=64 << 10)
    blocks = {(0, 0, b): torch.randn(SHAPE) for b in range(200)}  # ~900 KiB
    store.put(blocks)
    assert torch.equal(store.get([(0, 0, 199)])[0], blocks[(0, 0, 199)])
    store.close()


def test_a_writer_after_readers_of_one_lmdb_store_in_a_process_reopens_it_for_all(tmp_path):
    x, y = torch.randn(*SHAPE), torch.randn(*SHAPE)
    first = LmdbStore(SHAPE, tmp_path / "s", store_dtype="float32")
    first.put({(0, 0, 0): x})
    first.close()
    reader = LmdbStore(SHAPE, tmp_path / "s", store_dtype="float32", readonly=True)  # (a corpus's reader)
    writer = LmdbStore(SHAPE, tmp_path / "s", store_dtype="float32")  # (its build, packing a document)
    writer.put({(0, 0, 1): y})
    assert torch.equal(reader.get([(0, 0, 0)])[0], x) and torch.equal(reader.get([(0, 0, 1)])[0], y)
    writer.close()
    assert torch.equal(reader.get([(0, 0, 1)])[0], y)
    reader.close()


def test_threads_opening_and_closing_one_lmdb_store_at_once_share_its_environment(tmp_path, monkeypatch):
    blocks = {(0, 0, b): torch.randn(SHAPE) for b in range(3)}
    writer = LmdbStore(SHAPE, tmp_path, "float32")
    writer.put(blocks)
    writer.close()
    real_open = lmdb.open

    def slow_open(*args, **kwargs):  # a slow disk: every thread arrives while the first is still opening
        time.sleep(0.05)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(lmdb, "open", slow_open)
    start, errors = threading.Barrier(6), []

    def read():
        try:
            start.wait()
            for _ in range(3):
                store = LmdbStore(SHAPE, tmp_path, "float32", readonly=True)
                assert torch.equal(store.get([(0, 0, 2)])[0], blocks[(0, 0, 2)])
                store.close()
        except Exception as e:  # noqa: BLE001 - handed to the main thread to fail the test
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


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
        open_store("memory", SHAPE, store_dtype="int4")


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
    pool, scales, slots = cache.pool(keys)
    assert pool is cache.arena and scales is None and slots[0] == slots[2]
    assert all(torch.equal(pool[s], blocks[k] * 2) for k, s in zip(keys, slots.tolist()))
    big = [(0, 0, b) for b in range(6)]  # more than fits: a one-off pool, arena untouched
    pool, _, slots = cache.pool(big)
    assert pool is not cache.arena and all(torch.equal(pool[s], blocks[k] * 2) for k, s in zip(big, slots.tolist()))
    nothing = HotCache(store, "cpu", torch.float32, budget_bytes=per_block - 1)
    assert torch.equal(nothing.get([(0, 0, 3)])[0], blocks[(0, 0, 3)]) and nothing.bytes == 0


def test_int8_blocks_are_within_half_a_step_of_their_floats_per_key_channel_and_value_row():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(5, *SHAPE, generator=g) * torch.logspace(-3, 2, 8)  # channels of very different sizes
    kv[0] = 0.0  # an all-zero block
    data, scales = quantize(kv)
    assert data.dtype == torch.int8 and data.abs().max() <= 127 and scales.dtype == torch.float16
    back = dequantize(data, scales)
    step = torch.stack([scales[..., None, :8].float().expand(-1, -1, 6, -1),
                        scales[..., 8:, None].float().expand(-1, -1, -1, 8)], 1)  # (n, 2, H, L, D)
    assert torch.equal(back[0], kv[0]) and torch.isfinite(back).all()
    assert ((back - kv).abs() <= step * 0.5 + 1e-3 * step).all()  # a float16 scale rounds by at most 0.1%
    assert (kv[:, 0].abs().amax(2) / 127 - scales[..., :8].float()).abs().max() < 1e-3 * kv.abs().max()


@pytest.mark.parametrize("kind", ["lmdb", "mmap"])
def test_an_int8_blocks_checksum_covers_its_scales(kind, tmp_path):
    store = open_store(kind, SHAPE, tmp_path, "int8", checksums=True)
    assert store.nbytes == 2 * 3 * 6 * 8 + 3 * (8 + 6) * 2  # int8 rows, then float16 scales
    store.put({(0, 0, 0): torch.randn(SHAPE)})
    store.close()
    f = next(p for p in (tmp_path / kind).iterdir() if p.name in ("data.mdb", "s0_l0.blocks"))
    raw = bytearray(f.read_bytes())
    store = open_store(kind, SHAPE, tmp_path, "int8", checksums=True, readonly=True)
    good = store._get([(0, 0, 0)])[0]
    store.close()
    where = raw.find(good) + 2 * 3 * 6 * 8 + 1  # a byte of the scales
    raw[where] ^= 0xFF
    f.write_bytes(bytes(raw))
    store = open_store(kind, SHAPE, tmp_path, "int8", checksums=True, readonly=True)
    with pytest.raises(CorruptBlockError):
        store.get([(0, 0, 0)])
    store.close()


def test_an_int8_lmdb_store_keeps_a_blocks_layers_in_one_record(tmp_path):
    store = open_store("lmdb", SHAPE, tmp_path, "int8", checksums=True)
    blocks = {(0, layer, b): torch.randn(SHAPE) for b in range(3) for layer in range(4)}
    store.put(blocks)
    assert store.env.stat()["entries"] == 3 and store.env.stat()["overflow_pages"] <= 3
    want = [dequantize(*quantize(t[None]))[0] for t in blocks.values()]
    assert all(torch.equal(a, b) for a, b in zip(store.get(list(blocks)), want))
    with pytest.raises(KeyError, match="missing"):
        store.get([(0, 4, 1)])  # no such layer
    with pytest.raises(ValueError, match="every layer of a block together"):
        store.put({(0, 1, 5): torch.randn(SHAPE)})
    store.close()


def test_the_hot_cache_holds_int8_blocks_as_stored_four_times_as_many_in_the_same_budget():
    shape = (2, 3, 65, 64)  # SmolLM2's blocks
    blocks = {(0, 0, b): torch.randn(shape) for b in range(8)}
    f32, i8 = MemoryStore(shape, "float32"), MemoryStore(shape, "int8")
    f32.put(blocks)
    i8.put(blocks)
    budget = 2 * torch.zeros(shape).numel() * 4
    wide, compact = HotCache(f32, "cpu", torch.float32, budget), HotCache(i8, "cpu", torch.float32, budget)
    assert wide.capacity == 2 and compact.capacity == 7  # float32 scales take 12% of the fourfold
    keys = list(blocks)[:compact.capacity]
    pool, scales, slots = compact.pool(keys)
    assert pool.dtype == torch.int8 and pool is compact.arena and scales is compact.scales
    data, want = i8.read(keys)
    assert torch.equal(pool[torch.from_numpy(slots)], data) and torch.equal(scales[torch.from_numpy(slots)], want)
    assert all(torch.equal(a, b) for a, b in zip(compact.get(keys), i8.get(keys)))
    with pytest.raises(ValueError, match="before they are stored"):
        HotCache(i8, "cpu", torch.float32, budget, prepare=lambda t: t)
