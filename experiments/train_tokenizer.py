"""Train the byte-level BPE tokenizer shipped in landmark_memory/assets/tokenizer.json.

    python experiments/train_tokenizer.py --data BOOKS

Books held out for validation by the training script (same split, same seed) are left out here
too, so validation text is never seen by any trained component.
"""

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from landmark_memory.core.tokenizer import SPECIAL_TOKENS, TOKENIZER_PATH
from landmark_memory.training.data import list_text_files, split_books, strip_gutenberg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", required=True, help="text files or folders of .txt books")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--val-books", type=int, default=None,
                    help="books held out for validation (default: 5%%, as in train.py)")
    ap.add_argument("--out", type=Path, default=TOKENIZER_PATH)
    args = ap.parse_args(argv)

    train_files, val_files = split_books(list_text_files(args.data), args.val_books)
    print(f"training on {len(train_files)} books; held out: {', '.join(f.name for f in val_files)}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    texts = (strip_gutenberg(f.read_text(encoding="utf-8")) for f in tqdm(train_files, desc="reading"))
    tok.train_from_iterator(texts, trainer=trainer, length=len(train_files))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(args.out)
    sample = "It was the best of times, it was the worst of times."
    print(f"saved {args.out} (vocab {tok.get_vocab_size()}); {sample!r} -> {len(tok.encode(sample).ids)} tokens")


if __name__ == "__main__":
    main()
