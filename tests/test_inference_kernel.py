"""The inference entry point (local chunk + retrieved blocks): Triton vs reference, and both vs
in-sequence attention over the whole text when every earlier block is retrieved."""

import pytest
import torch
from kernel_cases import TOL, all_blocks_table, memory_setup

from landmark_memory.kernels import landmark_attention, landmark_attention_inference


@pytest.mark.parametrize("backend", ["reference", "dense", "triton", "numba", "auto"])
@pytest.mark.parametrize("block_size,n_mem,Tk,T_q", [(3, 5, 9, 9), (3, 5, 9, 1), (50, 3, 130, 47), (7, 4, 16, 16)])
def test_retrieving_every_earlier_block_equals_in_sequence_attention(backend, block_size, n_mem, Tk, T_q):
    B, H, D = 2, 2, 32
    dtype = torch.float32 if backend == "triton" else torch.float64
    m = memory_setup(B, H, D, block_size, n_mem, Tk, dtype)
    full = landmark_attention(m["q"], m["k"], m["v"], block_size)[:, :, m["T"] - T_q:]
    table, pos = all_blocks_table(B, H, T_q, n_mem, block_size, perm=torch.randperm(n_mem))  # order is irrelevant
    out = landmark_attention_inference(m["q"][:, :, m["T"] - T_q:], m["k"][:, :, m["local"]:],
                                       m["v"][:, :, m["local"]:],
                                       block_size, pool_k=m["pool_k"], pool_v=m["pool_v"], block_table=table,
                                       block_pos=pos, backend=backend)
    torch.testing.assert_close(out, full, **(TOL[torch.float32] if backend == "triton" else {}))


@pytest.mark.parametrize("backend,dtype", [("triton", torch.float32), ("triton", torch.bfloat16),
                                           ("dense", torch.float32), ("numba", torch.float32),
                                           ("auto", torch.float32)])
@pytest.mark.parametrize("block_size,Tk,T_q,D", [(50, 110, 24, 64), (50, 37, 1, 32), (7, 30, 5, 64)])
def test_fast_inference_matches_reference_on_random_retrieval(backend, dtype, block_size, Tk, T_q, D):
    g = torch.Generator().manual_seed(block_size + T_q)
    B, H, K, n_pool = 2, 2, 4, 9
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (T_q, Tk, Tk))
    pool_k, pool_v = (torch.randn(n_pool, H, block_size + 1, D, generator=g).to(dtype) for _ in range(2))
    table = torch.randint(-1, n_pool, (B, H, T_q, K), generator=g)  # some slots empty
    pos = torch.randint(0, 100_000, (B, H, T_q, K), generator=g)
    args = dict(pool_k=pool_k, pool_v=pool_v, block_table=table, block_pos=pos)
    out = landmark_attention_inference(q, k, v, block_size, backend=backend, **args)
    ref = landmark_attention_inference(*(t.double() for t in (q, k, v)), block_size, backend="reference",
                                       **{**args, "pool_k": pool_k.double(), "pool_v": pool_v.double()})
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("backend", ["reference", "dense", "triton", "numba"])
def test_grouped_query_pool_equals_pool_repeated_per_query_head(backend):
    g = torch.Generator().manual_seed(11)
    B, H, H_kv, D, bs, T_q, Tk, K, n_pool = 2, 4, 2, 32, 7, 5, 12, 3, 6
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T_q, Tk, Tk))
    pool_k, pool_v = (torch.randn(n_pool, H_kv, bs + 1, D, generator=g) for _ in range(2))
    table = torch.randint(-1, n_pool, (B, H, T_q, K), generator=g)
    pos = torch.randint(0, 1000, (B, H, T_q, K), generator=g)
    out = landmark_attention_inference(q, k, v, bs, pool_k=pool_k, pool_v=pool_v, block_table=table, block_pos=pos,
                                       backend=backend)
    rep = landmark_attention_inference(q, k, v, bs, pool_k=pool_k.repeat_interleave(2, 1),
                                       pool_v=pool_v.repeat_interleave(2, 1), block_table=table, block_pos=pos,
                                       backend="reference")
    torch.testing.assert_close(out, rep, **TOL[torch.float32])


def test_inference_outputs_are_fully_overwritten(monkeypatch):
    from landmark_memory.kernels import triton_inference

    monkeypatch.setattr(triton_inference, "_empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
    m = memory_setup(2, 2, 32, 5, 3, 20, torch.float32, seed=4)
    table, pos = all_blocks_table(2, 2, 7, 3, 5)
    out = landmark_attention_inference(m["q"][:, :, -7:], m["k"][:, :, 18:], m["v"][:, :, 18:], 5, pool_k=m["pool_k"],
                                       pool_v=m["pool_v"], block_table=table, block_pos=pos, backend="triton")
    torch.testing.assert_close(out, landmark_attention(m["q"], m["k"], m["v"], 5)[:, :, -7:], **TOL[torch.float32])


def test_pool_may_be_a_strided_view_of_an_arena():
    m = memory_setup(2, 2, 32, 5, 3, 20, torch.float32, seed=5)
    arena = torch.stack([m["pool_k"], m["pool_v"]], 1)  # (n, 2, H, L, D), as the hot cache keeps it
    table, pos = all_blocks_table(2, 2, 7, 3, 5)
    args = (m["q"][:, :, -7:], m["k"][:, :, 18:], m["v"][:, :, 18:], 5)
    ref = landmark_attention_inference(*args, pool_k=m["pool_k"], pool_v=m["pool_v"], block_table=table, block_pos=pos,
                                       backend="reference")
    for backend in ("dense", "triton", "numba"):
        out = landmark_attention_inference(*args, pool_k=arena[:, 0], pool_v=arena[:, 1], block_table=table,
                                           block_pos=pos, backend=backend)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_empty_table_is_local_attention_only():
    q, k, v = (torch.randn(1, 2, 12, 32) for _ in range(3))
    pool = torch.randn(3, 2, 4, 32)
    for backend in ("reference", "dense", "triton", "numba"):
        empty = torch.full((1, 2, 12, 2), -1)
        out = landmark_attention_inference(q, k, v, 3, pool_k=pool, pool_v=pool, block_table=empty,
                                           block_pos=torch.zeros_like(empty), backend=backend)
        torch.testing.assert_close(out, landmark_attention(q, k, v, 3), rtol=1e-4, atol=2e-5)


def test_pytorch_inference_paths_have_equal_gradients():
    m = memory_setup(1, 2, 16, 3, 2, 6)
    table, pos = all_blocks_table(1, 2, 6, 2, 3)
    grads = []
    for backend in ("reference", "dense"):
        q = m["q"][:, :, -6:].clone().requires_grad_()
        landmark_attention_inference(q, m["k"][:, :, 8:], m["v"][:, :, 8:], 3, pool_k=m["pool_k"], pool_v=m["pool_v"],
                                     block_table=table, block_pos=pos, backend=backend).square().sum().backward()
        grads.append(q.grad)
    assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


def test_auto_decodes_on_the_cpu_with_the_compiled_kernel_and_falls_back_to_dense():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g) for n in (2, 9, 9))
    pool = torch.randn(4, 2, 4, 32, generator=g)
    table, pos = torch.tensor([0, 3, -1])[None, None, None].expand(1, 2, 2, 3), torch.full((1, 2, 2, 3), 8)
    args = dict(pool_k=pool, pool_v=pool, block_table=table, block_pos=pos)
    assert torch.equal(landmark_attention_inference(q, k, v, 3, **args),
                       landmark_attention_inference(q, k, v, 3, backend="numba", **args))
    half = {"pool_k": pool.bfloat16(), "pool_v": pool.bfloat16()}
    assert torch.equal(landmark_attention_inference(q.bfloat16(), k.bfloat16(), v.bfloat16(), 3, **{**args, **half}),
                       landmark_attention_inference(q.bfloat16(), k.bfloat16(), v.bfloat16(), 3, backend="dense",
                                                    **{**args, **half}))
    with pytest.raises(ValueError, match="float32 or float64 CPU tensors"):
        landmark_attention_inference(q.bfloat16(), k.bfloat16(), v.bfloat16(), 3, backend="numba", **{**args, **half})
    with pytest.raises(ValueError, match="without autograd"):
        landmark_attention_inference(q.requires_grad_(), k, v, 3, backend="numba", **args)
    with pytest.raises(ValueError, match="inference only"):
        landmark_attention(q, q, q, 3, backend="numba")


def test_auto_reads_a_chunks_retrieved_blocks_with_compiled_loops_in_float32_only(monkeypatch):
    from landmark_memory.kernels import dense, numba_slots

    calls = []
    monkeypatch.setattr(numba_slots, "retrieved_compiled", lambda *a: calls.append(1) or dense._retrieved(*a))
    m = memory_setup(1, 2, 16, 3, 2, 24, torch.float32)
    table, pos = all_blocks_table(1, 2, 20, 2, 3)  # 20 queries: a chunk, not a decoding step
    args = (m["q"][:, :, -20:], m["k"][:, :, 8:], m["v"][:, :, 8:], 3)
    kw = dict(pool_k=m["pool_k"], pool_v=m["pool_v"], block_table=table, block_pos=pos)
    landmark_attention_inference(*args, **kw)
    assert calls == [1]
    half = {n: t.bfloat16() for n, t in kw.items() if n.startswith("pool")}
    landmark_attention_inference(*(t.bfloat16() for t in args[:3]), 3, **{**kw, **half})  # PyTorch's own
    landmark_attention_inference(*args, backend="dense", **kw)
    assert calls == [1]


@pytest.mark.parametrize("change,match", [
    (dict(pool_k=torch.randn(3, 2, 5, 32)), "pool_k must be"),
    (dict(block_table=torch.zeros(1, 2, 4, 2)), "integer tensor"),
    (dict(block_table=torch.full((1, 2, 4, 2), 3)), "pool indices"),
    (dict(block_pos=torch.zeros(1, 2, 4, 3, dtype=torch.long)), "must match block_table"),
    (dict(k=torch.randn(1, 2, 3, 32), v=torch.randn(1, 2, 3, 32)), "T_k >= T_q"),
])
def test_inference_bad_input_is_rejected_clearly(change, match):
    args = dict(q=torch.randn(1, 2, 4, 32), k=torch.randn(1, 2, 8, 32), v=torch.randn(1, 2, 8, 32),
                pool_k=torch.randn(3, 2, 4, 32), pool_v=torch.randn(3, 2, 4, 32),
                block_table=torch.zeros(1, 2, 4, 2, dtype=torch.long),
                block_pos=torch.zeros(1, 2, 4, 2, dtype=torch.long))
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        landmark_attention_inference(q, k, v, 3, **args)


@pytest.mark.parametrize("backend", ["dense", "auto"])  # auto: a chunk's slots read by compiled loops
@pytest.mark.parametrize("cmt", [False, True])
def test_chunk_slots_grouped_by_block_or_compiled_agree_with_the_reference(backend, cmt):
    g = torch.Generator().manual_seed(5)
    B, H, H_kv, D, bs, T_q, Tk, K, n_pool = 2, 4, 2, 32, 7, 40, 48, 4, 12
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T_q, Tk, Tk))
    arena = torch.randn(n_pool + 3, 2, H_kv, bs + 1, D, generator=g, dtype=torch.float64)
    pool_k, pool_v = arena[:n_pool, 0], arena[:n_pool, 1]  # strided views, as the hot cache hands them
    table = torch.randint(-1, n_pool, (B, H, T_q, K), generator=g)
    pos = torch.randint(0, 5000, (B, H, T_q, K), generator=g)
    table[..., 2:], pos[..., 2:] = torch.tensor([3, 7]), torch.tensor([8, 16])  # two pairs every query reads
    cmt_k = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) if cmt else None
    args = dict(pool_k=pool_k, pool_v=pool_v, block_table=table, block_pos=pos, cmt_k=cmt_k)
    out = landmark_attention_inference(q, k, v, bs, backend=backend, **args)
    ref = landmark_attention_inference(q, k, v, bs, backend="reference", **args)
    torch.testing.assert_close(out, ref)


def test_compiled_code_runs_where_no_disk_cache_can_be_written(monkeypatch):
    import numba

    from landmark_memory.core import jit

    real = numba.njit

    def no_cache_location(*args, cache=False, **options):
        if cache:  # what numba says for a read-only install run with an unwritable home
            raise RuntimeError("cannot cache function 'f': no locator available for file 'f.py'")
        return real(*args, **options)

    monkeypatch.setattr(numba, "njit", no_cache_location)
    twice = jit.njit(lambda x: 2 * x)
    assert twice(21) == 42


@pytest.mark.parametrize("backend,T_q", [("dense", 40), ("dense", 1), ("numba", 3), ("triton", 5), ("auto", 40),
                                        ("auto", 1)])  # auto: a chunk's slots compiled, and a decoding step
@pytest.mark.parametrize("cmt", [False, True])
def test_int8_pools_are_read_in_place_as_the_reference_reads_them_dequantized(backend, T_q, cmt):
    from landmark_memory.core.quant import dequantize_kv, quantize

    g = torch.Generator().manual_seed(T_q + cmt)
    B, H, H_kv, D, bs, Tk, K, n_pool = 2, 4, 2, 32, 7, 48, 4, 12
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T_q, Tk, Tk))
    data, scales = quantize(torch.randn(n_pool + 3, 2, H_kv, bs + 1, D, generator=g) * torch.logspace(-2, 1, D))
    # as the hot cache has them
    pool_k, pool_v, pool_scale = data[:n_pool, 0], data[:n_pool, 1], scales[:n_pool].float()
    table = torch.randint(-1, n_pool, (B, H, T_q, K), generator=g)
    pos = torch.randint(0, 5000, (B, H, T_q, K), generator=g)
    cmt_k = torch.randn(B, H, 1, D, generator=g) if cmt else None
    args = dict(block_table=table, block_pos=pos, cmt_k=cmt_k)
    out = landmark_attention_inference(q, k, v, bs, pool_k=pool_k, pool_v=pool_v, pool_scale=pool_scale,
                                       backend=backend, **args)
    fk, fv = dequantize_kv(pool_k, pool_v, pool_scale, torch.float64)
    ref = landmark_attention_inference(q.double(), k.double(), v.double(), bs, pool_k=fk, pool_v=fv,
                                       backend="reference",
                                       **{**args, "cmt_k": None if cmt_k is None else cmt_k.double()})
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_int8_pools_need_their_scales_and_scales_their_shape():
    q, k, v = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
    pool = torch.zeros(3, 2, 4, 32, dtype=torch.int8)
    args = dict(block_table=torch.zeros(1, 2, 4, 2, dtype=torch.long),
                block_pos=torch.zeros(1, 2, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="int8 with pool_scale"):
        landmark_attention_inference(q, k, v, 3, pool_k=pool, pool_v=pool, **args)
    with pytest.raises(ValueError, match=r"pool_scale must be float32 \(n_pool, H_kv, D \+ rows\)"):
        landmark_attention_inference(q, k, v, 3, pool_k=pool, pool_v=pool, pool_scale=torch.ones(3, 2, 32), **args)
