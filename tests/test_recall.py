"""The recall loss (recall.py) against a float64 loop over the queries and keys the converted
model's own attention receives, and the drills' sources that it reads."""

import math
import random

import numpy as np
import pytest
import torch
from hf_tiny import tiny
from transformers import AttentionInterface

from landmark_memory import load_tokenizer
from landmark_memory.models.hf.backbone import HFBackbone
from landmark_memory.models.hf.convert import ATTENTION, landmark_attention_forward, normal_logits
from landmark_memory.training.data import SAMPLE_DIR, WindowSampler
from landmark_memory.training.drills import RetrievalDrills
from landmark_memory.training.recall import recall_loss, recall_queries

BS = 7


def captured_attention(model, idx):
    """The queries and keys (RoPE applied, (B, H, T', D) and (B, H_kv, T', D)) that each layer's
    attention receives in the model's in-sequence forward, and the layers' inputs."""
    seen, inner = [], landmark_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((query.detach().double(), key.detach().double(), kwargs.get("scaling") or args[1]))
        return inner(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(ATTENTION, spy)
    try:
        _, hidden = normal_logits(model, idx, hidden_states=True)
    finally:
        AttentionInterface.register(ATTENTION, inner)
    return seen, hidden


def reference_recall(seen, answer, source, block_size):
    """-log of the head-averaged softmax mass on the source's blocks, one query, layer and head
    at a time, averaged over layers and then over queries."""
    B, T = answer.shape
    terms = []
    for b in range(B):
        for t in range(T):
            j = int(answer[b, t])
            own = t // block_size
            blocks = {s // block_size for s in range(T) if source[b, s] == j and s // block_size < own} if j else set()
            if not blocks:
                continue
            per_layer = []
            for q, k, scale in seen:
                H, G = q.shape[1], q.shape[1] // k.shape[1]
                p_t = t + t // block_size
                mass = 0.0
                for h in range(H):
                    s = [float(q[b, h, p_t] @ k[b, h // G, c * (block_size + 1) + block_size]) * scale
                         for c in range(own)]
                    z = max(s)
                    e = [math.exp(v - z) for v in s]
                    mass += sum(e[c] for c in blocks) / sum(e) / H
                per_layer.append(-math.log(mass))
            terms.append(sum(per_layer) / len(per_layer))
    return sum(terms) / len(terms)


def test_recall_loss_equals_a_loop_over_the_attentions_own_queries_and_landmark_keys(tokenizer_object):
    model, _ = tiny(tokenizer_object, block_size=BS)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 300, (2, 61), generator=gen)  # 8 whole blocks and 5 tokens
    answer, source = torch.zeros_like(idx), torch.zeros_like(idx)
    answer[0, 50:54], source[0, 3:9] = 1, 1  # read from blocks 0 and 1
    answer[0, 57:60], source[0, 30:33] = 2, 2  # block 4
    answer[1, 40:44], source[1, 38:41] = 1, 1  # block 5, the own block of 40 and 41: only 42 and 43 ask
    answer[1, 20:22] = 3  # no source: asks nothing
    seen, hidden = captured_attention(model, idx)
    want = reference_recall(seen, answer, source, BS)
    got = recall_loss(HFBackbone(model), list(hidden), answer, source)
    got = float(got.detach())
    assert math.isfinite(got) and abs(got - want) < 1e-5 * max(1.0, want)
    rows, tokens, _, _ = recall_queries(answer, source, BS)
    assert rows.tolist() == [0] * 7 + [1] * 2 and tokens.tolist()[-2:] == [42, 43]


def test_recall_loss_is_zero_without_a_source_and_pulls_the_landmarks_when_there_is_one(tokenizer_object):
    model, _ = tiny(tokenizer_object, block_size=BS)
    idx = torch.randint(0, 300, (1, 42), generator=torch.Generator().manual_seed(1))
    answer, source = torch.zeros_like(idx), torch.zeros_like(idx)
    answer[0, 35:40] = 1
    _, hidden = normal_logits(model, idx, hidden_states=True)
    assert float(recall_loss(HFBackbone(model), list(hidden), answer, source)) == 0.0
    source[0, 8:12] = 1
    _, hidden = normal_logits(model, idx, hidden_states=True)
    loss = recall_loss(HFBackbone(model), list(hidden), answer, source)
    loss.backward()
    lm = model.config.landmark_token_id
    assert model.get_input_embeddings().weight.grad[lm].abs().sum() > 0  # the landmarks' keys learn from it
    with pytest.raises(ValueError, match="one hidden state per layer"):
        recall_loss(HFBackbone(model), list(hidden)[:1], answer, source)


def test_the_drills_sources_are_the_text_their_answers_are_read_from():
    tok = load_tokenizer()
    text = (SAMPLE_DIR / "book" / "up_from_slavery.txt").read_text()[20_000:40_000]
    book = np.asarray(tok.encode(text).ids, dtype=np.int64)
    drills, quotes = RetrievalDrills(tok, rate=1.0, quote_share=0.5), 0
    for seed in range(30):
        window = book[:1500].copy()
        d = drills.drill(window, random.Random(seed))
        first = min(a for a, _ in d.answers)
        for f, sources in zip(d.asked, d.sources):
            said = [" ".join(tok.decode(window[a:b].tolist()).split()) for a, b in sources]
            assert all(b <= first for _, b in sources)  # before every question
            if f.key == "quote":
                quotes += 1
                assert said == [f.chat]
            else:
                assert said == [s.strip() for s in f.sentences]
    assert quotes >= 10
    sampler = WindowSampler(book, 1500, 2, seed=0, mix=drills)
    batch = sampler.batch()
    for r in range(2):  # the batch marks each answer's targets and, before them, its sources with one number
        for j in set(batch.answer[r].tolist()) - {0}:
            src, ans = (batch.source[r] == j).nonzero(), (batch.answer[r] == j).nonzero()
            assert len(src) and src.max() < ans.min()
