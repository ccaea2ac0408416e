"""The names the command line offers, importable without torch or FAISS (so that ``--help``
and a wrong option answer at once): index kinds, stores and their dtypes, retrieval modes,
position mappings, session names, and the named models. Each is owned here and used by the module that
implements it."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
ASSETS, SAMPLES = PACKAGE / "assets", PACKAGE / "samples"  # shipped models and tokenizer; sample texts

INDEX_KINDS = ("ivf-rows", "flat", "hnsw", "ivf", "ivfpq", "flat-gpu", "flat-torch", "ivf-gpu",
               "ivfpq-gpu")  # index/__init__.py
# index/__init__.py: keys an index needs before it trains, unless told (8-bit PQ codebooks want about 10K points)
TRAIN_SIZES = {"ivf-rows": 1024, "ivf": 4096, "ivfpq": 16384}  # a GPU kind's is its CPU twin's; 4096 for the others
NPROBE, EF_SEARCH = 16, 128  # index/base.py: IVF lists a query visits, HNSW search breadth, unless told
DEFAULT_TOP_K = 4  # format/options.py: blocks retrieved per query (the paper's k)
MAX_TOP_K = 1024  # format/options.py: blocks per query; the arrays of a chunk's choices grow with it
MAX_CHUNK_SIZE = 1 << 16  # format/options.py: tokens a chunk attends to locally; what a chunk holds grows with it
MAX_STREAMS = 1024  # memory/engine.py, manifest.py: a memory's batch; its files and indexes are per stream
DEFAULT_INDEX = "ivf-rows"  # exact until 1024 blocks, then lists over the key rows (experiments/results/scale.md)
DISK_STORES = ("lmdb", "mmap")  # storage/__init__.py's STORE_KINDS, lmdb the default on disk
STORES = ("memory", *DISK_STORES)
STORE_DTYPES = ("float32", "float16", "bfloat16", "int8")  # storage/__init__.py, quant.py
RETRIEVALS = ("per_token_head", "per_head", "per_token")  # memory/retrieval.py, paper Table 2
MAPPINGS = ("stingy", "exact")  # paper 3.2.1
# format/options.py: what a block is searched by: its landmark token's key (a model fine-tuned with landmarks),
# or the mean of its own tokens' keys at their positions (any model, no training: no landmark enters the text)
BLOCK_KEYS = ("landmark", "mean")
FREE_BLOCK_SIZE = 64  # format/options.py: tokens per block of a memory without landmarks, unless told
# format/options.py: what a query reads without landmarks unless told: top_k, sink_blocks, local_blocks. SmolLM2 as
# published, 8K tokens of a held-out book: 21.68 in context; 47.28 at top-4 alone, 22.05 at (8, 1, 2), 21.86 at
# (16, 1, 4) for 1.45x its time (experiments/results/training_free.md, its part `reads`)
FREE_READS = (8, 1, 2)
# format/options.py: how a query without landmarks chooses unless told: once per head for a step's queries (InfLLM's
# way). SmolLM2 as published against per token and head: reads 1.02x a landmark memory's speed against 0.79x; pass key
# 4/5, 1/2, 0/2 at 8K, 16K, 32K against 2/5, 1/2, 0/2; perplexity 22.14 and 18.87 against 22.05 and 18.74 at 8K and
# 32K; recall@5 1/10 and 0/10 against 2/10 and 0/10 (experiments/results/training_free.md)
FREE_RETRIEVAL = "per_head"
# uses/answer.py: what a chat model with retrieval heads reads before the question once they found the quote: the
# quote, the two best sentences, the quote with the sentence before and after it, or nothing (the first the
# default: exp_answers.py)
EVIDENCE = ("quote", "quotes", "around", "none")
MAX_NEW_TOKENS = 8192  # app/cli_args.py: the most tokens of one answer (ask, chat, the server's --max-tokens)
MAX_TURN_CHARS = 1 << 20  # uses/answer.py: characters of one message (as the server's default body limit bounds it)
SESSION_NAME = re.compile(r"\w[\w.-]{0,99}")  # uses/session.py: a name, never a path (no separator, no leading
# dot or dash, no control character), and its folder's name: at most NAME_MAX bytes in UTF-8
SESSION_NAME_BYTES = 255
SESSION_NAME_RULE = ("use 1 to 100 letters, digits, '_', '.' or '-', starting with a letter, digit or '_', at most "
                     f"{SESSION_NAME_BYTES} bytes in UTF-8 (a name, never a path)")
NAMED_MODELS = {  # hf/smollm2.py
    "smollm2": "SmolLM2-135M-Instruct as published (no landmarks: a memory reads its blocks' own keys)",
    "smollm2-landmark": "SmolLM2-135M-Instruct with landmarks and our LoRA adapter (reads through a memory)"}


def is_named_model(model) -> bool:
    """Whether ``model`` (a name or a path) is a name of ``NAMED_MODELS`` rather than a folder of
    that name here."""
    return model is not None and str(model) in NAMED_MODELS and not Path(model).exists()


def is_session_name(name) -> bool:
    """Whether ``name`` is a session name (``SESSION_NAME_RULE``)."""
    return isinstance(name, str) and SESSION_NAME.fullmatch(name) is not None and \
        len(name.encode()) <= SESSION_NAME_BYTES
