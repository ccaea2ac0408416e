"""Sink and local blocks (read by every query besides its top-k) and centred landmark scores."""

import numpy as np
import pytest
import torch

from landmark_memory.memory import LandmarkMemory
from landmark_memory.memory.key_sums import KeySums
from landmark_memory.memory.retrieval import block_positions, select_blocks, top_k_stingy, with_forced, with_pinned


@pytest.fixture(scope="module")
def text():
    return torch.randint(4, 64, (2, 73), generator=torch.Generator().manual_seed(1))  # 14 blocks


def reads(mem):
    """Every (layer, step) choice of the memory inside ``mem.inspection.choosing(wrap)``: the ids (B, H, T_q,
    reads') each query reads and how many of their first columns it chose (those before the
    reads - top_k forced); returns (that list, wrap)."""
    got, forced = [], mem.options.reads - mem.options.top_k

    def wrap(choose):
        def recording(*args, **kwargs):
            ids, pos = choose(*args, **kwargs)
            got.append((ids.clone(), ids.shape[-1] - forced))
            return ids, pos
        return recording

    return got, wrap


@pytest.mark.parametrize("sink,local,centre", [(1, 0, False), (0, 3, False), (2, 2, True), (0, 0, True)])
def test_retrieve_all_with_sink_local_blocks_or_centring_equals_in_sequence_forward(model, text, sink, local, centre):
    with torch.no_grad():
        full = model(text)
    mem = LandmarkMemory(model, top_k=14 - sink - local, sink_blocks=sink, local_blocks=local, centre=centre,
                         position_mapping="exact", chunk_size=10)
    torch.testing.assert_close(mem.forward(text).logits, full, rtol=1e-5, atol=1e-5)


def test_a_top_k_over_the_memorys_size_reads_the_blocks_there_are_and_stays_exact(model, text):
    with torch.no_grad():
        full = model(text)
    mem = LandmarkMemory(model, top_k=1000, position_mapping="exact", chunk_size=10)
    widths, pool = [], mem._blocks.pool  # (a peek inside: the kernels' tables)
    mem._blocks.pool = lambda layer, ids: (widths.append((ids.shape[-1], mem.n_blocks)), pool(layer, ids))[1]
    out = mem.forward(text)
    torch.testing.assert_close(out.logits, full, rtol=1e-5, atol=1e-5)
    assert all(width <= nb for width, nb in widths)  # the kernels' tables: a column per block at most
    assert [r.shape for r in out.retrieved] == [(2, 2, 73, 1000)] * 2  # what a forward reports keeps its shape
    assert mem.forward(text[:, :20], retrieved=False).retrieved == []  # (an evaluation need not hold them)


@pytest.mark.parametrize("mapping", ["stingy", "exact"])
@pytest.mark.parametrize("retrieval", ["per_token_head", "per_head"])
def test_sink_and_local_blocks_are_read_by_every_query_and_never_chosen(model, text, mapping, retrieval):
    mem = LandmarkMemory(model, top_k=2, sink_blocks=1, local_blocks=2, chunk_size=10, position_mapping=mapping,
                         retrieval=retrieval)
    tables, wrap = reads(mem)
    with mem.inspection.choosing(wrap):
        out = mem.forward(text)
    for ids, k in tables:
        nb = int(ids.max()) + 1 if (ids >= 0).any() else 0
        chosen, forced = ids[..., :k], ids[..., k:]
        assert 0 <= k <= 2  # no more chosen columns than top_k or candidates, then the 3 forced ones
        if nb:  # chunk c sees 2c blocks: block 0 and the last two are read by every query, once
            want = sorted({0, *range(max(0, nb - 2), nb)})
            assert (forced[..., :len(want)] == torch.tensor(want)).all() and (forced[..., len(want):] == -1).all()
            assert not torch.isin(chosen, torch.tensor(want)).any()
            assert ((chosen >= 0).sum(-1) == min(2, nb - len(want))).all()
    for ids in out.retrieved:  # what a forward reports is what the queries chose
        assert ids.shape == (2, 2, 73, 2)


@pytest.mark.parametrize("nb,top_k,m,forced", [(40, 4, 4, [0, 38, 39]), (40, 4, 0, [0]), (6, 2, 2, [0, 5]),
                                               (20, 2, 5, [0, 1])])
def test_compiled_stingy_top_k_with_forced_blocks_equals_select_then_append_then_positions(nb, top_k, m, forced):
    g = torch.Generator().manual_seed(nb + m)
    B, H, T_q = 2, 3, 5
    forced = torch.tensor(forced)
    W = top_k + len(forced) + 1  # a window wider than what is read leaves -1 at the end
    candidates = torch.tensor([b for b in range(nb) if b not in forced.tolist()])
    recent = candidates[candidates >= nb - W]
    old = candidates[candidates < nb - W]
    S_recent = torch.randn(B, H, T_q, len(recent), generator=g)
    I_old = torch.stack([old[torch.randperm(len(old), generator=g)[:m]] for _ in range(B * H * T_q)])
    I_old = I_old.view(B, H, T_q, -1)
    S_old = torch.randn(I_old.shape, generator=g)
    ids, pos = top_k_stingy(S_old.numpy(), I_old.numpy(), S_recent, recent, nb, top_k, 7, forced.numpy(), W)
    S, I = torch.cat([S_old, S_recent], -1), torch.cat([I_old, recent.expand(B, H, T_q, -1)], -1)
    ref = with_forced(select_blocks(S, I, 0, nb, top_k, "per_token_head"), forced, W)
    assert torch.equal(ids, ref)
    assert torch.equal(pos, block_positions(ref, nb, W, 7, "stingy"))


@pytest.mark.parametrize("nb,top_k,m,pinned", [(40, 4, 4, [3, 20]), (40, 4, 6, [36, 2, 11, 30]), (6, 2, 2, [1]),
                                               (20, 3, 5, [])])
def test_compiled_stingy_top_k_with_pinned_blocks_equals_pinned_then_the_best_others(nb, top_k, m, pinned):
    g = torch.Generator().manual_seed(nb + m + len(pinned))
    B, H, T_q = 2, 3, 5
    forced, pinned = torch.tensor([0]), torch.tensor(pinned, dtype=torch.long)
    W = top_k + 2
    candidates = torch.arange(1, nb)
    recent = candidates[candidates >= nb - W]
    old = candidates[candidates < nb - W]
    S_recent = torch.randn(B, H, T_q, len(recent), generator=g)
    I_old = torch.stack([old[torch.randperm(len(old), generator=g)[:m]] for _ in range(B * H * T_q)]).view(B, H, T_q,
                                                                                                           -1)
    I_old[0, 0, 0, 0] = pinned[0] if len(pinned) else I_old[0, 0, 0, 0]  # a pinned block among the index's results
    S_old = torch.randn(I_old.shape, generator=g)
    S_old[0, 0, 0, 0] = 99.0  # the best score of all: still not chosen twice
    ids, pos = top_k_stingy(S_old.numpy(), I_old.numpy(), S_recent, recent, nb, top_k, 7, forced.numpy(), W,
                            pinned.numpy())
    S, I = torch.cat([S_old, S_recent], -1), torch.cat([I_old, recent.expand(B, H, T_q, -1)], -1)
    S = S.masked_fill(torch.isin(I, pinned), float("-inf"))
    ref = with_forced(with_pinned(select_blocks(S, I, 0, nb, top_k - len(pinned), "per_token_head"), pinned), forced, W)
    assert torch.equal(ids, ref)
    assert torch.equal(pos, block_positions(ref, nb, W, 7, "stingy"))
    for row in ids.view(-1, W).tolist():  # each block once
        assert len([b for b in row if b >= 0]) == len({b for b in row if b >= 0})


@pytest.mark.parametrize("mapping", ["stingy", "exact"])
@pytest.mark.parametrize("retrieval", ["per_token_head", "per_head"])
def test_pinned_blocks_are_read_first_by_every_query_and_the_rest_chosen_among_the_others(model, text, mapping,
                                                                                           retrieval):
    mem = LandmarkMemory(model, top_k=3, sink_blocks=1, chunk_size=10, position_mapping=mapping, retrieval=retrieval)
    mem.forward(text[:, :60])  # 12 blocks in memory
    tables, wrap = reads(mem)
    with mem.reading([7, 2]), mem.inspection.choosing(wrap):
        out = mem.forward(text[:, 60:])
    for ids, k in tables:
        assert k == 3 and (ids[..., :2] == torch.tensor([7, 2])).all() and (ids[..., 3] == 0).all()
        assert not torch.isin(ids[..., 2], torch.tensor([7, 2, 0])).any()
    for ids in out.retrieved:  # a forward reports the pinned blocks among what its queries read
        assert (ids[..., :2] == torch.tensor([7, 2])).all()
    tables.clear()
    with mem.inspection.choosing(wrap):
        mem.forward(text[:, :5])  # outside the reading block: the queries choose freely again
    assert any(not (ids[..., :2] == torch.tensor([7, 2])).all() for ids, _ in tables)


@pytest.mark.parametrize("blocks", [[1, 2, 3, 4], [2, 2], [12], [-1]])
def test_reading_refuses_more_blocks_than_top_k_repeated_ones_or_blocks_outside_the_memory(model, text, blocks):
    mem = LandmarkMemory(model, top_k=3, chunk_size=10)
    mem.forward(text[:, :60])
    with pytest.raises(ValueError, match="at most top_k=3 distinct blocks of the memory's 12"):
        with mem.reading(blocks):
            pass


def test_centred_choice_is_the_top_k_of_scores_against_keys_less_their_mean(model, text):
    """The slow reference: every candidate scored where stingy scores it (older blocks at slot
    0, the latest at their own slots) against its landmark key less the mean key, top-k."""
    mem = LandmarkMemory(model, top_k=3, chunk_size=10, centre=True)
    calls = []

    def wrap(choose):
        def recording(layer, q, qr, at_search, skip=None):
            ids, pos = choose(layer, q, qr, at_search, skip)
            calls.append((layer, q, qr, at_search, ids, mem.n_blocks))
            return ids, pos
        return recording

    with mem.inspection.choosing(wrap):
        mem.forward(text[:, :60])
        mem.forward(text[:, 60:])  # the last chunk: 12 blocks in memory, 9 of them searched at slot 0
    layer, q, qr, at_search, ids, nb = calls[-1]
    L, W, rope = mem.shape.rows, 3, mem.backbone.rope
    keys = torch.stack([mem.keys(layer, slice(0, nb), stream=b) for b in range(mem.streams)])  # (B, H, nb, D)
    keys = keys - keys.mean(2, keepdim=True)
    blocks = torch.arange(nb)
    old, recent = blocks < nb - W, blocks >= nb - W
    S = torch.empty(*q.shape[:3], nb)
    S[..., old] = rope.rotate(at_search, q) @ keys[:, :, old].transpose(-2, -1)
    slots = W + 1 - (nb - blocks[recent])
    S[..., recent] = qr @ rope(keys[:, :, recent], slots * L + 5).transpose(-2, -1)
    want = S.topk(3, -1).indices.sort(-1).values
    assert torch.equal(ids.sort(-1).values, want)
    plain = LandmarkMemory(model, top_k=3, chunk_size=10)
    plain.forward(text[:, :60])
    got_plain = plain.forward(text[:, 60:]).retrieved[layer]
    assert not torch.equal(got_plain.sort(-1).values, ids[:, :, -got_plain.shape[2]:].sort(-1).values)


def test_bad_sink_local_and_centre_options_are_explained(model):
    for kw, msg in [({"sink_blocks": -1}, "sink_blocks"), ({"local_blocks": 1.5}, "local_blocks"),
                    ({"centre": "yes"}, "centre")]:
        with pytest.raises(ValueError, match=msg):
            LandmarkMemory(model, **kw)


def test_key_sums_give_the_mean_of_the_keys_of_any_run_of_blocks_as_they_move():
    rows = np.random.default_rng(0).standard_normal((2, 3, 40, 4)).astype(np.float32)  # (B, H_kv, blocks, D)
    read = []

    def rows_of(layer, first, last):
        read.append(last - first)
        return rows[:, :, first:last] + layer

    sums = KeySums(2)
    for lo, hi in [(0, 5), (0, 17), (3, 17), (9, 40), (2, 30), (0, 1), (12, 13)]:  # forward, back, both
        for layer in range(2):
            np.testing.assert_allclose(sums.mean(layer, lo, hi, rows_of), rows[:, :, lo:hi].mean(2) + layer, rtol=0,
                                       atol=1e-6)
    saved = sums.state(30, rows_of)
    assert set(saved) == {"landmark_sum.0", "landmark_sum.1"}
    fresh = KeySums(2)
    fresh.load(30, saved, (2, 3, 4))
    read.clear()
    np.testing.assert_allclose(fresh.mean(1, 0, 32, rows_of), rows[:, :, :32].mean(2) + 1, rtol=0, atol=1e-6)
    assert read == [2]  # from the saved sums: only the blocks past them are read
    fresh.mean(1, 0, 40, rows_of)
    fresh.reset()  # (a rewind) back to the saved sums
    read.clear()
    fresh.mean(0, 0, 30, rows_of)
    assert read == []
    with pytest.raises(ValueError, match="landmark_sum.0"):
        fresh.load(30, {**saved, "landmark_sum.0": saved["landmark_sum.0"][:1]}, (2, 3, 4))


def test_a_saved_memory_centres_from_its_committed_sums_as_from_every_key(model, text, tmp_path):
    with LandmarkMemory(model, path=tmp_path / "m", store="lmdb", chunk_size=10) as mem:
        mem.forward(text[:, :60], logits="none")
    outs, reads = [], []
    for seeded in (True, False):
        with LandmarkMemory.open(tmp_path / "m", model, readonly=True, centre=True, top_k=3) as mem:
            if not seeded:  # as a memory saved before the sums were kept: every key file is read
                mem._blocks.sums.load(mem.n_blocks, {}, None)  # (peeks inside: which key rows are read)
            rows = mem._blocks._key_run
            mem._blocks._key_run = lambda layer, first, last: reads.append((seeded, first, last)) or \
                rows(layer, first, last)
            outs.append(mem.forward(text[:, 60:]))
    assert all(first >= 10 for seeded, first, _ in reads if seeded)  # past the 10 saved blocks only
    assert any(first == 0 for seeded, first, _ in reads if not seeded)
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].retrieved, outs[1].retrieved))


def test_querying_changes_query_options_inside_its_block_only(model, text):
    mem = LandmarkMemory(model, top_k=2, chunk_size=10)
    with pytest.raises(RuntimeError):
        with mem.querying(centre=True, sink_blocks=1):
            assert mem.options.centre and mem.options.sink_blocks == 1 and mem.options.reads == 3
            raise RuntimeError("the block fails")
    assert not mem.options.centre and mem.options.sink_blocks == 0
    with pytest.raises(ValueError, match="nprobe"):
        with mem.querying(nprobe=4):
            pass
    with pytest.raises(ValueError, match="top_k"):
        with mem.querying(top_k=0):
            pass
