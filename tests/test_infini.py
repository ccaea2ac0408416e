"""Infini-attention: the batched implementation against a loop-by-loop oracle of the paper's
equations 3-6, streaming equivalence, bounded state, and training and evaluation through
the usual entry points."""

import math

import pytest
import torch

from landmark_memory import LandmarkConfig, LandmarkGPT, RotaryEmbedding, load_tokenizer
from landmark_memory.jobs.evaluate import passkey_accuracy, perplexity
from landmark_memory.models.infini import InfiniState, LayerState, infini_attention


def oracle(q, k, v, N, beta, update):
    """Eqs. 3-6 one head, one token and one matrix entry at a time (float64 Python loops)."""
    T, D = q.shape
    def sig(x):  # ELU + 1
        return (x if x > 0 else math.exp(x) - 1) + 1

    rope = RotaryEmbedding(D)
    M, z, out = [[0.0] * D for _ in range(D)], [0.0] * D, []
    g = 1 / (1 + math.exp(-beta))
    for s in range(0, T, N):
        seg = range(s, min(s + N, T))
        pos = torch.tensor([t - s for t in seg])
        qr, kr = rope(q[s:s + N], pos), rope(k[s:s + N], pos)
        for a, t in enumerate(seg):
            sq = [sig(x) for x in q[t].tolist()]
            den = sum(sq[i] * z[i] for i in range(D))
            mem = [sum(sq[i] * M[i][j] for i in range(D)) / den if den > 0 else 0.0 for j in range(D)]  # eq. 3
            w = [math.exp(float(qr[a] @ kr[b]) / math.sqrt(D)) for b in range(a + 1)]
            dot = [sum(w[b] * float(v[s + b, j]) for b in range(a + 1)) / sum(w) for j in range(D)]
            out.append([g * mem[j] + (1 - g) * dot[j] for j in range(D)])  # eq. 6
        if len(seg) < N:
            break
        new_v = {}
        for t in seg:
            sk = [sig(x) for x in k[t].tolist()]
            den = sum(sk[i] * z[i] for i in range(D))
            got = [sum(sk[i] * M[i][j] for i in range(D)) / den if den > 0 else 0.0 for j in range(D)]
            new_v[t] = [float(v[t, j]) - (got[j] if update == "linear+delta" else 0.0) for j in range(D)]  # eq. 5
        for t in seg:  # eq. 4 with the (delta) values
            sk = [sig(x) for x in k[t].tolist()]
            for i in range(D):
                z[i] += sk[i]
                for j in range(D):
                    M[i][j] += sk[i] * new_v[t][j]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("update", ["linear", "linear+delta"])
def test_memory_read_and_update_equal_the_paper_equations(update):
    g = torch.Generator().manual_seed(3)
    H, T, D, N = 2, 11, 4, 4
    q, k, v = (torch.randn(1, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    beta = torch.tensor([0.3, -1.2])
    st = LayerState(torch.zeros(1, H, D, D, dtype=torch.float64), torch.zeros(1, H, D, dtype=torch.float64),
                    q[:, :, :0], q[:, :, :0])
    out = infini_attention(q, k, v, st, N, beta, RotaryEmbedding(D), update)
    for h in range(H):
        torch.testing.assert_close(out[0, h], oracle(q[0, h], k[0, h], v[0, h], N, beta[h].item(), update))


def tiny(update="linear+delta", seed=0):
    torch.manual_seed(seed)
    cfg = LandmarkConfig.for_tokenizer(load_tokenizer(), n_layer=2, n_head=2, n_embd=32, ffn_hidden=64,
                                       attention="infini", segment_size=16, infini_update=update)
    model = LandmarkGPT(cfg).eval()
    for block in model.blocks:  # a trained gate is not zero: give the memory a real share
        torch.nn.init.normal_(block.attn.gate)
    return model


@pytest.mark.parametrize("update", ["linear", "linear+delta"])
@torch.no_grad()
def test_streaming_segment_by_segment_equals_one_call(update):
    model = tiny(update)
    idx = torch.randint(0, 8000, (2, 100), generator=torch.Generator().manual_seed(1))
    state = InfiniState()
    parts = [model(idx[:, a:b], state=state) for a, b in ((0, 7), (7, 40), (40, 41), (41, 100))]
    torch.testing.assert_close(torch.cat(parts, 1), model(idx), rtol=1e-5, atol=1e-5)
    assert state.tokens == 100


@torch.no_grad()
def test_the_state_does_not_grow_with_the_input():
    model, sizes = tiny(), []
    for n in (64, 640, 6400):  # multiples of the segment: no open segment left
        state = InfiniState()
        model(torch.randint(0, 8000, (1, n)), state=state)
        sizes.append(state.nbytes())
    assert sizes[0] == sizes[1] == sizes[2] == 2 * (2 * 16 * 16 + 2 * 16) * 4  # layers x (M + z) float32


def test_memory_reads_what_an_earlier_segment_wrote():
    """With the gate fully on memory, the output at a later segment depends on an earlier one."""
    model = tiny()
    for block in model.blocks:
        torch.nn.init.constant_(block.attn.gate, 10.0)
    idx = torch.randint(0, 8000, (1, 48), generator=torch.Generator().manual_seed(2))
    other = idx.clone()
    other[0, :16] = (other[0, :16] + 1) % 8000  # change only the first segment
    with torch.no_grad():
        assert not torch.allclose(model(idx)[0, 32:], model(other)[0, 32:])


def test_infini_model_trains_and_evaluates():
    model = tiny().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 50, (4, 65), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(15):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1 and all(b.attn.gate.grad is not None for b in model.blocks)
    model.eval()
    r = perplexity(model, idx[0].repeat(3), 64, progress=False)
    assert math.isfinite(r["perplexity"]) and r["segments"] == 3
    rows = passkey_accuracy(model, load_tokenizer(), [200], trials=2, seed=0, progress=False)
    assert rows[0]["trials"] == 2


def test_state_is_refused_by_other_attentions():
    model = LandmarkGPT(LandmarkConfig.for_tokenizer(load_tokenizer(), n_layer=1, n_head=2, n_embd=32, ffn_hidden=64))
    with pytest.raises(ValueError, match="Infini-attention models only"):
        model(torch.zeros(1, 4, dtype=torch.long), state=InfiniState())
    with pytest.raises(ValueError, match="infini_update"):
        LandmarkConfig(attention="infini", infini_update="delta")
