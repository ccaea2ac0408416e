"""The Triton kernels (two-pass and one-pass) against the reference, under TRITON_INTERPRET=1 on
CPU (see conftest)."""

import pytest
import torch

from landmark_memory import LandmarkConfig, LandmarkGPT
from landmark_memory.kernels import landmark_attention, landmark_attention_inference, triton_landmark, triton_onepass

TRITON = ["triton", "triton-onepass"]

# fp32: both sides compute in fp32 (the interpreter's tl.dot is exact fp32), measured ~2e-6.
# bf16/fp16: the kernel rounds its output and gradients to the input dtype; the reference runs in
# float64 on the same rounded inputs, so the bound is a few ulps of the dtype.
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}


def _compare(block_size, T, D, dtype, B=2, H=2, seed=0, backend="triton"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, T, D, generator=g).to(dtype)
    out = landmark_attention(q, k, v, block_size, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = landmark_attention(*ref_in, block_size, backend="reference")
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert a.dtype == dtype
        assert torch.isfinite(a).all(), f"{name} has NaN/inf"
        torch.testing.assert_close(a.double(), b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


# (block sizes that divide nothing, one block per key tile, many per tile with key tiles
# wholly before a query tile: the one-pass kernel's unmasked loops)
@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("block_size,T,D", [(50, 130, 64), (63, 150, 32), (7, 61, 64), (3, 37, 32), (1, 20, 32),
                                            (50, 70, 128), (5, 300, 32)])
def test_forward_and_gradients_match_reference_fp32(block_size, T, D, backend):
    _compare(block_size, T, D, torch.float32, backend=backend)


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("block_size,T,D", [(50, 101, 64), (7, 45, 32)])
def test_forward_and_gradients_match_reference_bf16(block_size, T, D, backend):
    _compare(block_size, T, D, torch.bfloat16, backend=backend)


@pytest.mark.parametrize("backend", TRITON)
def test_forward_and_gradients_match_reference_fp16(backend):
    _compare(63, 70, 32, torch.float16, backend=backend)


@pytest.mark.parametrize("backend,module", [("triton", triton_landmark), ("triton-onepass", triton_onepass)])
def test_poisoned_outputs_are_fully_overwritten(monkeypatch, backend, module):
    monkeypatch.setattr(module, "_empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
    _compare(5, 53, 32, torch.float32, seed=3, backend=backend)


def test_onepass_serves_training_without_a_context_miss_token_only():
    q = torch.randn(1, 2, 30, 32)
    with pytest.raises(ValueError, match="no Context Miss Token path; use backend='triton'"):
        landmark_attention(q, q, q, 4, backend="triton-onepass", cmt_k=q[:, :, :1],
                           cmt_blocks=torch.zeros(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="serves landmark_attention only"):
        landmark_attention_inference(q, q, q, 4, pool_k=q[:0, :, :5], pool_v=q[:0, :, :5],
                                     block_table=torch.zeros(1, 2, 30, 1, dtype=torch.long),
                                     block_pos=torch.zeros(1, 2, 30, 1, dtype=torch.long), backend="triton-onepass")


def test_auto_backend_uses_dense_pytorch_on_cpu():
    q, k, v = (torch.randn(1, 2, 30, 32) for _ in range(3))
    assert torch.equal(landmark_attention(q, k, v, 4, backend="auto"), landmark_attention(q, k, v, 4, backend="dense"))


def test_unsupported_head_dim_is_rejected_clearly():
    q = torch.randn(1, 1, 8, 24)
    with pytest.raises(ValueError, match="head dims"):
        landmark_attention(q, q, q, 3, backend="triton")


def test_model_trains_the_same_with_the_triton_kernel():
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=64, ffn_hidden=64, block_size=5, landmark_id=1)
    ref = LandmarkGPT(LandmarkConfig(**cfg, kernel_backend="reference"))
    tri = LandmarkGPT(LandmarkConfig(**cfg, kernel_backend="triton"))
    tri.load_state_dict(ref.state_dict())
    idx = torch.randint(4, 64, (2, 40))
    (la, a), (lb, b) = ref(idx, idx), tri(idx, idx)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
    a.backward(), b.backward()
    for (name, p), p2 in zip(ref.named_parameters(), tri.parameters()):
        torch.testing.assert_close(p.grad, p2.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")

