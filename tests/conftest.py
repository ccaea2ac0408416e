import os

# Before any library import: local files only, and Triton kernels interpreted on CPU-only machines.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from landmark_memory.data import SAMPLE_DIR  # noqa: E402


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A folder of three short text files: a corpus's documents."""
    d = tmp_path_factory.mktemp("docs")
    for name, src, cut in [("a.txt", "train/treasure_island_excerpt.txt", 3000),
                           ("b.txt", "train/sherlock_holmes_excerpt.txt", 2200), ("c.txt", "val/alice_excerpt.txt", 1200)]:
        (d / name).write_text((SAMPLE_DIR / src).read_text()[:cut])
    return d
