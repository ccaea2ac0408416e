"""The ``landmark-memory`` command's arguments: every sub-command, its options and their
checks (a value out of range is refused by argparse with exit status 2). Nothing here imports
torch or FAISS: the entry point parses the command line before the heavy imports, so ``--help``
and a wrong option answer at once."""

import argparse

from ..core.ask_options import AskOptions
from ..core.names import (
    BLOCK_KEYS,
    DEFAULT_INDEX,
    DEFAULT_TOP_K,
    DISK_STORES,
    EF_SEARCH,
    EVIDENCE,
    FREE_BLOCK_SIZE,
    FREE_READS,
    INDEX_KINDS,
    MAPPINGS,
    MAX_NEW_TOKENS,
    MAX_TOP_K,
    NAMED_MODELS,
    NPROBE,
    RETRIEVALS,
    SESSION_NAME_RULE,
    STORE_DTYPES,
    TRAIN_SIZES,
    is_session_name,
)


def _number(kind, low, what, high=None):
    """An argparse type: ``kind`` (int or float) at least ``low`` (and at most ``high``), finite."""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= x <= (high if high is not None else float("inf")) or x == float("inf"):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return x
    return parse


positive = _number(int, 1, "a positive integer")
count = _number(int, 0, "an integer >= 0")
nonnegative = _number(float, 0.0, "a finite number >= 0")
port = _number(int, 1, "a port number (1 to 65535)", 65535)
seed = _number(int, 0, "a seed (an integer from 0 to 2**64 - 1)", 2**64 - 1)
MAX_BLOCK_SIZE = 1024  # the paper's blocks are 50 and 63 tokens; a chunk holds at least one block
block_size = _number(int, 1, f"a block size (1 to {MAX_BLOCK_SIZE} tokens)", MAX_BLOCK_SIZE)
top_k = _number(int, 1, f"a number of blocks (1 to {MAX_TOP_K})", MAX_TOP_K)
new_tokens = _number(int, 0, f"a number of tokens (0 to {MAX_NEW_TOKENS:,})", MAX_NEW_TOKENS)


def api_key(text):
    """An argparse type: a key that is not empty (``--api-key "$UNSET"`` must not turn authentication off)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: an empty key would turn authentication off; give a key, or leave "
                                         "the option out (and LANDMARK_MEMORY_API_KEY unset) to serve without one")
    return text


def session_name(text):
    """An argparse type: a session name (``names.is_session_name``), never a path."""
    if not is_session_name(text):
        raise argparse.ArgumentTypeError(f"is no session name: {SESSION_NAME_RULE}")
    return text


def add_model_args(p):
    p.add_argument("--model", help="model directory (save_pretrained layout) or a name: "
                   + "; ".join(f"{k}: {v}" for k, v in NAMED_MODELS.items()) + " (default: the model an existing "
                   "memory was built with, else the bundled model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda when available)")


CHUNK_HELP = "tokens per chunk, a multiple of the block size up to 65,536 (default: the multiple nearest 250)"
RETRIEVAL_HELP = ("what chooses a set of blocks: each query of each head (per_token_head), each head for a step's "
                  "queries (per_head), each query for all heads (per_token); default per_token_head through landmarks, "
                  "per_head without them")


def add_ask_options(p, what: str):
    """How an answer is read and generated (``AskOptions``, whose defaults these are), declared
    once for ``ask`` and ``chat``; ``what``: what the answer follows, as the help says it."""
    o = AskOptions()
    p.add_argument("--max-new-tokens", type=new_tokens, default=o.max_new_tokens,
                   help=f"the most tokens of an answer (default {o.max_new_tokens}, at most {MAX_NEW_TOKENS:,})")
    p.add_argument("--temperature", type=nonnegative, default=o.temperature, help="0 = greedy (default)")
    p.add_argument("--seed", type=seed, default=o.seed, help="sampling seed when temperature > 0")
    p.add_argument("--passages", type=positive, default=o.passages,
                   help=f"passages to report per answer (default {o.passages})")
    p.add_argument("--evidence", choices=EVIDENCE, default=o.evidence,
                   help="what a chat model with retrieval heads reads before the question once they found the quote: "
                        "the quote (default), the two best sentences (quotes), the quote with the sentence before and "
                        "after it (around), or nothing (none: the answer reads the memory alone)")
    p.add_argument("--always-answer", dest="refuse", action="store_false",
                   help="answer even where the retrieval heads find too little evidence (by default the answer says "
                        "the memory does not seem to hold one, and names the closest text)")
    p.add_argument("--policy", metavar="NAME",
                   help="how the question is answered: heads (the retrieval heads' quote read first), reader (the "
                        "question reader's blocks), text (the text index's best block); default: the first of "
                        "them that fits the model")
    p.add_argument("--raw", action="store_true",
                   help=f"continue {what} as written (a model without a chat template, such as the bundled one); by "
                        "default a chat model gets it as a user turn of its chat template and its answer ends at its "
                        "end-of-turn token")


def ask_options(args) -> AskOptions:
    """The ``AskOptions`` the command line gave (``add_ask_options``)."""
    return AskOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                      raw=args.raw, passages=args.passages, evidence=args.evidence, refuse=args.refuse,
                      policy=args.policy)


def add_top_k(p, default=None, new=False):
    """``--top-k``, declared here alone: ``default`` a number, or None (left out: the memory's own
    top-k; ``new``: a new memory's is the library's default)."""
    new_one = f"; a new one {DEFAULT_TOP_K}, {FREE_READS[0]} without landmarks" if new else ""
    said = f"default {default}" if default else f"default: the memory's{new_one}"
    p.add_argument("--top-k", type=top_k, default=default, help=f"blocks retrieved per query ({said})")


def given(args, *names) -> dict:
    """The options ``names`` the command line gave (not left out), by name: what a memory opened
    with them changes of its own."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_retrieval_args(p, index_default=DEFAULT_INDEX):
    p.add_argument("--chunk-size", type=positive, help=CHUNK_HELP)
    add_top_k(p, new=True)
    p.add_argument("--index", default=index_default,
                   help=f"landmark index: {', '.join(INDEX_KINDS)} (default {index_default})")
    p.add_argument("--retrieval", choices=RETRIEVALS, help=RETRIEVAL_HELP)
    p.add_argument("--position-mapping", choices=MAPPINGS, default="stingy", help="positions of retrieved blocks")
    p.add_argument("--cmt-cutoff", type=nonnegative, help=CMT_HELP)


def add_store_dtype(p, saved=False):
    p.add_argument("--store-dtype", choices=STORE_DTYPES,
                   help="stored key/value dtype; int8: a quarter of float32's bytes, scales per block, head and "
                        "key channel or value row (default: " + ("int8" if saved else "the model's, in memory") + ")")


CMT_HELP = ("models trained with a Context Miss Token (--cmt): a query whose CMT share is below this retrieves "
            "nothing, and a step whose queries all are searches no index (default 0: always retrieve)")


DEFAULT_TRAIN_SIZES = ", ".join(f"{n} {kind}" for kind, n in TRAIN_SIZES.items())


def add_index_tuning(p, train_size=None):
    p.add_argument("--train-size", type=positive, default=train_size,
                   help=f"landmarks before IVF indexes train (default {train_size or DEFAULT_TRAIN_SIZES})")
    p.add_argument("--nprobe", type=positive, help=f"IVF lists visited per query (default {NPROBE})")
    p.add_argument("--ef-search", type=positive, help=f"HNSW search breadth (default {EF_SEARCH})")


DESCRIPTION = """The landmark-memory command: build, inspect, query, serve and measure persistent memories.

    landmark-memory demo                                   # the whole story in a few minutes
    landmark-memory build my-memory --input books/         # each file a document (resumable, Ctrl-C commits)
    landmark-memory build my-memory --input books/ --workers 4   # the same, documents read on Ray
    landmark-memory info my-memory
    landmark-memory ask my-memory "Who is Mr Hyde?" --show-retrieved
    landmark-memory chat my-memory --session mine          # a conversation kept in memory, resumed by name
    landmark-memory sessions my-memory                     # the sessions held over it (--delete NAME)
    landmark-memory eval --input book.txt --eval-length 2048
    landmark-memory compare --input book.txt --index flat,ivf-rows,hnsw,ivf,ivfpq --plot compare.png
    landmark-memory passkey --lengths 1k,4k,16k --trials 20 --plot passkey.png
    landmark-memory train --preset tiny                    # experiments/train.py's options

Every command takes ``--help``; ``--json`` prints one JSON document on stdout (progress bars
go to stderr). ``--model`` defaults to the model an existing memory was built with (its weights
checked against the memory's), else the bundled model. Errors exit with status 2 and a
message saying what to do; a build stopped by Ctrl-C (or SIGTERM) commits and exits with 130
(143).
"""


def parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The command line of every sub-command; ``args.command`` names the one given."""
    ap = argparse.ArgumentParser(prog="landmark-memory", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    sub.add_parser("train", help="train a model (the options of experiments/train.py; see `train --help`)",
                   add_help=False)

    p = sub.add_parser("build", parents=[common], help="build or extend a saved memory from text files")
    p.add_argument("memory", help="memory directory (created if absent, extended if present)")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_DIR", help=".txt files or folders of them")
    add_model_args(p)
    p.add_argument("--index", choices=INDEX_KINDS, help=f"landmark index of a new memory (default {DEFAULT_INDEX})")
    p.add_argument("--store", choices=DISK_STORES, help=f"block store of a new memory (default {DISK_STORES[0]})")
    add_store_dtype(p, saved=True)
    p.add_argument("--block-size", type=block_size,
                   help=f"tokens per block (default: a landmark model's own; {FREE_BLOCK_SIZE} without landmarks)")
    p.add_argument("--block-keys", choices=BLOCK_KEYS,
                   help="what a new memory searches its blocks by: landmark (a model fine-tuned with landmarks; the "
                        "default for one) or mean, the mean of each block's own keys (any model, no training; the "
                        "default for a model without landmarks)")
    p.add_argument("--chunk-size", type=positive, help=CHUNK_HELP + "; fixed when the memory is created")
    add_top_k(p, new=True)
    p.add_argument("--train-size", type=positive, metavar="N",
                   help=f"landmarks per layer and head before an IVF index trains (default {DEFAULT_TRAIN_SIZES}); "
                        "fixed "
                        "when the memory is created")
    p.add_argument("--commit-every", type=nonnegative, default=60.0, metavar="SECONDS",
                   help="commit at least this often (default 60; the end of each document commits too)")
    p.add_argument("--leave-unfinished", action="store_true",
                   help="leave a document an earlier build did not finish as it is (what was read of it stays), "
                        "e.g. when its file has changed since")
    add_ray_args(p, "--workers", "read documents in parallel on Ray with N workers (default: one after another in "
                 "this process)")
    p.add_argument("--worker-threads", type=positive, metavar="T",
                   help="cores (torch, numba and FAISS threads) per worker (default: the cores shared out)")

    p = sub.add_parser("info", parents=[common], help="what a memory holds")
    p.add_argument("memory")
    p.add_argument("--verify", action="store_true",
                   help="check every file and stored block (checksums, lengths, indexes); exit 2 if any is damaged")

    p = sub.add_parser("ask", parents=[common], help="continue from a memory's end with a prompt")
    p.add_argument("memory")
    p.add_argument("prompt")
    add_model_args(p)
    add_ask_options(p, "the prompt")
    add_top_k(p)
    p.add_argument("--cmt-cutoff", type=nonnegative, help=CMT_HELP)
    p.add_argument("--show-retrieved", action="store_true", help="print the passages the answer read")

    p = sub.add_parser("search", parents=[common], help="the passages of a memory a question points at, without "
                       "generating: its words (the text index) and its retrieval heads")
    p.add_argument("memory")
    p.add_argument("question")
    add_model_args(p)
    p.add_argument("-k", "--passages", type=positive, default=5, help="passages to give (default 5)")
    p.add_argument("--full", action="store_true",
                   help="print each passage's whole text, not the part around the question's words")

    p = sub.add_parser("index", parents=[common], help="write (or bring up to date) a saved memory's text index, and "
                       "commit an older memory in this version's format")
    p.add_argument("memory")
    add_model_args(p)

    p = sub.add_parser("chat", help="a conversation over a memory, kept as a named session")
    p.add_argument("memory")
    add_model_args(p)
    p.add_argument("--session", type=session_name, metavar="NAME",
                   help="the session to resume or start (default: a new one with a generated name, printed first)")
    add_ask_options(p, "each turn")
    add_top_k(p)
    p.add_argument("--json", action="store_true",
                   help="from a pipe: one JSON object per answer on its own line (session, text, tokens, passages)")

    p = sub.add_parser("sessions", parents=[common], help="list the sessions of a memory, or delete one")
    p.add_argument("memory")
    p.add_argument("--delete", type=session_name, metavar="NAME", help="delete this session (refused while it is in "
                                                                       "use)")

    p = sub.add_parser("serve", help="serve a memory over HTTP: an OpenAI-compatible API and a page")
    p.add_argument("memory")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", type=api_key,
                   help="require `Authorization: Bearer KEY` on every /v1 request (default: the environment variable "
                        "LANDMARK_MEMORY_API_KEY, which keeps the key out of the process list; neither: no key)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="a Host header to answer besides the address served (127.0.0.1, localhost, [::1] and --host); "
                        "repeat it for more, or '*' for any (other hosts get 403, so that no web page reaches the "
                        "server by DNS rebinding)")
    p.add_argument("--parallel", type=positive, default=2, help="answers computed at once; more wait (default 2)")
    p.add_argument("--max-tokens", default=512,
                   type=_number(int, 1, f"a number of tokens (1 to {MAX_NEW_TOKENS:,})", MAX_NEW_TOKENS),
                   help=f"the most new tokens a request may ask (default 512, at most {MAX_NEW_TOKENS:,})")
    p.add_argument("--max-body", type=positive, default=1 << 20,
                   help="the largest request body in bytes (default 1 MiB)")
    add_ray_args(p, "--shares", "serve a corpus from N Ray actors, each holding a share of its blocks and "
                 "searching its part of every index (default: in this process)")

    p = sub.add_parser("eval", parents=[common], help="perplexity of a text (paper Table 1 protocol)")
    p.add_argument("--input", required=True, metavar="FILE", help="the text file to read")
    add_model_args(p)
    p.add_argument("--eval-length", type=positive, default=2048, help="tokens per segment (default 2048)")
    p.add_argument("--max-segments", type=positive, help="evaluate only the first segments")
    p.add_argument("--full-attention", action="store_true",
                   help="each segment in one forward, no memory (the model's own attention; without it a model "
                        "of landmarks reads through them, a model as published through its blocks' own keys)")
    add_retrieval_args(p)
    add_store_dtype(p)
    add_index_tuning(p)

    p = sub.add_parser("compare", parents=[common], help="exact vs approximate retrieval: perplexity, recall, latency")
    p.add_argument("--input", required=True, metavar="FILE", help="the text file to read")
    add_model_args(p)
    p.add_argument("--index", default="flat,ivf-rows,hnsw,ivf,ivfpq",
                   help="index kinds, comma-separated (default all CPU kinds)")
    p.add_argument("--eval-length", type=count, default=0, help="tokens per segment (default 0: the whole text)")
    p.add_argument("--max-segments", type=positive, help="evaluate only the first segments")
    p.add_argument("--chunk-size", type=positive, help=CHUNK_HELP)
    add_top_k(p, new=True)
    p.add_argument("--retrieval", choices=RETRIEVALS, help=RETRIEVAL_HELP)
    p.add_argument("--position-mapping", choices=MAPPINGS, default="stingy", help="positions of retrieved blocks")
    add_store_dtype(p)
    add_index_tuning(p, train_size=1024)
    p.add_argument("--plot", metavar="FILE.png", help="bar charts of the table")

    p = sub.add_parser("passkey", parents=[common], help="the paper's passkey retrieval test")
    add_model_args(p)
    p.add_argument("--lengths", default="1k,2k,4k,8k", help="prompt lengths in tokens (default 1k,2k,4k,8k; k = 1024)")
    p.add_argument("--trials", type=positive, default=10, help="prompts per length (default 10)")
    p.add_argument("--seed", type=seed, default=0, help="keys and depths are reproducible from it")
    p.add_argument("--full-attention", action="store_true", help="whole prompt in one forward, no memory")
    p.add_argument("--plot", metavar="FILE.png", help="accuracy vs length")
    add_retrieval_args(p)
    add_store_dtype(p)
    add_index_tuning(p)

    p = sub.add_parser("heads", parents=[common], help="choose a model's retrieval heads on the shipped "
                       "development questions and save them where ask finds them")
    add_model_args(p)
    p.add_argument("--tokens", type=positive, default=16128,
                   help="tokens of each development text read into a memory (default 16,128)")
    p.add_argument("--blocks", type=_number(int, 0, "a count of blocks", 64), default=4,
                   help="blocks every answer token reads first, as the heads rank them (default 4; 0: none, a quote "
                        "only)")

    p = sub.add_parser("demo", parents=[common], help="build, save, reopen and query a memory over the sample book")
    p.add_argument("--out", help="where to keep the memory (default: a temporary folder, removed afterwards)")
    p.add_argument("--seed", type=seed, help="where the passkey goes and what it is (default: random)")
    p.add_argument("--book", metavar="FILE", help="a text file to use instead of the bundled sample book")
    p.add_argument("--book-tokens", type=positive,
                   help="read only the book's first N tokens (default: all of it for the bundled model, "
                        "8192 for others, which read about 100 times slower on a CPU)")
    add_model_args(p)
    return ap


def add_ray_args(p, flag: str, what: str) -> None:
    """``flag`` N (``what`` it does with N Ray actors) and ``--ray-address``, the cluster they run on."""
    p.add_argument(flag, type=_number(int, 1, f"a number of {flag[2:]} >= 1"), metavar="N",
                   help=f"{what}; without --ray-address a local Ray instance runs them")
    p.add_argument("--ray-address", metavar="ADDR",
                   help=f"with {flag}: join a running Ray cluster, auto or the HOST:PORT `ray start --head` printed; "
                        "the memory folder must be on a filesystem every machine reaches")
