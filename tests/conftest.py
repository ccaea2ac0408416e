import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

# Before any library import: local files only, and Triton kernels interpreted on CPU-only machines.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
from helpers import BOOK  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from landmark_memory.training.data import SAMPLE_DIR  # noqa: E402


@pytest.fixture(scope="module")
def model():
    """A small random landmark model (vocabulary 64, blocks of 5 tokens, landmark id 1), in eval
    mode; a module that needs another model names its own ``model`` fixture."""
    from landmark_memory.models.config import LandmarkConfig
    from landmark_memory.models.model import LandmarkGPT

    torch.manual_seed(0)
    cfg = LandmarkConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=5, landmark_id=1)
    return LandmarkGPT(cfg).eval()


@pytest.fixture(scope="module")
def text():
    """60,000 characters of the bundled book."""
    return BOOK.read_text()[20_000:80_000]


@pytest.fixture(scope="module")
def tokenizer_object(text):
    """A byte-level BPE of 320 tokens trained on ``text``: the tiny Hugging Face models' tokenizer."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator([text], trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                      show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


@pytest.fixture
def refused(capsys):
    """``refused(argv, *words)``: the command ``argv`` exits 2 with one line on stderr, no traceback,
    holding each of ``words``; returns that line."""
    from landmark_memory.app.cli import main

    def check(argv, *words):
        rc = main(argv)
        err = capsys.readouterr().err.strip()
        assert rc == 2, err
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        for w in words:
            assert w in err, err
        return err

    return check


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A folder of three short text files: a corpus's documents."""
    d = tmp_path_factory.mktemp("docs")
    for name, src, cut in [("a.txt", "train/treasure_island_excerpt.txt", 3000),
                           ("b.txt", "train/sherlock_holmes_excerpt.txt", 2200),
                           ("c.txt", "val/alice_excerpt.txt", 1200)]:
        (d / name).write_text((SAMPLE_DIR / src).read_text()[:cut])
    return d


@pytest.fixture(scope="module")
def corpus(documents, tmp_path_factory):
    """A corpus memory of ``documents`` (chunks of 100 tokens)."""
    from landmark_memory.app.cli import main

    path = tmp_path_factory.mktemp("corpus") / "m"
    assert main(["build", str(path), "--input", str(documents), "--chunk-size", "100", "--quiet"]) == 0
    return path


@contextlib.contextmanager
def _serving(memory, *args, env=None):
    """``landmark-memory serve`` on ``memory`` (with ``args``) in its own process: its URL, then
    SIGTERM; the server must end cleanly, with no traceback on stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "landmark_memory.app.entry", "serve", str(memory), "--port",
                             str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        _, err = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then ends by the signal it was sent (-15), as a program killed by it would
    assert proc.returncode in (0, -signal.SIGTERM) and time.time() - t0 < 10 and "Traceback" not in err, err


@pytest.fixture(scope="session")
def serving():
    """``_serving``: a server of a memory in its own process, for the test's ``with``."""
    return _serving
