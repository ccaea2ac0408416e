
import pytest
import torch

from landmark_memory import LandmarkConfig, LandmarkGPT
from landmark_memory.format import MemoryOptions
from landmark_memory.memory import LandmarkMemory
from landmark_memory.memory.retrieval import block_positions, select_blocks, stingy_slots, top_k_stingy


@pytest.fixture(scope="module")
def text():
    return torch.randint(4, 64, (2, 73), generator=torch.Generator().manual_seed(1))


def retrieve_all(model, **kw):
    return LandmarkMemory(model, top_k=16, position_mapping="exact", retrieval="per_token_head", **kw)  # 14 blocks


@pytest.mark.parametrize("chunk_size", [5, 10, 25])
def test_retrieve_all_equals_in_sequence_forward(model, text, chunk_size):
    with torch.no_grad():
        full = model(text)
    out = retrieve_all(model, chunk_size=chunk_size).forward(text, text)
    torch.testing.assert_close(out.logits, full, rtol=1e-5, atol=1e-5)
    assert out.loss is not None and torch.isfinite(out.loss)


def test_a_loss_takes_int32_targets_as_it_takes_int32_ids_and_refuses_others(model, text):
    full = retrieve_all(model, chunk_size=10).forward(text, text).loss
    int32 = retrieve_all(model, chunk_size=10).forward(text.int(), text.int()).loss
    torch.testing.assert_close(int32, full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="targets .* must be integer ids"):
        retrieve_all(model).forward(text, text.float())


@pytest.mark.parametrize("store", ["lmdb", "mmap"])
def test_retrieve_all_equivalence_through_disk_stores(model, text, store, tmp_path):
    with torch.no_grad():
        full = model(text)
    mem = retrieve_all(model, chunk_size=10, store=store, path=tmp_path, cache_bytes=0,  # every block from disk
                       store_dtype="float32")  # exact: a saved memory's default, int8, is not
    torch.testing.assert_close(mem.forward(text).logits, full, rtol=1e-5, atol=1e-5)
    assert mem.inspection.cache().misses > 0 and mem.inspection.cache().hits == 0
    mem.close()


@pytest.mark.parametrize("cache_bytes", [0, 256 << 20])  # every block a one-off pool from disk, or the arena
def test_an_int8_store_reads_as_the_reference_reads_its_dequantized_blocks_close_to_in_sequence(model, text, tmp_path,
                                                                                               cache_bytes):
    with torch.no_grad():
        full = model(text)
    outs = {}
    for backend in ("auto", "reference"):
        with retrieve_all(model, chunk_size=10, store="lmdb", path=tmp_path / backend, store_dtype="int8",
                          cache_bytes=cache_bytes, backend=backend) as mem:
            outs[backend] = mem.forward(text).logits
            assert mem.inspection.cache().arena_dtype == (None if cache_bytes == 0 else torch.int8)
    torch.testing.assert_close(outs["auto"], outs["reference"], rtol=1e-5, atol=1e-5)
    err = (outs["auto"] - full).abs().max() / full.abs().max()
    assert 0 < err < 0.02  # int8 blocks are not the float ones, but close


@pytest.mark.parametrize("mapping", ["stingy", "exact"])
@pytest.mark.parametrize("retrieval", ["per_token_head", "per_token"])
def test_pieces_and_decoding_equal_one_call(model, text, mapping, retrieval):
    kw = dict(top_k=2, chunk_size=10, position_mapping=mapping, retrieval=retrieval)
    whole = LandmarkMemory(model, **kw).forward(text)
    mem = LandmarkMemory(model, **kw)
    parts = [mem.forward(text[:, :13]).logits, mem.forward(text[:, 13:40]).logits]
    parts += [mem.inspection.step(text[:, t])[:, None] for t in range(40, 73)]
    torch.testing.assert_close(torch.cat(parts, 1), whole.logits, rtol=1e-5, atol=1e-5)


def test_last_or_no_logits_read_the_same_memory_as_every_logit(model, text):
    kw = dict(top_k=2, chunk_size=10)
    every, last, none = (LandmarkMemory(model, **kw) for _ in range(3))
    full = every.forward(text[:, :47]).logits  # (B, 47, V): several chunks, the last one open
    torch.testing.assert_close(last.forward(text[:, :47], logits="last").logits, full[:, -1:], rtol=1e-6, atol=1e-6)
    assert none.forward(text[:, :47], logits="none").logits.shape == (2, 0, 64)
    steps = [m.inspection.step(text[:, 47]) for m in (every, last, none)]  # the same memory underneath
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=0)
    torch.testing.assert_close(steps[2], steps[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss needs every token's logits"):
        none.forward(text[:, 48:50], text[:, 48:50], logits="none")
    with pytest.raises(ValueError, match="logits must be one of"):
        none.forward(text[:, 48:50], logits="first")


def test_retrieval_picks_top_k_existing_blocks(model, text):
    out = LandmarkMemory(model, top_k=3, chunk_size=10).forward(text)
    for ids in out.retrieved:
        assert ids.shape == (2, 2, 73, 3)
        # tokens of chunk c (10 tokens) see the 2c blocks of earlier chunks
        for t in range(73):
            avail = 2 * (t // 10)
            row = ids[:, :, t]
            assert ((row >= 0).sum(-1) == min(3, avail)).all()
            assert (row < avail).all()
            valid = row[row >= 0].view(-1)
            assert len(valid) == 0 or valid.max() < avail


def test_max_blocks_keeps_only_the_newest(model, text):
    out = LandmarkMemory(model, top_k=4, chunk_size=10, max_blocks=3).forward(text)
    for ids in out.retrieved:
        for t in range(73):
            avail = 2 * (t // 10)
            row = ids[:, :, t]
            assert ((row >= 0).sum(-1) == min(3, avail)).all()
            assert (row[row >= 0] >= avail - 3).all()


def test_retrieval_modes_share_blocks_as_documented(model, text):
    per_head = LandmarkMemory(model, top_k=2, chunk_size=10, retrieval="per_head").forward(text).retrieved[1]
    for c in range(1, 7):  # one set per head for all tokens of a chunk
        chunk = per_head[:, :, 10 * c:10 * c + 10]
        assert (chunk == chunk[:, :, :1]).all()
    per_token = LandmarkMemory(model, top_k=2, chunk_size=10, retrieval="per_token").forward(text).retrieved[1]
    assert (per_token == per_token[:, :1]).all()  # one set per token for all heads


@pytest.mark.parametrize("mapping", ["stingy", "exact"])
def test_a_decoding_steps_choice_per_head_is_its_one_querys_choice(model, text, mapping):
    mem = LandmarkMemory(model, top_k=2, chunk_size=10, position_mapping=mapping)
    mem.forward(text[:, :40])
    calls = []
    with mem.inspection.choosing(lambda choose: lambda *args: (calls.append(args), choose(*args))[1]):
        for t in range(40, 55):  # one token a step (two where it closes a block: token and landmark)
            mem.forward(text[:, t:t + 1])
    single = [args for args in calls if args[1].shape[2] == 1]
    assert single

    def chosen(args, **changes):  # the memory's own choice for ``args`` under its options changed by ``changes``
        got = []
        with mem.querying(**changes), mem.inspection.choosing(lambda choose: got.append(choose(*args)) or choose):
            return got[0]

    for args in single:
        ids, pos = chosen(args, retrieval="per_head")
        want_ids, want_pos = chosen(args)
        assert torch.equal(ids, want_ids) and torch.equal(pos, want_pos)


def test_stingy_positions_keep_order_and_recent_slots():
    L = 6
    ids = torch.tensor([[[[9, 2, 5]], [[8, -1, 3]], [[0, 1, 2]], [[9, 8, 7]]]])  # nb = 10: recent are 7, 8, 9
    pos = block_positions(ids.view(1, 4, 1, 3), nb=10, reads=3, L=L, mapping="stingy") // L
    assert pos.view(4, 3).tolist() == [[3, 0, 1], [2, 0, 0], [0, 1, 2], [3, 2, 1]]
    assert torch.equal(stingy_slots(ids.view(1, 4, 1, 3), nb=10, reads=3), pos)


@pytest.mark.parametrize("nb,top_k,width", [(30, 4, 4), (30, 4, 6), (3, 4, 4), (1, 2, 3), (9, 1, 2)])
def test_compiled_stingy_positions_equal_the_tensor_expression(nb, top_k, width):
    g = torch.Generator().manual_seed(nb * 10 + width)
    rows = [torch.randperm(max(nb, width), generator=g)[:width] for _ in range(60)]  # distinct ids per row
    ids = torch.stack(rows).view(3, 4, 5, width)
    ids = torch.where((ids >= nb) | (torch.rand(ids.shape, generator=g) < 0.25), -1, ids)  # empty slots
    assert torch.equal(block_positions(ids, nb, top_k, 7, "stingy"), stingy_slots(ids, nb, top_k) * 7)


@pytest.mark.parametrize("nb,top_k,m", [(40, 4, 4), (40, 4, 0), (6, 4, 2), (3, 4, 0), (20, 2, 5)])
def test_compiled_stingy_top_k_equals_select_blocks_then_block_positions(nb, top_k, m):
    g = torch.Generator().manual_seed(nb + m)
    B, H, T_q = 2, 3, 5
    recent = torch.arange(max(0, nb - top_k), nb)
    S_recent = torch.randn(B, H, T_q, len(recent), generator=g)
    I_old = torch.stack([torch.randperm(max(1, nb - top_k), generator=g)[:m] for _ in range(B * H * T_q)])
    I_old = I_old.view(B, H, T_q, m) if m <= nb - top_k else torch.full((B, H, T_q, m), -1)
    S_old = torch.randn(B, H, T_q, m, generator=g).masked_fill(I_old < 0, float("-inf"))
    S_old[0, 0, 0], I_old[0, 0, 0] = float("-inf"), -1  # a query the index found nothing for
    ids, pos = top_k_stingy(S_old.numpy(), I_old.numpy(), S_recent, recent, nb, top_k, 7)
    S, I = torch.cat([S_old, S_recent], -1), torch.cat([I_old, recent.expand(B, H, T_q, -1)], -1)
    ref = select_blocks(S, I, 0, nb, top_k, "per_token_head")
    assert torch.equal(ids, ref)
    assert torch.equal(pos, stingy_slots(ref, nb, top_k) * 7)


def test_greedy_generation_with_memory_equals_full_recompute(model, text):
    prompt = text[:1, :27]
    mem = retrieve_all(model, chunk_size=10)
    new = mem.generate(prompt, 12)
    ref = model.generate(prompt, 12, temperature=0)[:, 27:]
    assert torch.equal(new, ref)


def test_bad_arguments_are_explained(model, text):
    with pytest.raises(ValueError, match="multiple of the model's block_size"):
        LandmarkMemory(model, chunk_size=12)
    with pytest.raises(ValueError, match="retrieval"):
        LandmarkMemory(model, retrieval="per_layer")
    with pytest.raises(ValueError, match="unknown index kind"):
        LandmarkMemory(model, index="annoy")
    with pytest.raises(ValueError, match="pass a path"):
        LandmarkMemory(model, store="lmdb")
    with pytest.raises(ValueError, match="unknown backend"):
        LandmarkMemory(model, backend="cuda-magic")
    full = LandmarkGPT(LandmarkConfig(**{**model.config.to_dict(), "attention": "full"}))
    with pytest.raises(ValueError, match="landmark attention; this LandmarkGPT has attention='full'"):
        LandmarkMemory(full)
    mem = LandmarkMemory(model, chunk_size=10)
    mem.forward(text[:, :5])
    with pytest.raises(ValueError, match="batch size"):
        mem.forward(text[:1, :5])
    with pytest.raises(ValueError, match="integer token ids"):
        mem.forward(torch.randn(2, 3))


def test_memory_usage_counts_fast_and_store_bytes(model, text):
    mem = LandmarkMemory(model, top_k=2, chunk_size=10)
    empty = mem.inspection.usage()
    assert (empty.fast, empty.store) == (0, 0)
    mem.forward(text[:, :25])  # 2 chunks in memory (4 blocks per stream), 5 tokens pending
    assert (mem.n_tokens, mem.n_blocks, mem.pending_count) == (25, 4, 5)
    usage = mem.inspection.usage()
    cfg = model.config
    assert usage.store == 2 * 4 * cfg.n_layer * 2 * cfg.n_head * 6 * cfg.head_dim * 4  # streams, blocks, layers, k/v
    assert usage.fast > 2 * 4 * cfg.n_layer * cfg.n_head * cfg.head_dim * 4  # at least the landmark keys


def test_perplexity_through_memory_is_the_same_fed_in_pieces(model, text, monkeypatch):
    from landmark_memory.jobs import evaluate

    ids = text[0].tolist() if text.dim() == 2 else text.tolist()
    opts = MemoryOptions(chunk_size=model.config.block_size * 2, top_k=2)
    whole = evaluate.perplexity(model, ids, len(ids) - 1, memory=opts, keep_retrieved=True, progress=False)
    monkeypatch.setattr(evaluate, "PIECE", 7)
    pieces = evaluate.perplexity(model, ids, len(ids) - 1, memory=opts, keep_retrieved=True, progress=False)
    assert pieces["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-5)
    for a, b in zip(pieces["retrieved"][0], whole["retrieved"][0]):
        assert torch.equal(a, b)


def test_default_chunk_is_the_block_multiple_nearest_250(model):
    from landmark_memory.format import default_chunk_size

    assert LandmarkMemory(model).options.chunk_size == 250  # blocks of 5
    assert [default_chunk_size(b) for b in (50, 63, 7, 300)] == [250, 252, 252, 300]


def test_a_closed_memory_is_freed_without_the_cycle_collector(model, text):
    import gc
    import weakref

    mem = LandmarkMemory(model, chunk_size=20)
    mem(text)
    mem.close()
    ref = weakref.ref(mem)
    gc.disable()  # many large memories in a row (the passkey test) must not wait for a collection
    try:
        del mem
        assert ref() is None
    finally:
        gc.enable()
