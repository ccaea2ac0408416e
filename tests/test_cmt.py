"""Context Miss Token (paper appendix D) and positional jumps (appendix E): the grouped softmax
of equations 5-6 against a brute-force oracle, every fast path against the reference, the
retrieval cutoff in the memory, and the jumped training positions."""

import math

import pytest
import torch
from kernel_cases import TOL, all_blocks_table, memory_setup

from landmark_memory import LandmarkConfig, LandmarkGPT, LandmarkMemory
from landmark_memory.kernels import (
    cmt_share,
    dense,
    landmark_attention,
    landmark_attention_inference,
    landmark_weights,
    triton_landmark,
)
from landmark_memory.models.model import jump_positions


def oracle_weights(q, k, cmt_k, block_size, controlled):
    """Equations 5-6 for one head, one query at a time, written as the paper states them.

    q, k (T, D); cmt_k (D,); controlled: set of CMT-controlled landmark positions."""
    T, L = q.shape[0], block_size + 1
    scale = q.shape[1] ** -0.5
    p = [(j // L) * L + block_size if (j // L) * L + block_size < T else T for j in range(T)]  # p_j
    W = torch.zeros(T, T, dtype=q.dtype)
    for i in range(T):
        s = {j: float(q[i] @ k[j]) * scale for j in range(i + 1)}
        s[-1] = float(q[i] @ cmt_k) * scale
        G = {-1: p[i]}  # the CMT joins the query's group
        for j in range(i + 1):
            if p[j] != j:
                G[j] = p[j]  # normal tokens: their own block
            elif p[i] != j:
                G[j] = "ctrl" if j in controlled else p[i]  # landmarks: controlled apart, free with the query
        z = {}
        for j, g in G.items():
            z[g] = z.get(g, 0.0) + math.exp(s[j])
        S = {j: math.exp(s[j]) / z[g] for j, g in G.items()}
        for j, g in G.items():
            if j == -1 or p[j] == j:
                continue  # the CMT and landmarks carry no value
            if g == p[i]:
                W[i, j] = S[j]
            elif p[j] in controlled:
                W[i, j] = S[j] * S[p[j]] * S[-1]
            else:
                W[i, j] = S[j] * S[p[j]]
    return W


def random_cmt(B, H, T, D, block_size, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))
    cmt_k = torch.randn(B, H, 1, D, generator=g, dtype=dtype)
    blocks = torch.rand(B, T // (block_size + 1), generator=g) < 0.5
    return q, k, v, cmt_k, blocks


@pytest.mark.parametrize("block_size,T", [(3, 17), (4, 20), (2, 9)])
def test_cmt_weights_equal_the_brute_force_oracle_of_equations_5_6(block_size, T):
    q, k, _, cmt_k, blocks = random_cmt(1, 1, T, 8, block_size, seed=T)
    W = landmark_weights(q, k, block_size, cmt_k=cmt_k, cmt_blocks=blocks)[0, 0]
    L = block_size + 1
    controlled = {c * L + block_size for c in range(blocks.shape[1]) if blocks[0, c]}
    torch.testing.assert_close(W, oracle_weights(q[0, 0], k[0, 0], cmt_k[0, 0, 0], block_size, controlled))


def test_cmt_weights_sum_to_one_once_a_controlled_landmark_is_visible():
    bs, T = 3, 24
    q, k, _, cmt_k, _ = random_cmt(2, 2, T, 8, bs, seed=1)
    blocks = torch.tensor([[True, False, True, False, False, True], [False, True, False, False, False, False]])
    W = landmark_weights(q, k, bs, cmt_k=cmt_k, cmt_blocks=blocks)
    i = torch.arange(T)
    seen = torch.stack([(blocks[b][None, :] & (torch.arange(6)[None, :] < (i // 4)[:, None])).any(-1)
                        for b in range(2)])  # (B, T): a controlled landmark precedes query i's block
    sums = W.sum(-1)  # (B, H, T)
    torch.testing.assert_close(sums[seen[:, None].expand_as(sums)], torch.ones(int(seen.sum()) * 2, dtype=W.dtype))
    assert (sums[~seen[:, None].expand_as(sums)] < 1).all()


def test_empty_cmt_set_recovers_plain_attention_up_to_the_cmt_share():
    bs, T = 4, 23
    q, k, _, cmt_k, _ = random_cmt(2, 3, T, 8, bs, seed=2)
    none = torch.zeros(2, T // (bs + 1), dtype=torch.bool)
    W = landmark_weights(q, k, bs, cmt_k=cmt_k, cmt_blocks=none)
    plain = landmark_weights(q, k, bs)
    share = 1 - W.sum(-1, keepdim=True)  # the CMT's own share of the query's group, lost
    assert (share > 0).all() and (share < 1).all()
    torch.testing.assert_close(W, plain * (1 - share))


@pytest.mark.parametrize("query_tile", [512, 6])
@pytest.mark.parametrize("block_size,T", [(3, 17), (50, 130), (7, 40)])
def test_dense_cmt_attention_equals_reference_with_gradients(block_size, T, query_tile, monkeypatch):
    monkeypatch.setattr(dense, "QUERY_TILE", query_tile)
    q, k, v, cmt_k, blocks = random_cmt(2, 2, T, 16, block_size, seed=block_size)
    leaves = [t.requires_grad_() for t in (q, k, v, cmt_k)]
    ref = landmark_attention(q, k, v, block_size, cmt_k=cmt_k, cmt_blocks=blocks, backend="reference")
    out = landmark_attention(q, k, v, block_size, cmt_k=cmt_k, cmt_blocks=blocks, backend="dense")
    torch.testing.assert_close(out, ref)
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, do), torch.autograd.grad(ref, leaves, do)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("block_size,T,poison", [(3, 41, True), (50, 130, False)])
def test_triton_cmt_attention_equals_reference_with_gradients(block_size, T, poison, monkeypatch):
    if poison:  # every element of every output the kernels fill is written
        monkeypatch.setattr(triton_landmark, "_empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
    q, k, v, cmt_k, blocks = random_cmt(2, 2, T, 32, block_size, seed=block_size, dtype=torch.float32)
    do = torch.randn_like(q)

    def run(backend, dtype):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v, cmt_k)]
        out = landmark_attention(*x[:3], block_size, cmt_k=x[3], cmt_blocks=blocks, backend=backend)
        return [out, *torch.autograd.grad(out, x, do.to(dtype))]

    for got, ref in zip(run("triton", torch.float32), run("reference", torch.float64)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, **TOL[torch.float32])


def test_cmt_arguments_are_checked():
    q, k, v, cmt_k, blocks = random_cmt(1, 2, 12, 8, 3, seed=3)
    with pytest.raises(ValueError, match="go together"):
        landmark_attention(q, k, v, 3, cmt_k=cmt_k)
    with pytest.raises(ValueError, match="cmt_blocks must be a bool tensor"):
        landmark_attention(q, k, v, 3, cmt_k=cmt_k, cmt_blocks=blocks[:, :1])
    with pytest.raises(ValueError, match="cmt_k must be"):
        landmark_attention(q, k, v, 3, cmt_k=cmt_k[:, :1], cmt_blocks=blocks)


# ---- inference: memory blocks are the CMT-controlled ones ---------------------------------
@pytest.mark.parametrize("backend", ["reference", "dense", "triton", "numba"])
@pytest.mark.parametrize("block_size,n_mem,Tk,T_q", [(3, 5, 9, 9), (3, 5, 9, 1), (50, 3, 130, 47)])
def test_retrieving_every_block_with_cmt_equals_in_sequence_attention_with_memory_blocks_controlled(
        backend, block_size, n_mem, Tk, T_q):
    B, H, D = 2, 2, 32
    dtype = torch.float32 if backend == "triton" else torch.float64
    m = memory_setup(B, H, D, block_size, n_mem, Tk, dtype)
    cmt_k = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(5), dtype=dtype)
    n_lm = m["T"] // (block_size + 1)
    blocks = (torch.arange(n_lm) < n_mem).expand(B, n_lm)  # memory blocks controlled, local ones free
    full = landmark_attention(m["q"], m["k"], m["v"], block_size, cmt_k=cmt_k, cmt_blocks=blocks)[:, :, m["T"] - T_q:]
    table, pos = all_blocks_table(B, H, T_q, n_mem, block_size, perm=torch.randperm(n_mem))
    out = landmark_attention_inference(m["q"][:, :, m["T"] - T_q:], m["k"][:, :, m["local"]:],
                                       m["v"][:, :, m["local"]:],
                                       block_size, pool_k=m["pool_k"], pool_v=m["pool_v"], block_table=table,
                                       block_pos=pos, cmt_k=cmt_k, backend=backend)
    torch.testing.assert_close(out, full, **(TOL[torch.float32] if backend == "triton" else {}))


@pytest.mark.parametrize("backend,dtype", [("triton", torch.float32), ("triton", torch.bfloat16),
                                           ("dense", torch.float32), ("numba", torch.float32)])
@pytest.mark.parametrize("n_pool", [0, 9])
def test_fast_cmt_inference_matches_reference_on_random_retrieval(backend, dtype, n_pool):
    g = torch.Generator().manual_seed(n_pool + 1)
    B, H, K, D, bs, T_q, Tk = 2, 2, 4, 32, 7, 5, 30
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (T_q, Tk, Tk))
    cmt_k = torch.randn(B, H, 1, D, generator=g).to(dtype)
    pool_k, pool_v = (torch.randn(n_pool, H, bs + 1, D, generator=g).to(dtype) for _ in range(2))
    table = torch.randint(-1, max(n_pool, 1), (B, H, T_q, K), generator=g) if n_pool else torch.full((B, H, T_q, K), -1)
    table[0, 0, 0] = -1  # one query with every slot empty: its CMT share is lost
    pos = torch.randint(0, 100_000, (B, H, T_q, K), generator=g)
    args = dict(pool_k=pool_k, pool_v=pool_v, block_table=table, block_pos=pos)
    out = landmark_attention_inference(q, k, v, bs, cmt_k=cmt_k, backend=backend, **args)
    ref = landmark_attention_inference(*(t.double() for t in (q, k, v)), bs, cmt_k=cmt_k.double(), backend="reference",
                                       **{**args, "pool_k": pool_k.double(), "pool_v": pool_v.double()})
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def test_cmt_share_is_what_a_query_gives_up_without_controlled_blocks():
    bs, T = 4, 23
    q, k, _, cmt_k, _ = random_cmt(2, 2, T, 8, bs, seed=7)
    none = torch.zeros(2, T // (bs + 1), dtype=torch.bool)
    lost = 1 - landmark_weights(q, k, bs, cmt_k=cmt_k, cmt_blocks=none).sum(-1)  # (B, H, T)
    torch.testing.assert_close(cmt_share(q[:, :, 10:], k, bs, cmt_k).double(), lost[:, :, 10:], rtol=1e-5, atol=1e-6)


# ---- models and the memory ----------------------------------------------------------------
def cmt_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LandmarkConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=4, cmt=True, **kw)
    return LandmarkGPT(cfg).eval()


def test_cmt_model_trains_the_same_with_the_triton_kernel():
    torch.manual_seed(0)
    ref, tri = cmt_model(kernel_backend="reference").train(), cmt_model(kernel_backend="triton").train()
    tri.load_state_dict(ref.state_dict())
    x = torch.randint(2, 64, (2, 40))
    torch.manual_seed(1)
    _, a = ref(x, x)
    torch.manual_seed(1)  # the same controlled landmarks
    _, b = tri(x, x)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri.cmt.grad, ref.cmt.grad, rtol=1e-3, atol=1e-6)


def test_cmt_model_trains_its_token_and_reads_in_sequence_with_no_controlled_landmark():
    model = cmt_model().train()
    x = torch.randint(2, 64, (2, 30))
    _, loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss) and model.cmt.grad.abs().sum() > 0
    model.eval()
    keys = model.cmt_keys()
    assert len(keys) == 2 and keys[0].shape == (1, 2, 1, 16)
    torch.testing.assert_close(model(x), model(x))  # no random controlled set outside training


def test_config_refuses_bad_cmt_and_jump_settings():
    with pytest.raises(ValueError, match="landmark attention only"):
        LandmarkConfig(attention="full", cmt=True)
    with pytest.raises(ValueError, match="p_cmt"):
        LandmarkConfig(cmt=True, p_cmt=1.5)
    with pytest.raises(ValueError, match="p_jump"):
        LandmarkConfig(p_jump=0)


def feed(model, cutoff, retrieval="per_token_head", **kw):
    mem = LandmarkMemory(model, chunk_size=8, top_k=2, retrieval=retrieval, cmt_cutoff=cutoff, **kw)
    out = mem(torch.randint(2, 64, (2, 96), generator=torch.Generator().manual_seed(1)))
    return mem, out


@pytest.mark.parametrize("retrieval", ["per_token_head", "per_head", "per_token"])
def test_cutoff_zero_changes_nothing_versus_always_retrieving(retrieval):
    model = cmt_model()
    _, always = feed(model, 0.0, retrieval)
    mem, tiny = feed(model, 1e-30, retrieval)  # the cutoff path runs, and drops no query
    assert mem.retrieval_stats.skipped_queries == 0 and mem.retrieval_stats.searches > 0
    torch.testing.assert_close(tiny.logits, always.logits, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(tiny.retrieved, always.retrieved))


def test_queries_below_the_cutoff_retrieve_nothing_and_others_still_retrieve():
    mem, out = feed(cmt_model(), 0.5)
    s = mem.retrieval_stats
    assert 0 < s.skipped_queries < s.queries
    got = torch.stack([(r >= 0).any(-1) for r in out.retrieved])  # (layers, B, H, T)
    assert got.any() and not got.all()


def test_a_step_whose_queries_are_all_below_the_cutoff_searches_no_index():
    model = cmt_model()
    mem, out = feed(model, 1.0)  # every share is below 1
    ixs = mem.inspection.indexes()
    assert sum(ix.searches for ix in ixs) == 0 and mem.retrieval_stats.searches == 0
    assert mem.retrieval_stats.skipped_searches > 0
    assert mem.retrieval_stats.skipped_queries == mem.retrieval_stats.queries
    assert all((r < 0).all() for r in out.retrieved)
    assert mem.inspection.cache().hits + mem.inspection.cache().misses == 0  # no block fetched
    ref, _ = feed(model, 0.0)
    assert sum(ix.searches for ix in ref.inspection.indexes()) > 0


def test_cmt_cutoff_needs_a_cmt_model_and_a_probability():
    torch.manual_seed(0)
    plain = LandmarkGPT(LandmarkConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, ffn_hidden=64, block_size=4))
    with pytest.raises(ValueError, match="Context Miss Token"):
        LandmarkMemory(plain, chunk_size=8, cmt_cutoff=0.3)
    with pytest.raises(ValueError, match="cmt_cutoff must be"):
        LandmarkMemory(cmt_model(), chunk_size=8, cmt_cutoff=2.0)


def test_saved_cmt_memory_reopens_with_a_new_cutoff(tmp_path):
    model = cmt_model()
    ids = torch.randint(2, 64, (1, 64), generator=torch.Generator().manual_seed(2))
    with LandmarkMemory(model, store="lmdb", path=tmp_path / "m", chunk_size=8, top_k=2) as mem:
        mem(ids)
    with LandmarkMemory.open(tmp_path / "m", model, readonly=True, cmt_cutoff=1.0) as mem:
        out = mem(ids[:, :8])
        assert mem.options.cmt_cutoff == 1.0 and all((r < 0).all() for r in out.retrieved)


# ---- positional jumps ---------------------------------------------------------------------
def test_jump_positions_advance_by_1_to_p_jump_after_each_landmark_only():
    bs, T, p_jump = 4, 53, 100
    pos = jump_positions(3, T, bs, p_jump, generator=torch.Generator().manual_seed(0))
    step = pos.diff(dim=1)  # (B, T - 1): step into position t + 1
    after = torch.arange(1, T) % (bs + 1) == 0  # position t + 1 follows a landmark
    assert (pos[:, 0] == 0).all()
    assert (step[:, ~after] == 1).all()
    assert ((step[:, after] >= 1) & (step[:, after] <= p_jump)).all() and (step[:, after] > 1).any()
    assert torch.equal(pos, jump_positions(3, T, bs, p_jump, generator=torch.Generator().manual_seed(0)))
    assert not torch.equal(pos, jump_positions(3, T, bs, p_jump, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(jump_positions(2, T, bs, 1), torch.arange(T).expand(2, T))


def test_jumps_apply_in_training_only_and_are_reproducible_with_a_seed():
    torch.manual_seed(0)
    model = LandmarkGPT(LandmarkConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, ffn_hidden=64, block_size=4,
                                       p_jump=50))
    x = torch.randint(2, 64, (2, 40))
    model.train()
    torch.manual_seed(3)
    a = model(x)
    torch.manual_seed(3)
    b = model(x)
    torch.manual_seed(4)
    c = model(x)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)
    model.eval()
    plain = LandmarkGPT(LandmarkConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, ffn_hidden=64, block_size=4))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), plain.eval()(x))
