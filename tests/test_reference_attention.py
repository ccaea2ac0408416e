"""The reference grouped softmax against a loop oracle of the paper's definitions."""

import math

import pytest
import torch
import torch.nn.functional as F

from landmark_memory.kernels import dense, grouped_softmax, landmark_attention, landmark_weights
from landmark_memory.kernels.reference import landmark_groups, landmark_positions


def oracle_weights(scores, block_size):
    """Attention weights of one query row set, by loops over the definitions in docs/design/inference.md.

    scores: list of lists (T x T) of floats. Returns a T x T list of weights."""
    T, L = len(scores), block_size + 1

    def blk(j):
        return j // L

    def is_lm(j):
        return j % L == block_size

    W = [[0.0] * T for _ in range(T)]
    for i in range(T):
        local = [j for j in range(i + 1) if (blk(j) == blk(i) and not is_lm(j)) or (is_lm(j) and blk(j) < blk(i))]
        z = sum(math.exp(scores[i][j]) for j in local)
        for j in local:
            if not is_lm(j):
                W[i][j] = math.exp(scores[i][j]) / z
        for c in range(blk(i)):  # earlier blocks are complete: block_size tokens then a landmark
            members = range(c * L, c * L + block_size)
            gate = math.exp(scores[i][c * L + block_size]) / z
            zc = sum(math.exp(scores[i][j]) for j in members)
            for j in members:
                W[i][j] = gate * math.exp(scores[i][j]) / zc
    return W


@pytest.mark.parametrize("block_size,T", [(1, 7), (3, 14), (3, 16), (50, 130)])
def test_reference_matches_loop_oracle(block_size, T):
    g = torch.Generator().manual_seed(block_size * 100 + T)
    B, H, D = 2, 3, 8
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    out = landmark_attention(q, k, v, block_size)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    for b in range(B):
        for h in range(H):
            W = torch.tensor(oracle_weights(scores[b, h].tolist(), block_size), dtype=torch.float64)
            torch.testing.assert_close(landmark_weights(q, k, block_size)[b, h], W, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(out[b, h], W @ v[b, h], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("query_tile", [512, 5, 64])  # tiles of queries start anywhere inside a block
@pytest.mark.parametrize("block_size,T", [(1, 9), (3, 14), (50, 130), (7, 7)])
def test_dense_backend_equals_reference_with_gradients(block_size, T, query_tile, monkeypatch):
    monkeypatch.setattr(dense, "QUERY_TILE", query_tile)
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, 3, T, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 3, T, 16, generator=g, dtype=torch.float64)
    outs = [landmark_attention(q, k, v, block_size, backend=b) for b in ("reference", "dense")]
    grads = [torch.autograd.grad(o, (q, k, v), do) for o in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_figure_4_worked_example():
    # Appendix A: block size 2, landmarks at 2, 5, 8; query 6 with all-equal scores.
    T, bs = 9, 2
    assert landmark_positions(T, bs).tolist() == [2, 2, 2, 5, 5, 5, 8, 8, 8]
    assert landmark_groups(T, bs)[6].tolist() == [2, 2, 8, 5, 5, 8, 8, -1, -1]  # 7, 8: causally masked
    q = torch.zeros(1, 1, T, 4, dtype=torch.float64)
    W = landmark_weights(q, q, bs)[0, 0, 6]
    torch.testing.assert_close(W, torch.tensor([1 / 6, 1 / 6, 0, 1 / 6, 1 / 6, 0, 1 / 3, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("block_size,T", [(1, 9), (3, 13), (5, 40), (50, 101)])
def test_weight_rows_sum_to_one_and_landmarks_get_zero(block_size, T):
    q, k = torch.randn(2, 2, T, 16), torch.randn(2, 2, T, 16)
    W = landmark_weights(q * 3, k, block_size)
    torch.testing.assert_close(W.sum(-1), torch.ones(2, 2, T), rtol=0, atol=1e-5)
    assert (W >= 0).all()
    assert (W.triu(1) == 0).all(), "causal"
    lm = torch.arange(T) % (block_size + 1) == block_size
    assert (W[..., lm] == 0).all()


def test_gradcheck_float64():
    q, k, v = (torch.randn(1, 2, 11, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: landmark_attention(q, k, v, 3, scale=0.7), (q, k, v))


def test_single_block_is_standard_causal_attention():
    q, k, v = (torch.randn(2, 3, 20, 16) for _ in range(3))
    out = landmark_attention(q, k, v, block_size=20)  # one incomplete block: no landmark
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


def test_large_scores_stay_finite():
    q, k, v = (torch.randn(1, 2, 33, 8) for _ in range(3))
    out = landmark_attention(q * 1e3, k * 1e3, v, 4)
    assert torch.isfinite(out).all()


def test_gradients_are_finite_with_masked_groups():
    q, k, v = (torch.randn(2, 2, 25, 8, requires_grad=True) for _ in range(3))
    landmark_attention(q, k, v, 3).square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_grouped_softmax_generic_groups():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    g = torch.tensor([0, 1, 0, -1, 1])
    s = grouped_softmax(x, g)
    e = x.exp()
    expect = torch.tensor([e[0] / (e[0] + e[2]), e[1] / (e[1] + e[4]), e[2] / (e[0] + e[2]), 0, e[4] / (e[1] + e[4])])
    torch.testing.assert_close(s, expect)
    assert grouped_softmax(torch.ones(3), torch.ones(3, dtype=torch.long)).sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("bad,match", [
    (dict(block_size=0), "block_size"),
    (dict(backend="cuda-magic"), "unknown backend"),
    (dict(q=torch.randn(2, 5, 4)), "4-d"),
    (dict(k=torch.randn(1, 2, 6, 4)), "must share"),
    (dict(k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8)), "q and k shapes disagree"),
    (dict(v=torch.randn(1, 2, 5, 4, dtype=torch.float64)), "dtype"),
])
def test_bad_input_is_rejected_clearly(bad, match):
    args = dict(q=torch.randn(1, 2, 5, 4), k=torch.randn(1, 2, 5, 4), v=torch.randn(1, 2, 5, 4), block_size=2)
    args.update(bad)
    kw = {k: args.pop(k) for k in ("backend",) if k in args}
    with pytest.raises(ValueError, match=match):
        landmark_attention(args["q"], args["k"], args["v"], args["block_size"], **kw)
