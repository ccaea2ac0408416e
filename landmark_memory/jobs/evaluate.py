"""Perplexity, exact-vs-approximate comparison and passkey accuracy of a model, with or
without memory: the measurements behind the CLI's eval, compare and passkey commands."""

import math
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..core.decode import decode, decode_rereading
from ..core.passkey import run_passkey
from ..format.options import MemoryOptions
from ..index import recall_at_k
from ..memory import LandmarkMemory, RetrievalStats
from ..models.infini import InfiniState
from ..models.kinds import in_sequence_logits, is_infini, is_plain_hf, kv_cache_decoder, reads_through_memory


def parse_lengths(text: str) -> list[int]:
    """``"1k,4k,16384"`` -> [1024, 4096, 16384] (k = 1024, m = 1024²)."""
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        mult = {"k": 1024, "m": 1024 ** 2}.get(part[-1], 1)
        try:
            n = int(float(part.rstrip("km")) * mult)
        except ValueError:
            raise ValueError(f"cannot read length {part!r}: use integers with an optional k or m, e.g. "
                             "1k,4k,16k") from None
        if n < 1:
            raise ValueError(f"lengths must be positive, got {part!r}")
        out.append(n)
    if not out:
        raise ValueError("no lengths given: use e.g. --lengths 1k,4k,16k")
    return out


PIECE = 8192  # about this many tokens fed to a memory per call while measuring (bounded logits)


def uses_memory(model: torch.nn.Module, in_sequence: bool = False) -> bool:
    """A memory reads every model it can (``kinds.reads_through_memory``: landmark models, and
    models as published of the families we read) unless the whole input is asked for in one
    forward."""
    return reads_through_memory(model) and not in_sequence


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids, eval_length: int, *, memory: MemoryOptions | None = None,
               context: int | None = None,
               max_segments: int | None = None, keep_retrieved: bool = False, progress: bool = True,
               desc: str = "perplexity") -> dict:
    """Perplexity of ``ids`` cut into segments of ``eval_length`` predicted tokens (paper Table 1):
    each segment is read from its start, alone.

    Parameters
    ----------
    model : LandmarkGPT, or a Hugging Face causal LM (converted to landmarks, or as published:
        in sequence, or through a memory of its blocks' own keys).
    ids : list or int array (n,), token ids.
    eval_length : int, tokens predicted per segment (the segment holds one more).
    memory : MemoryOptions or None, the options of a memory that reads each segment chunk by
        chunk with retrieval; None runs each segment through the model in one forward (in sequence).
    context : int, optional, without memory: read each segment in pieces of ``context``
        tokens, each alone (attention limited to its piece; the paper's l_local without memory).
    max_segments : int, optional, evaluate only the first segments.
    keep_retrieved : bool, return the retrieved block ids of every segment and layer.

    Returns
    -------
    dict: ``perplexity``, ``loss`` (mean nats/token), ``tokens``, ``segments``, ``seconds``,
    ``searches`` and ``search_seconds`` (FAISS calls), ``retrieval_stats`` (the memories'
    ``RetrievalStats`` summed), ``retrieved`` when asked.
    """
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    n_seg = (len(ids) - 1) // eval_length
    if n_seg < 1:
        raise ValueError(f"the text has {len(ids)} tokens, too few for one segment of {eval_length}; "
                         "lower --eval-length or give a longer text")
    if max_segments:
        n_seg = min(n_seg, max_segments)
    device = next(model.parameters()).device
    total = count = searches = 0
    search_s, retrieved, stats, t0 = 0.0, [], RetrievalStats(), time.perf_counter()
    for s in tqdm(range(n_seg), desc=desc, unit="seg", disable=not progress, dynamic_ncols=True):
        seg = ids[s * eval_length:(s + 1) * eval_length + 1].to(device)
        x, y = seg[None, :-1], seg[None, 1:]
        if memory is None:
            step = context or x.shape[1]
            logits = torch.cat([in_sequence_logits(model, x[:, a:a + step]) for a in range(0, x.shape[1], step)], 1)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        else:
            mem, loss, got = LandmarkMemory(model, memory), 0.0, []
            # whole chunks at a time: the logits of a book would not fit at once, and chunk-aligned
            # pieces read exactly as one call (equal landmark scores, as every layer-0 landmark
            # key is, may be ordered differently by a search over fewer queries)
            piece = mem.options.chunk_size * max(1, PIECE // mem.options.chunk_size)
            for a in range(0, x.shape[1], piece):
                out = mem.forward(x[:, a:a + piece], y[:, a:a + piece], retrieved=keep_retrieved)
                loss += out.loss * out.logits.shape[1] / x.shape[1]
                if keep_retrieved:
                    got.append([r.cpu() for r in out.retrieved])
            ixs = mem.inspection.indexes()
            searches += sum(ix.searches for ix in ixs)
            search_s += sum(ix.search_seconds for ix in ixs)
            stats += mem.retrieval_stats
            if keep_retrieved:
                retrieved.append([torch.cat(layer, 2) for layer in zip(*got)])
            mem.close()
        total += loss.item() * eval_length
        count += eval_length
    loss = total / count
    res = {"perplexity": math.exp(loss), "loss": loss, "tokens": count, "segments": n_seg,
           "seconds": time.perf_counter() - t0, "searches": searches, "search_seconds": search_s,
           "retrieval_stats": stats}
    if keep_retrieved:
        res["retrieved"] = retrieved
    return res


def compare_indexes(model: torch.nn.Module, ids, kinds: list[str], eval_length: int, memory: MemoryOptions, *,
                    max_segments: int | None = None, progress: bool = True) -> list[dict]:
    """Perplexity, recall@k of the retrieved blocks against exact search, and FAISS search
    latency, per index kind (``flat`` is always measured first: it is the reference), the
    other options ``memory``'s.

    Returns a list of dicts: ``index``, ``perplexity``, ``ppl_delta_pct`` (vs flat),
    ``recall`` (mean over segments, layers, heads and tokens), ``search_ms`` (per call),
    ``seconds``."""
    kinds = ["flat"] + [k for k in kinds if k != "flat"]
    rows, exact = [], None
    for kind in kinds:
        res = perplexity(model, ids, eval_length, memory=replace(memory, index=kind), max_segments=max_segments,
                         keep_retrieved=True, progress=progress, desc=kind)
        if exact is None:
            exact = res
        hits = [recall_at_k(r.reshape(-1, r.shape[-1]).numpy(), e.reshape(-1, e.shape[-1]).numpy())
                for seg, seg_exact in zip(res["retrieved"], exact["retrieved"]) for r, e in zip(seg, seg_exact)]
        rows.append({"index": kind, "perplexity": res["perplexity"],
                     "ppl_delta_pct": 100 * (res["perplexity"] / exact["perplexity"] - 1),
                     "recall": float(np.mean(hits)), "searches": res["searches"],
                     "search_ms": 1e3 * res["search_seconds"] / max(1, res["searches"]), "seconds": res["seconds"]})
    return rows


@torch.no_grad()
def greedy_continuation(model: torch.nn.Module, ids: list[int], max_new_tokens: int,
                        memory: MemoryOptions | None = None) -> list[int]:
    """The greedy continuation of the prompt ``ids``: through a fresh memory with the options
    ``memory`` or, with ``memory=None``, as the model reads on its own (an
    Infini-attention model streamed, a plain Hugging Face model with its KV cache, any other
    re-reading the whole context for each new token)."""
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    if is_infini(model):  # streamed: the state carries the context
        state = InfiniState()
        new = decode(model(idx, state=state)[:, -1], lambda nxt: model(nxt, state=state)[:, -1], max_new_tokens)
    elif memory is None and is_plain_hf(model):  # its own KV cache, as generate() would use
        new = decode(*kv_cache_decoder(model, idx), max_new_tokens)
    elif memory is None:  # no cache: the whole context is re-read for each new token
        new = decode_rereading(lambda x: in_sequence_logits(model, x), idx, max_new_tokens)
    else:
        with LandmarkMemory(model, memory) as mem:
            new = mem.generate(idx, max_new_tokens)
    return new[0].tolist()


def passkey_accuracy(model: torch.nn.Module, tokenizer, lengths: list[int], trials: int, seed: int,
                     memory: MemoryOptions | None = None, max_new_tokens: int = 8,
                     progress: bool = True) -> list[dict]:
    """The passkey test (``passkey.run_passkey``) with greedy decoding, through a fresh memory
    per prompt with the options ``memory`` or, with ``memory=None``, in sequence."""
    bar = tqdm(total=len(lengths) * trials, desc="passkey", unit="trial", disable=not progress, dynamic_ncols=True)
    try:
        return run_passkey(lambda ids: tokenizer.decode(greedy_continuation(model, ids, max_new_tokens, memory)),
                           tokenizer, lengths, trials, seed, progress=bar)
    finally:
        bar.close()
