"""The memory's parts on their own: the retrieval policy's pure functions, the options, the
manifest's records and row layout, and the decoding loop."""

import numpy as np
import pytest
import torch

from landmark_memory.core.decode import decode, next_token
from landmark_memory.core.rope import RotaryEmbedding
from landmark_memory.format import Manifest, MemoryFileError, MemoryOptions, ModelShape
from landmark_memory.format.manifest import InputRecord, ModelRecord, RowLayout, StateFile
from landmark_memory.memory.blocks import BlockMemory
from landmark_memory.memory.retrieval import chunk_base, select_blocks

NEG = float("-inf")


def candidates():
    """Scores and ids of 2 heads x 2 queries over blocks 0..4 (B = 1)."""
    S = torch.tensor([[[[3.0, 1.0, 2.0], [0.0, 5.0, NEG]],
                       [[1.0, 4.0, 0.5], [2.0, 2.5, 3.0]]]])  # (1, 2, 2, 3)
    I = torch.tensor([[[[0, 1, 4], [2, 3, -1]],
                       [[0, 1, 4], [2, 3, 4]]]])
    return S, I


def test_per_token_head_selection_is_each_querys_own_top_k():
    S, I = candidates()
    ids = select_blocks(S, I, lo=0, nb=5, top_k=2, retrieval="per_token_head")
    assert ids.tolist() == [[[[0, 4], [3, 2]], [[1, 0], [4, 3]]]]


def test_fewer_candidates_than_k_leave_empty_slots():
    S, I = candidates()
    ids = select_blocks(S, I, lo=0, nb=5, top_k=4, retrieval="per_token_head")
    assert ids[0, 0, 1].tolist() == [3, 2, -1, -1]  # one candidate of query 1, head 0 is -inf


@pytest.mark.parametrize("retrieval", ["per_head", "per_token"])
def test_shared_selections_rank_by_the_best_softmaxed_score(retrieval):
    S, I = candidates()
    ids = select_blocks(S, I, lo=0, nb=5, top_k=2, retrieval=retrieval)
    logp = torch.where(I >= 0, S - torch.logsumexp(S, -1, keepdim=True), NEG)
    for h in range(2):
        for t in range(2):
            group = [(hh, tt) for hh in range(2) for tt in range(2)
                     if (hh == h if retrieval == "per_head" else tt == t)]
            best = {}
            for hh, tt in group:
                for s, i in zip(logp[0, hh, tt].tolist(), I[0, hh, tt].tolist()):
                    if i >= 0:
                        best[i] = max(best.get(i, NEG), s)
            expected = sorted(best, key=lambda i: -best[i])[:2]
            assert ids[0, h, t].tolist() == expected


def test_chunk_base_sits_after_the_stingy_slots_or_every_block():
    assert chunk_base(n_blocks=9, reads=3, L=6, mapping="stingy") == 24
    assert chunk_base(n_blocks=9, reads=3, L=6, mapping="exact") == 54


def test_query_options_change_on_reopen_and_structural_ones_do_not():
    o = MemoryOptions(index="ivf", index_options={"train_size": 64}, chunk_size=10)
    changed = o.with_query(top_k=7, nprobe=3)
    assert (changed.top_k, changed.index_options) == (7, {"train_size": 64, "nprobe": 3})
    assert o.top_k is None and o.index_options == {"train_size": 64}  # frozen: the original is unchanged
    with pytest.raises(ValueError, match="store cannot change"):
        o.with_query(store="lmdb")


def test_options_are_resolved_for_the_model_and_bad_ones_explained():
    o = MemoryOptions().resolved(model_block_size=50, dtype_name="float16", has_cmt=False, head_dim=32)
    assert (o.chunk_size, o.store_dtype) == (250, "float16")
    for bad in (0, 1025, 106324281, True):  # (a manifest's top_k of 10^8 would allocate (queries, top_k) arrays)
        with pytest.raises(ValueError, match="top_k must be an int from 1 to 1024"):
            MemoryOptions(top_k=bad).resolved(50, "float32", False, 32)
    with pytest.raises(ValueError, match="needs a model trained with a Context Miss Token"):
        MemoryOptions(cmt_cutoff=0.5).resolved(50, "float32", False, 32)


def test_a_memory_takes_its_options_as_one_object_or_as_settings_never_both():
    from landmark_memory import LandmarkConfig, LandmarkGPT, LandmarkMemory

    model = LandmarkGPT(LandmarkConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16, ffn_hidden=32, block_size=5,
                                       landmark_id=1)).eval()
    given = MemoryOptions(top_k=3, chunk_size=10, index="flat", index_options={"nprobe": 2})
    assert LandmarkMemory(model, given).options == LandmarkMemory(model, top_k=3, chunk_size=10, index="flat",
                                                                  index_options={"nprobe": 2}).options
    assert LandmarkMemory(model, index_options=None).options.index_options == {}  # none given: the default
    with pytest.raises(TypeError, match="not both"):
        LandmarkMemory(model, given, top_k=2)
    with pytest.raises(TypeError, match="topk: no memory option; the options are index, index_options"):
        LandmarkMemory(model, topk=2)


def manifest():
    shape = ModelShape(n_layer=2, n_kv_head=3, head_dim=4, block_size=5)
    return Manifest(model=ModelRecord("ab" * 32, {"n_layer": 2}, shape, "float32"),
                    options=MemoryOptions(store="lmdb", chunk_size=10, store_dtype="float16", block_keys="landmark",
                                          block_size=5, top_k=4, retrieval="per_token_head", sink_blocks=0,
                                          local_blocks=0),
                    streams=2, blocks=4, tokens=23,
                    pending_tokens=3, inputs=[InputRecord("/x/a.txt", "a.txt", "cd" * 32, 30, 23, 0)], commit=5,
                    state=StateFile("state.5.safetensors", 123, "ef" * 32), updated="2026-11-22T00:00:00+0000")


def test_manifest_round_trips_through_json():
    m = manifest()
    assert Manifest.from_json(m.to_json(), "m") == m
    assert m.block_bytes == 2 * (2 * 3 * 6 * 4) * 2  # layers x (k and v, heads, rows, dim) x float16


def test_a_manifest_missing_an_entry_is_refused_as_damaged():
    doc = manifest().to_json()
    del doc["blocks"]
    with pytest.raises(MemoryFileError, match="lacks or garbles an entry"):
        Manifest.from_json(doc, "m")


@pytest.mark.parametrize("dtype", [[], {}, 16, None])
def test_a_manifest_whose_model_dtype_is_no_name_is_refused_as_damaged(dtype):
    doc = manifest().to_json()
    doc["model"]["dtype"] = dtype  # a list or an object is no key of the dtype table: no TypeError
    with pytest.raises(MemoryFileError, match="model.dtype = .* the memory is damaged"):
        Manifest.from_json(doc, "m")


def test_a_manifest_of_more_streams_than_a_memory_holds_is_refused_before_anything_is_made_per_stream():
    doc = manifest().to_json()
    doc["streams"] = 4_975_789_582  # a list of its key files alone would not fit in memory
    with pytest.raises(MemoryFileError, match="streams = 4,975,789,582 .*at most 1,024"):
        Manifest.from_json(doc, "m")


@pytest.mark.parametrize("entry,value,words", [("n_kv_head", 12_725_575_266, "n_kv_head = 12,725,575,266"),
                                               ("block_size", 1 << 17, "block_size = 131,072"),
                                               ("n_layer", 60_000, "key file each: at most 1,048,576")])
def test_a_manifest_whose_model_shape_no_model_has_is_refused_before_anything_is_made_per_head(entry, value, words):
    doc = manifest().to_json()
    doc["model"]["shape"][entry] = value  # (60,000 layers x 3 heads x 12 streams: 2,160,000 key files)
    doc["streams"] = 12 if entry == "n_layer" else doc["streams"]
    with pytest.raises(MemoryFileError, match=f"{words}.* the memory is damaged"):
        Manifest.from_json(doc, "m")


@pytest.mark.parametrize("store", ["memory", None])
def test_a_manifest_whose_blocks_are_in_no_disk_store_is_refused_as_damaged(store):
    doc = manifest().to_json()
    if store is None:
        del doc["options"]["store"]  # read as the default of a memory without a path: blocks in memory
    else:
        doc["options"]["store"] = store
    with pytest.raises(MemoryFileError, match="options.store = 'memory' .*lmdb, mmap.* the memory is damaged"):
        Manifest.from_json(doc, "m")


@pytest.mark.parametrize("name,fingerprint", [("\r", "ab" * 32), ("tiny\nmodel", "ab" * 32), ("", "a\rb" * 16)])
def test_a_wrong_models_name_from_a_hostile_manifest_is_one_line(name, fingerprint):
    from landmark_memory.format.errors import wrong_model

    saved = ModelRecord(fingerprint, {}, ModelShape(n_layer=2, n_kv_head=3, head_dim=4, block_size=5), "float32", name)
    line = wrong_model("/m", saved, "bundled")
    assert len(line.splitlines()) == 1 and line.isprintable() and "built with another model" in line


def test_row_layout_round_trips_tokens_and_reads_the_landmark_rows_of_earlier_formats():
    layout = RowLayout(streams=2, shape=ModelShape(n_layer=2, n_kv_head=3, head_dim=4, block_size=5),
                       dtype=torch.float32, legacy=True)
    ids = np.arange(2 * 15, dtype=np.int32).reshape(2, 15)  # 3 blocks per stream
    data = layout.encode_tokens(ids)
    assert len(data) == 3 * layout.sizes["tokens.bin"]
    tok = layout.decode_tokens(data)  # (n, streams, block_size)
    np.testing.assert_array_equal(tok.transpose(1, 0, 2).reshape(2, 15), ids)
    keys = [torch.randn(2, 3, 3, 4) for _ in range(2)]  # per layer (streams, H_kv, n, D)
    data = torch.stack(keys, 2).permute(3, 0, 2, 1, 4).contiguous().numpy().tobytes()  # (n, streams, layer, H, D)
    assert len(data) == 3 * layout.sizes["landmarks.bin"]
    for a, b in zip(layout.decode_landmarks(data, torch.device("cpu")), keys):
        assert torch.equal(a, b)
    assert "landmarks.bin" not in RowLayout(2, layout.shape, torch.float32).sizes  # format 5: key files instead


def test_greedy_decoding_feeds_each_pick_but_the_last():
    fed = []

    def feed(nxt):
        fed.append(int(nxt))
        return torch.nn.functional.one_hot(nxt[:, 0] + 1, 10).float()  # the next token is always one more

    new = decode(torch.nn.functional.one_hot(torch.tensor([3]), 10).float(), feed, 4)
    assert new.tolist() == [[3, 4, 5, 6]] and fed == [3, 4, 5]


def test_decoding_stops_once_every_stream_has_produced_the_stop_token():
    def feed(nxt):  # stream 0 counts up from 3, stream 1 from 5
        return torch.nn.functional.one_hot(nxt[:, 0] + 1, 16).float()

    start = torch.nn.functional.one_hot(torch.tensor([3, 5]), 16).float()
    assert decode(start, feed, 6, stop_ids=[6]).tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]  # stream 1 stopped at 6 first
    assert decode(start, feed, 6, stop_ids=[9]).shape == (2, 6)  # never produced by both in time
    assert decode(start, feed, 6, stop_ids=[6, 4]).tolist() == [[3, 4], [5, 6]]  # either one ends a stream


def test_sampling_keeps_to_the_top_k_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]]).expand(64, -1)
    g = torch.Generator().manual_seed(0)
    picks = next_token(logits, temperature=2.0, sample_top_k=2, generator=g)
    assert set(picks.tolist()) == {1, 2}
    assert next_token(logits, temperature=0.0).tolist() == [1] * 64


def test_query_heads_of_a_key_value_head_search_its_index_together_as_each_alone():
    shape, bs = ModelShape(n_layer=1, n_kv_head=2, head_dim=8, block_size=3), 3
    options = MemoryOptions(chunk_size=12).resolved(bs, "float32", False, 8)
    blocks = BlockMemory(shape, options, store_path=None, readonly=False, device=torch.device("cpu"),
                         dtype=torch.float32, rope=RotaryEmbedding(8), cache_bytes=1 << 20)
    blocks.start(1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # 12 blocks
        kv = torch.randn(2, 1, 2, 4 * (bs + 1), 8, generator=g)
        blocks.add_chunk([(kv[0], kv[1])], torch.zeros(1, 12, dtype=torch.long))
    xq = torch.randn(1, 4, 3, 8, generator=g).numpy()  # 4 query heads, 2 per key/value head
    need = np.ones((1, 4, 3), bool)
    need[0, 1, 1] = need[0, 3] = False  # one query, and the whole of head 3, retrieve nothing
    D, I, skipped = blocks.search(0, xq, need, 2, 1, 10, group=2)
    assert skipped == 1
    for h in range(4):
        Dh, Ih = blocks.index(0, 0, h // 2).search(xq[0, h, need[0, h]], 2, 1, 10)
        np.testing.assert_array_equal(I[0, h][need[0, h]], Ih)
        np.testing.assert_allclose(D[0, h][need[0, h]], Dh, rtol=1e-6)
        assert (I[0, h][~need[0, h]] == -1).all() and np.isneginf(D[0, h][~need[0, h]]).all()
        assert ((Ih >= 1) & (Ih < 10)).all()
    every = blocks.search(0, xq, np.ones((1, 4, 3), bool), 2, 1, 10, group=2)
    for a, b in zip(blocks.search(0, xq, None, 2, 1, 10, group=2), every):  # None: every query, unmasked
        np.testing.assert_array_equal(a, b)
