"""The memory's text index as an engine part: ``MemoryText``, what a memory keeps of its text
index while it lives, and ``TextSearch``, the door to it that ``LandmarkMemory.text_index``
hands out (made when asked, like ``inspection``).

A saved memory's index lies in its folder (``format/text_index.py``). Its writer keeps it
(``TextSearch.follow`` or ``keep``: ``build``, ``landmark-memory index``), and from then on
every ``commit`` brings it up to the committed blocks and seals it. A reader (``ask``,
``search``, the server) uses the file as it lies where its seal vouches for it and adds blocks
committed since in a copy in memory, or builds one in memory where there is none; where the
file proves damaged as it is read, the reader builds a copy in memory and searches that (a
warning says so). A session's own blocks (its turns) are indexed in memory as they come, after
its memory's.
"""

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

from ..core.tokenizer import special_ids
from ..format.text_index import TextIndex, TextIndexError
from ..models.kinds import tokenizer_digest

T = TypeVar("T")


class MemoryText:
    """What a memory keeps of its text index while it lives: the tokenizer it was first asked
    with (what turns its blocks into words), the index of its own blocks, an attached
    session's, and whether its writer keeps the folder's file (``kept``)."""

    def __init__(self):
        self.tokenizer, self.digest = None, None
        self.own: TextIndex | None = None
        self.turns: tuple[weakref.ref, TextIndex] | None = None  # (held weakly: a session holds its memory)
        self.kept = False

    def bind(self, tokenizer) -> None:
        """Take ``tokenizer`` as the one the memory's text is read with; ``ValueError`` for another."""
        if tokenizer is self.tokenizer:  # (its digest hashes its whole definition: once per tokenizer)
            return
        digest = tokenizer_digest(tokenizer)
        if self.digest is not None and digest != self.digest:
            raise ValueError("this memory's text index is read with another tokenizer: ask a memory with the "
                             "tokenizer of its model")
        self.tokenizer, self.digest = tokenizer, digest

    def close(self) -> None:
        for index in (self.own, self.turns[1] if self.turns else None):
            if index is not None:
                index.close()
        self.own = self.turns = None


class TextSearch:
    """The text index of the memory ``mem`` (its ``MemoryText`` ``text``): kept by its writer,
    searched by BM25 over a question's words."""

    def __init__(self, mem, text: MemoryText):
        self.mem, self.text = mem, text

    def _rows(self, first: int, last: int) -> np.ndarray:
        return self.mem.tokens(0, first, last).reshape(-1, self.mem.shape.block_size)  # (last - first, bs)

    def _sync(self, index: TextIndex, first: int, last: int, quiet: bool = True) -> int:
        tok = self.text.tokenizer
        backend = getattr(tok, "backend", tok)  # (an ``hf.TextTokenizer``'s, or a ``tokenizers.Tokenizer``)
        return index.sync(self._rows(first, last), set(special_ids(tok)),
                          lambda rows: backend.decode_batch(rows, skip_special_tokens=True), quiet=quiet)

    def follow(self, tokenizer) -> None:
        """From now on every ``commit`` of this saved memory's writer brings the text index in
        its folder up to the committed blocks and seals it (``tokenizer``: its model's)."""
        mem = self.mem
        if mem.dir is None or mem.readonly:
            raise ValueError("only a saved memory's writer keeps its text index; open it without readonly=True")
        self.text.bind(tokenizer)
        self.text.kept = True

    def keep(self, tokenizer, quiet: bool = False, check: bool = False) -> int:
        """``follow``, and bring the index up to the committed blocks now (``check``: check it
        first and build it again where it is damaged: ``landmark-memory index``). Returns the
        blocks it added."""
        self.follow(tokenizer)
        with TextIndex.open(self.mem.dir.path, self.text.digest, writable=True, check=check) as index:
            return self._sync(index, 0, self.mem.manifest.blocks, quiet)

    def catch_up(self, quiet: bool = True) -> None:
        """The index a writer keeps brought up to its last commit (``commit`` calls it);
        ``TextIndexError`` saying what is committed where the index cannot be written."""
        if not self.text.kept:
            return
        mem = self.mem
        try:
            self.keep(self.text.tokenizer, quiet=quiet)
        except (TextIndexError, OSError) as e:
            why = str(e) if isinstance(e, TextIndexError) else f"{e.filename or mem.dir.path}: {e.strerror or e}"
            raise TextIndexError(f"{mem.dir.path} is committed (commit {mem.manifest.commit}: {len(mem.inputs):,} "
                                 f"documents) but its text index was not written: {why}") from None

    def _memory_index(self, n: int) -> tuple[TextIndex, int]:
        """(the text index of the memory's own blocks, brought up to them, the blocks of the
        first ``n`` it holds: those before a session's)."""
        mem, text = self.mem, self.text
        a = mem.attachment
        base_blocks = min(n, a.base_blocks) if a is not None else n
        if text.own is None:
            text.own = TextIndex.open(mem.dir.path, text.digest, writable=False) if mem.dir is not None \
                else TextIndex.in_memory(text.digest)
        if text.own.blocks != base_blocks:  # (blocks committed since it was written, or none indexed yet)
            self._sync(text.own, 0, base_blocks, quiet=False)
        return text.own, base_blocks

    def _asked(self, tokenizer, n: int, query: Callable[[TextIndex, int], T]) -> tuple[T, int]:
        """(``query(index, base_blocks)``, ``base_blocks``): the memory's own index and the blocks of its first
        ``n`` that it holds, asked; where the index's file proves damaged as it is read, it is
        built again in memory (a warning says so) and asked again."""
        self.text.bind(tokenizer)
        try:
            own, base_blocks = self._memory_index(n)
            return query(own, base_blocks), base_blocks
        except TextIndexError as e:
            warnings.warn(f"{e}; searching a copy built in memory meanwhile", RuntimeWarning, stacklevel=4)
            self.text.own.close()
            self.text.own = TextIndex.in_memory(self.text.digest)
            own, base_blocks = self._memory_index(n)
            return query(own, base_blocks), base_blocks

    def frequencies(self, tokenizer, words: Iterable[str], n: int) -> tuple[dict[str, int], int]:
        """({word: how many of the memory's first ``n`` blocks hold it, a session's turns aside},
        the blocks counted)."""
        words = list(words)
        return self._asked(tokenizer, n, lambda index, base_blocks: index.frequencies(words, base_blocks))

    def search(self, tokenizer, words: Iterable[str], k: int, n: int) -> list[tuple[int, float]]:
        """The ``k`` of the memory's first ``n`` blocks (an attached session's turns among
        them) whose text BM25 ranks first for ``words``, as (block, score), best first."""
        words = list(words)
        found, base_blocks = self._asked(tokenizer, n, lambda index, base_blocks: index.search(words, k, base_blocks))
        a, text = self.mem.attachment, self.text
        if n > base_blocks:  # a session's turns, after the memory's blocks
            if text.turns is None or text.turns[0]() is not a.owner:
                if text.turns is not None:
                    text.turns[1].close()
                text.turns = (weakref.ref(a.owner), TextIndex.in_memory(text.digest))
            self._sync(text.turns[1], base_blocks, n)
            found = sorted(found + [(base_blocks + b, s) for b, s in text.turns[1].search(words, k, n - base_blocks)],
                           key=lambda bs: -bs[1])[:k]
        return found
