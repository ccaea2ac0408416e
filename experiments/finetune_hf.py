"""Fine-tune a local Hugging Face Llama-family model with landmark tokens (paper section 4.2).

    python experiments/finetune_hf.py --hf-model path/to/llama --data ../books --out-dir out/llama-landmark
    python experiments/finetune_hf.py --hf-model path/to/llama --data ../books --out-dir out/llama-landmark --resume

The model is converted with ``landmark_memory.models.hf.convert`` (a landmark after every 63 tokens,
its embedding the mean of the others) and trained on windows of 512 tokens, landmarks
included, with the paper's code defaults (the ``hf`` preset of ``landmark_memory.training.train``: lr
2e-5, 3% warmup then cosine decay, weight decay 0.1, 128 windows per optimiser step). Any
training flag overrides them (``--help``). Writes to ``--out-dir`` a ``save_pretrained``
model with its tokenizer, loadable with ``landmark_memory.hf.from_pretrained``; ``--resume``
continues from there. Text is read with ``datasets`` from local files only.
"""

import os
import sys

from landmark_memory.training.train import main

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    argv = sys.argv[1:]
    if not any(a == "--hf-model" or a.startswith("--hf-model=") for a in argv):
        sys.exit("finetune_hf.py: give --hf-model PATH, a local Hugging Face Llama-family model directory")
    main(["--preset", "hf", *argv])
