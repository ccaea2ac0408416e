"""LandmarkMemory: chunked inference over inputs of any length with top-k block retrieval.

A memory is a few private parts, each handed what it works on (docs/DESIGN.md, "The memory's
parts"): ``_blocks`` (``BlockMemory``, blocks.py: block keys, indexes, block store, hot
cache), ``_lookup`` (``BlockLookup``, lookup.py: which blocks each query reads, and the options),
``_decoder`` (``Decoder``, decoding.py: the open chunk and the step that reads tokens through the
memory), ``_files`` (``SavedFiles``, saved.py: the folder and its commits) and ``_text``
(``MemoryText``, text.py: its text index, kept by its writer's commits). This class holds
them together and is the one door to them: reading, querying, committing and opening, and what
sessions and corpora ask of a memory (under "the library's own"); what goes between processes is
``transfer`` (transfer.py), what experiments and tests look at ``inspection`` (inspection.py),
the text index ``text_index`` (text.py).

Chunk boundaries are absolute (every ``chunk_size`` normal tokens from the start; a document's
end, ``end_document``, closes its chunk early), and the tokens since the last boundary stay local:
a text fed in one call, in pieces or a token at a time (decoding) gives the same result.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..core.layout import IGNORE_INDEX
from ..core.names import DISK_STORES, MAX_STREAMS
from ..format.directory import MemoryDir
from ..format.documents import DocumentList
from ..format.manifest import Manifest, ModelRecord
from ..format.options import QUERY_OPTIONS, MemoryOptions
from ..format.shape import ModelShape
from ..kernels import BACKENDS
from ..models.fingerprint import model_fingerprint
from ..models.kinds import backbone_for
from ..storage import DTYPE_NAMES
from .attachment import AttachedBlocks, Attachment
from .blocks import BlockMemory
from .decoding import Decoder, OpenChunk
from .generating import generate
from .inspection import MemoryInspection
from .lookup import BlockLookup
from .outputs import MemoryOutput, RetrievalStats
from .saved import Opened, SavedFiles, open_folder, saved_chunk
from .text import MemoryText, TextSearch
from .transfer import BlockTransfer

LOGITS = ("all", "last", "none")  # what ``forward`` computes of the output head


class LandmarkMemory:
    """A landmark model with a memory of past blocks.

    Parameters
    ----------
    model : LandmarkGPT with ``attention="landmark"``, or a Hugging Face causal LM of a family we
        read, converted by ``landmark_memory.models.hf.convert`` or as published, which a memory
        reads without landmarks (``MemoryOptions.block_keys``; ``kinds.py``).
    options : MemoryOptions, how the memory searches, stores and reads (``format/options.py``
        says what each option means); or, instead, the options as keyword ``settings``
        (``LandmarkMemory(model, top_k=8, store="lmdb", path=...)``), the rest default.
    path : str or Path, folder of a saved memory (created; reopen it with ``LandmarkMemory.open``).
    cache_bytes : int, hot-block cache budget on the model's device.
    backend : str, attention backend ("auto": Triton on CUDA, dense PyTorch elsewhere).
    documents : bool, a saved corpus: its blocks are documents read apart and merged in
        (``uses/corpus.py``), read from their own stores; it takes no text of its own.
    opened : a saved memory's folder as ``LandmarkMemory.open`` found it (``saved.Opened``),
        which the memory takes instead of being made empty; ``open``'s to pass.

    Attributes
    ----------
    options : MemoryOptions, resolved for the model (defaults filled in).
    retrieval_stats : RetrievalStats.
    inputs : list of InputRecord, the text files ``build`` ingested.
    device : torch.device, the model's, where ``forward`` takes its token ids.
    attachment : Attachment, the session whose blocks follow this read-only memory's saved ones
        (``uses/session.py``) and where they start; None.
    """

    def __init__(self, model: torch.nn.Module, options: MemoryOptions | None = None, *,
                 path: str | Path | None = None, cache_bytes: int = 256 << 20, backend: str = "auto",
                 documents: bool = False, opened: Opened | None = None, **settings):
        if options is not None and settings:
            raise TypeError(f"give the memory's options as one MemoryOptions or as keyword settings, not both "
                            f"({', '.join(settings)})")
        if backend not in BACKENDS:  # the kernel is called unchecked at every layer
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        bb = backbone_for(model)
        with torch.no_grad():
            cmt_keys = bb.cmt_keys()
        param = next(model.parameters())
        options = options if options is not None else MemoryOptions.of(**settings)
        o = options.for_model(model, bb, cmt_keys)
        self.model, self.backbone, self._backend = model.eval(), bb, backend
        windows = tuple(bb.windows) if any(bb.windows) else ()
        self.shape = ModelShape(bb.n_layer - sum(map(bool, windows)), bb.n_kv_head, bb.head_dim, o.block_size, windows,
                                landmarks=o.block_keys == "landmark")
        self.device, self._dtype, self._cache_bytes = param.device, param.dtype, cache_bytes
        self._cmt_k = cmt_keys if self.shape.landmarks else None  # per layer the CMT's key at position -1, (1, H, 1, D)
        self.retrieval_stats = RetrievalStats()
        self.inputs = DocumentList(paged=documents)
        self.attachment = None
        self._text = MemoryText()
        self._fingerprint, self._closed = None if opened is None else opened.fingerprint, False
        if opened is not None:
            m = opened.manifest
            self._files = SavedFiles(opened.dir, opened.readonly, m.documents)
            self._parts(self._new_blocks(o, opened.readonly, key_files=m.version >= 5 or not opened.readonly), o)
            try:
                self._follow(m, opened.state)
            except BaseException:
                self._blocks.close()
                raise
            return
        if documents and path is None:
            raise ValueError("a corpus of documents is a saved memory: pass a path")
        if path is not None and o.store == "memory":
            raise ValueError(f"a memory saved at a path keeps its blocks on disk: pass store= one of {DISK_STORES}")
        created = None if path is None else Manifest(model=self._model_record(), options=o, documents=documents)
        self._files = SavedFiles(None if path is None else MemoryDir.create(path, created), documents=documents,
                                 created=created)
        self._parts(self._new_blocks(o, readonly=False), o)

    def _new_blocks(self, options: MemoryOptions, readonly: bool, key_files: bool = True) -> BlockMemory:
        """The memory's blocks, none yet; a corpus reads its documents' from their stores or, packed,
        from its own (``BlockMemory.add_document``). ``key_files``: its block keys are (or, for a writer, will
        be) in its key files; else in memory (a reader of a memory from before them)."""
        d, documents = self._files.dir, self._files.documents
        return BlockMemory(self.shape, options, store_path=None if d is None else d.store_path(),
                           readonly=readonly, device=self.device, dtype=self._dtype, rope=self.backbone.rope,
                           cache_bytes=self._cache_bytes, shards=[] if documents else None,
                           shard_path=lambda name: d.document(name).store_path(),
                           key_path=d.key_path() if d is not None and key_files else None)

    def _parts(self, blocks: BlockMemory, options: MemoryOptions) -> None:
        """Put the parts together around ``blocks``; the lookup holds the ``options`` (``options``)."""
        self._blocks = blocks
        bb = self.backbone
        self._lookup = BlockLookup(blocks, options, key_row=self.shape.key_row, group=bb.n_head // bb.n_kv_head,
                                   rope=bb.rope, scale=bb.scale, stats=self.retrieval_stats)
        self._decoder = Decoder(bb, self.shape, blocks, self._lookup, self._cmt_k, self._backend)

    inspection = property(lambda self: MemoryInspection(self._blocks, self._decoder, self.forward),
                          doc="``MemoryInspection``: what experiments and tests look at inside the memory "
                              "(made when asked: one kept would hold ``forward``, a cycle through the memory).")
    transfer = property(lambda self: BlockTransfer(self._blocks, self.readonly),
                        doc="``BlockTransfer``: the memory's blocks handed between processes.")
    text_index = property(lambda self: TextSearch(self, self._text),
                          doc="``TextSearch``: the memory's text index (text.py), kept by its writer at every "
                              "commit once asked to keep it, searched by a question's words.")
    options = property(lambda self: self._lookup.options,
                       doc="MemoryOptions, resolved for the model (defaults filled in); ``querying`` changes some.")

    # ---- public -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, logits: str = "all",
                retrieved: bool = True) -> MemoryOutput:
        """Feed normal token ids ``idx`` (B, T); returns ``MemoryOutput``. ``logits``: ``"all"``
        (B, T, vocab); ``"last"`` (B, 1, vocab), all that generating after a prompt needs;
        ``"none"`` (B, 0, vocab), for reading text into memory (``build``): no output head.
        ``retrieved``: report the blocks each token chose (False: none, T x n_chosen ids a layer)."""
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"idx must be integer token ids of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        if targets is not None and (targets.shape != idx.shape or targets.dtype not in (torch.int32, torch.int64)
                                    or logits != "all"):
            raise ValueError(f"targets ({targets.dtype} {tuple(targets.shape)}) must be integer ids of idx's shape "
                             f"{tuple(idx.shape)}, and a loss needs every token's logits: logits='all', not {logits!r}")
        if self.streams is None:
            if idx.shape[0] > MAX_STREAMS:
                raise ValueError(f"a memory holds at most {MAX_STREAMS:,} streams; idx has batch size {idx.shape[0]:,}")
            self._blocks.start(idx.shape[0])
        elif idx.shape[0] != self.streams:
            raise ValueError(f"this memory holds {self.streams} streams; idx has batch size {idx.shape[0]}")
        idx = idx.to(self.device)
        out, chosen, pos = [], [], 0
        while pos < idx.shape[1]:
            n = min(self.options.chunk_size - self.pending_count, idx.shape[1] - pos)
            last = logits != "last" or pos + n == idx.shape[1]
            lg, ret = self._decoder.step(idx[:, pos:pos + n], logits if last else "none")
            out.append(lg)
            chosen += [ret] if retrieved else []
            pos += n
        V, H, top_k = self.backbone.vocab_size, self.backbone.n_head, self.options.top_k
        if len(out) == 1:  # one step (a chunk, or a token): nothing to join, and logits are large
            out, chosen = out[0], chosen[0] if retrieved else []
        else:
            out = torch.cat(out, 1) if out else idx.new_zeros((idx.shape[0], 0, V), dtype=self._dtype)
            chosen = [torch.cat([r[layer] for r in chosen], 2) if chosen
                      else idx.new_full((idx.shape[0], H, 0, top_k), -1)
                      for layer in range(self.shape.n_layer)] if retrieved else []
        loss = None
        if targets is not None:
            loss = F.cross_entropy(out.float().flatten(0, 1), targets.to(self.device, torch.long).flatten(),
                                   ignore_index=IGNORE_INDEX)
        return MemoryOutput(out, loss, chosen)

    __call__ = forward

    generate = generate
    streams = property(lambda self: self._blocks.streams, doc="Batch size, fixed by the first forward (None before).")
    n_blocks = property(lambda self: self._blocks.n_blocks, doc="Blocks in memory per stream.")
    n_tokens = property(lambda self: self.n_blocks * self.shape.block_size + self.pending_count,
                        doc="Normal tokens fed per stream.")
    pending_count = property(lambda self: self._decoder.pending_count,
                             doc="Tokens of the open chunk (fed since the last chunk boundary).")

    def tokens(self, stream: int = 0, first: int = 0, last: int | None = None) -> np.ndarray:
        """int32 ((last - first) * block_size,) the normal token ids of blocks ``[first, last)``
        in memory (default: every block)."""
        return self._blocks.tokens(stream, first, last)

    def keys(self, layer: int, blocks: torch.Tensor | slice, rows: bool = False, stream: int = 0) -> torch.Tensor:
        """float32 keys of ``stream``'s ``blocks`` (n,) at memory layer ``layer``: their block keys
        (landmark or mean keys) (H_kv, n, D), not rotated; with ``rows``, every row's key (n, H_kv,
        rows, D), rotated by its offset in its block (as a retrieved block's rows are read)."""
        if not rows:
            return self._blocks.block_keys(layer, blocks)[stream].float()
        return torch.stack(self._blocks.cache.get([(stream, layer, int(b)) for b in blocks]))[:, 0].float()

    @contextmanager
    def querying(self, **changes):
        """Query options (``QUERY_OPTIONS``, e.g. ``centre=True``) changed for what is fed
        inside the ``with`` block, the memory's own again after it (the indexes' search
        breadths are set when a memory opens: ``LandmarkMemory.open(..., nprobe=...)``)."""
        fixed = sorted(set(changes) - set(QUERY_OPTIONS))
        if fixed:
            raise ValueError(f"only {', '.join(QUERY_OPTIONS)} change while a memory is open, not {', '.join(fixed)}")
        own = self.options
        new = own.with_query(**changes).for_model(self.model, self.backbone, self._cmt_k)
        self._lookup.use(new)
        try:
            yield self
        finally:
            self._lookup.use(own)

    @contextmanager
    def reading(self, blocks: Sequence[int]):
        """Every query fed inside the ``with`` block reads the memory blocks ``blocks`` (at most
        ``top_k``) as the first of its top-k and chooses the rest among the other blocks by its
        landmark scores: a question's evidence, chosen by a question reader (``question.point``),
        read by every token of its answer at every layer. A sink or local block is read anyway."""
        ids = np.array([int(b) for b in blocks], np.int64)
        if len(ids) > self.options.top_k or len(set(ids.tolist())) < len(ids) or \
                ((ids < 0) | (ids >= self.n_blocks)).any():
            raise ValueError(f"reading takes at most top_k={self.options.top_k} distinct blocks of the memory's "
                             f"{self.n_blocks}, got {ids.tolist()}")
        own, self._lookup.pinned = self._lookup.pinned, ids
        try:
            yield self
        finally:
            self._lookup.pinned = own

    def end_document(self) -> None:
        """Put the open chunk's blocks into memory now, unfinished as the chunk is: a document
        ends here and nothing follows it. Its tokens must fill whole blocks."""
        if self.pending_count % self.shape.block_size:
            raise ValueError(f"a document ends on a block boundary: {self.pending_count} tokens of the open chunk "
                             f"are not a multiple of the block size {self.shape.block_size}")
        self._decoder.flush()

    observer = property(lambda self: self._decoder.observer, lambda self, fn: setattr(self._decoder, "observer", fn),
                        doc="Called at each memory layer of a step with what a question reader reads "
                            "(``Decoder.observer``; ``question.point``); None.")

    # ---- the library's own: sessions, corpora ---------------------------------------------------
    def attach(self, owner, blocks: AttachedBlocks, resume: bool) -> None:
        """Put ``blocks`` (a session's, ``owner``) after this rewound read-only memory's saved ones,
        and with ``resume`` continue after the open chunk their last commit kept: what it reads from
        here on goes into them, until ``rewind`` lets them go (``attachment`` says whose they are)."""
        self._blocks.attach(blocks.blocks)
        if resume:
            self._decoder.take(blocks.chunk)
        self.attachment = Attachment(owner, self._blocks.base)

    def add_document(self, shard, packed: bool, block_keys: list[torch.Tensor] | None, ids: np.ndarray,
                     source=None) -> None:
        """A corpus writer's next document (``corpus.merge_document``): its store as ``shard`` of the
        corpus's, or ``packed``, copied into the corpus's (from ``source``, a store of it read in RAM,
        if given); then its blocks' ``block_keys`` (per layer (1, H_kv, n, D)) and token ``ids`` (1,
        n * block_size), None when it has no block."""
        if self.streams is None:
            self._blocks.start(1)
        self._blocks.add_document(shard, packed, source)  # (a packed one's blocks copied before any key is searched)
        if block_keys is not None:
            self._blocks.add_blocks(block_keys, ids)

    # ---- saved ----------------------------------------------------------------------------
    dir = property(lambda self: self._files.dir, doc="The memory's folder, ``MemoryDir`` (None: not saved).")
    readonly = property(lambda self: self._files.readonly)
    documents = property(lambda self: self._files.documents, doc="A corpus: its blocks are its documents'.")
    manifest = property(lambda self: self._files.manifest,
                        doc="The last commit this memory wrote or read, ``Manifest``: a new folder's commit 0 "
                            "before its first; its ``model`` is the model the memory was built with (None: not saved).")

    def commit(self) -> int:
        """Make everything fed so far durable in the memory directory (docs/design/format.md, "Commit protocol");
        returns the commit number. A process killed at any instant leaves the memory at its last commit.
        A text index its writer keeps (``text_index.follow``) follows the commit, sealed."""
        manifest = Manifest(model=self._model_record(), options=self.options, streams=self.streams,
                            blocks=self.n_blocks, tokens=self.n_tokens, pending_tokens=self.pending_count,
                            inputs=self.inputs, documents=self.documents)
        number = self._files.commit(self._blocks, manifest, self.open_chunk())
        self.text_index.catch_up()
        return number

    @classmethod
    def open(cls, path: str | Path, model: torch.nn.Module, *, readonly: bool = False, cache_bytes: int = 256 << 20,
             backend: str = "auto", **options) -> "LandmarkMemory":
        """A saved memory, at its last commit, ready to continue as if it had never stopped.

        Parameters
        ----------
        path : str or Path, the memory directory.
        model : the model the memory was built with (checked by fingerprint).
        readonly : bool, read without the writer lock (any number of readers); text fed
            afterwards stays in this process and is never saved: ``rewind()`` forgets it,
            ``refresh()`` follows later commits.
        options : query-time settings to change (``QUERY_OPTIONS``: top_k, retrieval,
            position_mapping, max_blocks, cmt_cutoff, sink_blocks, local_blocks, centre; and the
            index's nprobe, ef_search). The rest was fixed when the memory was built.
        """
        opened = open_folder(path, model, readonly)
        try:
            return cls(model, opened.manifest.options.with_query(**options), cache_bytes=cache_bytes,
                       backend=backend, opened=opened)
        except BaseException:
            opened.dir.close()
            raise

    def refresh(self) -> bool:
        """Follow the memory's writer: take the blocks committed since this read-only memory
        opened or last refreshed, reading only what was appended (rows, documents' stores; an
        approximate index is read again from the state file). Text fed since is forgotten
        first (``rewind``). Answers then equal a fresh open's. Returns whether there was a new
        commit; a memory changed otherwise than by appending, or a file it maps cut short since
        (which would be a SIGBUS at the next read), raises ``MemoryFileError``."""
        if self.dir is None or not self.readonly:
            raise ValueError("only a saved memory opened read-only follows its writer's commits; a writable one "
                             "is the newest there is")
        newer = self._files.newer(self.inputs)
        self._blocks.check_files()
        if newer is None:
            return False
        self.rewind()
        self._follow(*newer)
        return True

    def _follow(self, manifest: Manifest, state: dict[str, torch.Tensor]) -> None:
        """Take the commit ``manifest`` (with its ``state``): the blocks it holds beyond this
        memory's, its documents' stores, its open chunk."""
        self._files.follow(self._blocks, manifest, state, self.backbone.vocab_size)
        self.inputs = manifest.inputs
        self._decoder.take(saved_chunk(self.dir, manifest, state, self.device, self._dtype))
        self._decoder.keep()

    def open_chunk(self) -> OpenChunk:
        """What was fed past the last block, as a commit keeps it."""
        return self._decoder.open_chunk()

    def rewind(self) -> None:
        """Forget what was fed to this read-only memory since it opened or last refreshed: it
        holds its commit again, exactly (the hot cache keeps the saved blocks it holds)."""
        if not self.readonly:
            raise ValueError("only a memory opened read-only rewinds; a writer keeps what it was fed (close it "
                             "with commit=False to drop what was fed since its last commit)")
        self._blocks.rewind()
        self._decoder.restore()
        self._lookup.forget()
        self.attachment = None

    def _model_record(self) -> ModelRecord:
        """The model this memory was built with, as its manifest records it (fingerprint first)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return ModelRecord(self._fingerprint, self.model.config.to_dict(), self.shape, DTYPE_NAMES[self._dtype],
                           getattr(self.model, "landmark_name", ""), getattr(self.model, "tokenizer_digest", ""))

    def close(self, commit: bool = True) -> None:
        """Release the store and the writer lock; a writable saved memory commits first
        (``commit=False`` drops what was fed since the last commit)."""
        if self._closed:
            return
        try:
            if commit and self.dir is not None and not self.readonly:
                self.commit()
        finally:  # a commit that failed (a full disk) leaves the last one standing: the files are let go all the same
            self._closed = True
            self._text.close()
            self._files.close(self._blocks.close())

    def __enter__(self) -> "LandmarkMemory":
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(commit=exc_type is None)
