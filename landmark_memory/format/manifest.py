"""The manifest of a saved memory as typed records, and the byte layout of its row files.

``manifest.json`` (docs/design/format.md, "On-disk format") is written from a ``Manifest`` and read back into
one; nothing else reads its JSON. ``RowLayout`` owns the layout of ``tokens.bin`` (one row per block,
token ids as int32 (streams, block_size)) and of the landmark keys: from format 5 one file per (stream,
layer, key/value head) of float32 rows (``key_file``), before it the rows of ``landmarks.bin`` (every
layer and key/value head's keys of a block, (streams, n_layer, n_kv_head, head_dim) in the model's dtype), still read.
"""

import re
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..core.names import BLOCK_KEYS, DISK_STORES, MAX_STREAMS
from ..index import KINDS
from ..storage import DTYPES
from .documents import PAGE_DOCUMENTS, DocumentList, InputRecord
from .errors import MemoryFileError
from .options import MemoryOptions
from .shape import ModelShape

FORMAT = "landmark-memory/memory"
# 2: the manifest's model has a shape (grouped-query attention); 3: checksums; 4: corpora of documents; 5: landmark keys
# in keys/ (a file per stream, layer and key/value head, mapped), no exact flat index in the state file (it searches
# those files), and no state file when there is nothing else to keep; 6: blocks without landmarks (options.block_keys
# "mean", model.shape.landmarks false), which a reader of format 5 would misread; 7: a corpus's small documents packed
# into its own store (``InputRecord.packed``), their folders removed; 8: an ivf-rows level's runs (``index.lists``)
FORMAT_VERSION = 8
TOKENS, LANDMARKS, KEYS = "tokens.bin", "landmarks.bin", "keys"
DOCUMENT_FOLDER = re.compile(r"docs/[0-9a-f]{16}")  # a corpus's documents, named by their content's sha256
SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: text no UTF-8 file holds (a name not UTF-8)


def key_file(stream: int, layer: int, head: int) -> str:
    """The file of the landmark keys of one (stream, layer, key/value head), relative to the memory."""
    return f"{KEYS}/s{stream}_l{layer}_h{head}.f32"


def document_folder(sha256: str) -> str:
    """Where a corpus keeps the document whose text has this sha256, relative to the memory."""
    return f"docs/{sha256[:16]}"


WINDOW = "window."  # a sliding-window layer's window in a state file: window.<model layer>.k and .v


MAX_SHAPE = 1 << 16  # layers, key/value heads, head width or block size a manifest may say a model has
MAX_KEY_FILES = 1 << 20  # streams x layers x key/value heads: a key file and an index each


@dataclass(frozen=True)
class ModelRecord:
    """The model a memory was built with: only that model may read it."""

    fingerprint: str
    config: dict
    shape: ModelShape
    dtype: str
    name: str = ""  # as the user named it (``kinds.model_name``): "bundled", a named model, a folder
    tokenizer: str = ""  # sha256 of what turned text into ids (``kinds.tokenizer_digest``); "" where unknown


@dataclass(frozen=True)
class BaseRecord:
    """The memory a session is held over, as the session's last turn read it: its ``blocks``
    and a ``digest`` of what they are. A corpus only appends documents: the digest is of its
    first ``documents`` documents' records; another memory (``documents`` 0) must stay as it
    was, and its digest is of its whole commit (``base_record``)."""

    blocks: int
    documents: int
    digest: str


@dataclass(frozen=True)
class SessionRecord:
    """A session (``uses/session.py``): its ``name``, the memory it is held over (``over``),
    its turns and the committed bytes of ``turns.jsonl`` that hold them."""

    name: str
    over: BaseRecord
    turns: int = 0
    turns_bytes: int = 0


@dataclass(frozen=True)
class StateFile:
    """The per-commit state file and what its bytes must be."""

    name: str
    bytes: int
    sha256: str


@dataclass
class Manifest:
    model: ModelRecord
    options: MemoryOptions
    streams: int | None = None  # batch size, fixed by the first forward
    blocks: int = 0  # blocks per stream
    tokens: int = 0  # normal tokens per stream
    pending_tokens: int = 0  # of those, in the open chunk
    inputs: DocumentList = field(default_factory=DocumentList)  # (a list is taken as the records of one)
    commit: int = 0
    state: StateFile | None = None  # None until the first tokens are committed
    rows_crc: dict[str, int] | None = None  # CRC-32 of the committed rows per row file (format 3 on)
    updated: str = ""
    documents: bool = False  # a corpus (format 4): inputs are documents, their blocks in their own stores
    # a corpus's document whose rows (token rows, landmark keys, index state) its corpus holds: dropped
    # here once the corpus committed them (``corpus_files.drop_merged_rows``); its store is the corpus's too
    rows_merged: bool = False
    version: int = FORMAT_VERSION  # as read (a commit writes FORMAT_VERSION)
    session: SessionRecord | None = None  # a session's memory: its blocks follow those of the memory it is over
    keeps_runs = property(lambda self: self.version >= 8, doc="An ivf-rows level keeps its runs (format 8 on).")

    def __post_init__(self):
        if not isinstance(self.inputs, DocumentList):
            self.inputs = DocumentList(self.inputs, paged=self.documents)

    @property
    def rows(self) -> "RowLayout":
        return RowLayout(self.streams or 0, self.model.shape, DTYPES[self.model.dtype], self.version < 5)

    def key_files(self) -> list[str]:
        """The memory's key files (format 5; none before it, whose keys are in ``landmarks.bin``)."""
        s = self.model.shape
        return [key_file(b, layer, h) for b in range(self.streams or 0) for layer in range(s.n_layer)
                for h in range(s.n_kv_head)] if self.version >= 5 else []

    def index_files(self) -> dict[str, int]:
        """``{file: committed bytes}``: what the index kind keeps beside each key file at this commit
        (``LandmarkIndex.saved_files``: an ivf-rows index's centroids, lists and runs; most kinds none)."""
        o, saved_files, D = self.options, KINDS[self.options.index].make.saved_files, self.model.shape.head_dim
        return {name: nbytes for key in self.key_files()
                for name, nbytes in saved_files(key, self.blocks, o.train_size, D, self.keeps_runs).items()}

    def key_file_bytes(self) -> dict[str, int]:
        """``{file: committed bytes}`` of every key file and of every file its index keeps beside them."""
        return {**{name: self.blocks * self.rows.key_row_bytes for name in self.key_files()}, **self.index_files()}

    def pending_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the open chunk's entries in the state file: its token ids (streams, P) and
        per layer its un-rotated keys and values (streams, H_kv, P with landmarks, D)."""
        s, P, B = self.model.shape, self.pending_tokens, self.streams
        kv = (B, s.n_kv_head, s.rows_of(P), s.head_dim)
        return {"pending_ids": (B, P), **{f"pending.{layer}.{n}": kv for layer in range(s.n_layer) for n in "kv"}} \
            if P else {}

    def window_entries(self, state: dict) -> tuple[dict[int, tuple[str, str]], list[str]]:
        """The sliding-window layers' windows in a commit's ``state``: ``({model layer: (key
        entry, value entry)}, entries that do not fit)``; one fits when it is a layer's that
        keeps no memory, with both entries (streams, H_kv, 1 to window - 1, D)."""
        s, found, wrong = self.model.shape, {}, []
        for name in sorted(k for k in state if k.startswith(WINDOW) and k.endswith(".k")):
            layer, v = name[len(WINDOW):-2], f"{name[:-2]}.v"
            W = s.window_layers.get(int(layer), 0) if layer.isdigit() else 0
            shape = tuple(state[name].shape)
            if W and v in state and tuple(state[v].shape) == shape and len(shape) == 4 and 0 < shape[2] < W and (
                    shape[0], shape[1], shape[3]) == (self.streams, s.n_kv_head, s.head_dim):
                found[int(layer)] = name, v
            else:
                wrong.append(name)
        lone = [k for k in state if k.startswith(WINDOW) and k.endswith(".v") and k[:-2] + ".k" not in state]
        return found, wrong + lone

    @property
    def block_bytes(self) -> int:
        """Stored bytes of one block of one stream, all layers."""
        return self.model.shape.block_bytes(self.options.store_dtype)

    def to_json(self) -> dict:
        listed = self.inputs
        if listed.paged and listed.tail:
            raise ValueError("a corpus's new documents go into its pages (DocumentList.write) before its manifest")
        inputs = {"inputs": [], "pages": [list(asdict(p).values()) for p in listed.pages],
                  "shards": [[s.start, s.blocks, s.name] for s in listed.shards],
                  **({"digests_crc32": listed.digests_crc} if listed.digests_crc is not None else {})} \
            if listed.paged else \
            {"inputs": [asdict(e) for e in listed.tail]}
        return {"format": FORMAT, "format_version": FORMAT_VERSION,
                "model": asdict(self.model), "options": self.options.to_dict(),
                "streams": self.streams, "blocks": self.blocks, "tokens": self.tokens,
                "pending_tokens": self.pending_tokens, **inputs,
                "documents": self.documents, **({"rows_merged": True} if self.rows_merged else {}),
                **({"session": asdict(self.session)} if self.session else {}),
                "commit": self.commit,
                "files": {**({"state": asdict(self.state)} if self.state else {}),
                          **({"rows_crc32": self.rows_crc} if self.rows_crc else {})},
                "updated": self.updated}

    @classmethod
    def from_json(cls, doc: dict, where: str) -> "Manifest":
        """The manifest in ``doc`` (read from ``where``); format 1 is upgraded, a newer format or
        a missing entry raises ``MemoryFileError``."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise MemoryFileError(f"{where} is not a landmark-memory manifest; restore the memory or rebuild it")
        version = doc.get("format_version", 0)
        if type(version) is not int or version < 0:
            raise MemoryFileError(f"{where} holds format_version = {version!r}, which is no format; the memory is "
                                  "damaged: restore it from a backup or rebuild it")
        if version > FORMAT_VERSION:
            raise MemoryFileError(f"{where} was written by a newer landmark-memory (memory format {version}, this "
                                  f"one reads up to {FORMAT_VERSION}); upgrade the package")
        try:
            model, files = doc["model"], doc["files"]
            cfg = model["config"]
            shape = model.get("shape") if version >= 2 else {  # format 1: LandmarkGPT, one key/value head per head
                "n_layer": cfg["n_layer"], "n_kv_head": cfg["n_head"], "head_dim": cfg["n_embd"] // cfg["n_head"],
                "block_size": cfg["block_size"]}
            shape = {**shape, "windows": tuple(shape.get("windows", ()))}  # (JSON gives a list; none before Gemma 3)
            options = doc["options"]
            if version < 6:  # before format 6 every memory was a landmark memory of its model's block size
                options = {"block_size": shape["block_size"], **options}
            m = cls(model=ModelRecord(model["fingerprint"], cfg, ModelShape(**shape), model["dtype"],
                                      model.get("name", ""), model.get("tokenizer", "")),
                    options=MemoryOptions.from_dict(options), streams=doc["streams"], blocks=doc["blocks"],
                    tokens=doc["tokens"], pending_tokens=doc["pending_tokens"],
                    inputs=DocumentList.of_manifest(doc, shape["block_size"]), commit=doc["commit"],
                    state=StateFile(**files["state"]) if "state" in files else None,
                    rows_crc=files.get("rows_crc32"), updated=doc.get("updated", ""),
                    documents=bool(doc.get("documents", False)), rows_merged=doc.get("rows_merged", False),
                    version=version, session=_session_record(doc.get("session")))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            why = str(e) if str(e).isprintable() else repr(str(e))  # (a key of the file's may hold a line break)
            raise MemoryFileError(f"{where} lacks or garbles an entry ({why}); the memory is damaged: restore it "
                                  "from a backup or rebuild it") from None
        m._check(where)
        return m

    def _check(self, where: str) -> None:
        """Every entry of the right type and in range, and the counts consistent with each
        other and the model's shape; else ``MemoryFileError`` naming the first that is not."""
        def bad(entry, why):
            return MemoryFileError(f"{where} holds {entry} {why}; the memory is damaged: restore it from a backup "
                                   "or rebuild it")

        def count(entry, value, least=0):
            if type(value) is not int or value < least:
                raise bad(f"{entry} = {value!r}", f"(not an integer >= {least})")

        s = self.model.shape
        for name in ("n_layer", "n_kv_head", "head_dim", "block_size"):
            count(f"model.shape.{name}", getattr(s, name), 1)
            if getattr(s, name) > MAX_SHAPE:  # no model's: what is made per layer and head must fit in memory
                raise bad(f"model.shape.{name} = {getattr(s, name):,}", f"(at most {MAX_SHAPE:,})")
        for w in s.windows:
            count("an entry of model.shape.windows", w)
        if s.windows and len(s.memory_layers) != s.n_layer:
            raise bad(f"model.shape.windows = {list(s.windows)}", f"(it must name n_layer = {s.n_layer} layers with a "
                      "memory, 0 each)")
        if not all(isinstance(x, str) for x in (self.model.fingerprint, self.model.tokenizer, self.model.name)) or \
                not isinstance(self.model.config, dict):
            raise bad("model", "with a fingerprint, name or tokenizer that is no string or a config that is no object")
        if not isinstance(self.model.dtype, str) or self.model.dtype not in DTYPES:  # (a list is no key)
            raise bad(f"model.dtype = {self.model.dtype!r}", f"(not one of {', '.join(DTYPES)})")
        if self.streams is not None:
            count("streams", self.streams, 1)
            if self.streams > MAX_STREAMS:  # its files and indexes are per stream: no such memory was written
                raise bad(f"streams = {self.streams:,}", f"(a memory holds at most {MAX_STREAMS:,})")
            if self.streams * s.n_layer * s.n_kv_head > MAX_KEY_FILES:
                raise bad(f"streams = {self.streams:,} of {s.n_layer:,} layers of {s.n_kv_head:,} key/value heads",
                          f"(a key file each: at most {MAX_KEY_FILES:,})")
        if type(self.rows_merged) is not bool or (self.rows_merged and self.documents):
            raise bad(f"rows_merged = {self.rows_merged!r}", "(true or false, and only in a corpus's document)")
        for name in ("blocks", "tokens", "pending_tokens", "commit"):
            count(name, getattr(self, name))
        if self.streams is None and self.tokens:  # the first forward, which read them, fixed it
            raise bad("streams = None", f"(a memory of {self.tokens:,} tokens has read them in streams)")
        if self.tokens != (held := self.blocks * s.block_size + self.pending_tokens):
            raise bad(f"tokens = {self.tokens:,}", f"where its {self.blocks:,} blocks of {s.block_size} and "
                      f"{self.pending_tokens:,} pending tokens make {held:,}")
        if self.options.store not in DISK_STORES:  # (missing, it reads as the default: blocks in memory)
            raise bad(f"options.store = {self.options.store!r}", f"(a saved memory keeps its blocks in one of "
                      f"{', '.join(DISK_STORES)})")
        if self.options.block_keys not in BLOCK_KEYS:
            raise MemoryFileError(f"{where} searches its blocks by {self.options.block_keys!r}, which this landmark-"
                                  f"memory does not know ({', '.join(BLOCK_KEYS)}): upgrade it, or rebuild the memory")
        try:
            resolved = self.options.resolved(s.block_size if s.landmarks else None, self.model.dtype,
                                             self.model.config.get("cmt") is True, s.head_dim)
        except (ValueError, TypeError) as e:
            raise bad("options", f"that are not valid ({e})") from None
        if resolved != self.options:  # a memory's options are saved with every default filled in
            raise bad("options", "that lack a chunk size, a store dtype, block keys, a block size or what queries read")
        if type(s.landmarks) is not bool or (resolved.block_keys == "landmark") != s.landmarks or \
                resolved.block_size != s.block_size:  # one fact, recorded twice: they agree
            raise bad(f"options.block_keys = {resolved.block_keys!r} and block_size = {resolved.block_size}",
                      f"where model.shape says landmarks = {s.landmarks!r} and block_size = {s.block_size}")
        for e in self.inputs.tail:
            self.check_input(e, where)
        self._check_pages(bad, count)
        if self.state is not None and (type(self.state.bytes) is not int or not isinstance(self.state.sha256, str)
                                       or not isinstance(self.state.name, str)):
            raise bad("files.state", "with a name or sha256 that is no string, or a size that is no integer")
        r = self.session
        if r is not None:
            if not isinstance(r.name, str) or not isinstance(r.over.digest, str) or self.documents or len(self.inputs) \
                    or (self.streams or 1) != 1:
                raise bad("session", "that is no session's record (a name and digest that are strings, one stream, "
                          "no inputs)")
            for name in ("turns", "turns_bytes"):
                count(f"session.{name}", getattr(r, name))
            for name in ("blocks", "documents"):
                count(f"session.over.{name}", getattr(r.over, name))
        if self.rows_crc is not None and (not isinstance(self.rows_crc, dict) or not all(
                isinstance(k, str) and type(v) is int for k, v in self.rows_crc.items())):
            raise bad("files.rows_crc32", "that is not a map of file names to CRC-32s")

    def check_input(self, e: InputRecord, where: str) -> None:
        """``MemoryFileError`` unless the input record ``e`` (from ``where``) is one of this commit's."""
        def bad(why):
            return MemoryFileError(f"{where} holds the input {str(e.name)!r} {why}; the memory is damaged: restore "
                                   "it from a backup or rebuild it")

        if not all(type(getattr(e, n)) is int and getattr(e, n) >= 0 for n in ("tokens", "ingested", "start")):
            raise bad("with a count that is no integer >= 0")
        if not all(isinstance(v, str) and not SURROGATE.search(v) for v in (e.path, e.name, e.sha256)) \
                or not isinstance(e.abandoned, bool) or not isinstance(e.document, (str, type(None))) \
                or not isinstance(e.packed, bool):
            raise bad("with a path, name, sha256, document or flag of the wrong type, or text that is not UTF-8")
        if e.packed and (not self.documents or e.document is None):
            raise bad("packed into a memory that is no corpus")
        if (e.document is None) == self.documents or (e.document is not None and not DOCUMENT_FOLDER.fullmatch(
                e.document)):
            raise bad(f"naming a document folder {e.document!r} that is no document of the memory")
        if e.document is not None and e.document != document_folder(e.sha256):
            raise bad(f"whose document folder {e.document!r} is not named by its sha256")
        if e.start + e.ingested > self.tokens:
            raise bad(f"ending at token {e.start + e.ingested:,}, past the memory's {self.tokens:,}")

    def _check_pages(self, bad, count) -> None:
        """A paged document list's pages and shards in range and in order (their records are
        checked as their pages are read)."""
        listed, start = self.inputs, 0
        if listed.paged != self.documents:
            raise bad("pages", "in a memory that is no corpus")
        if listed.digests_crc is not None:
            count("digests_crc32", listed.digests_crc)
        for i, p in enumerate(listed.pages):
            for name in ("count", "bytes", "crc32", "start"):
                count(f"pages[{i}].{name}", getattr(p, name))
            if not 0 < p.count <= PAGE_DOCUMENTS or (p.count < PAGE_DOCUMENTS and i < len(listed.pages) - 1) or \
                    p.start < start or p.start > self.tokens or p.bytes > (1 << 40):
                raise bad(f"pages[{i}]", f"out of order or range (pages hold 1 to {PAGE_DOCUMENTS:,} documents, all "
                          "but the last full, in the order their tokens start)")
            start = p.start
        end = 0
        for i, sh in enumerate(listed.shards):
            count(f"shards[{i}].start", sh.start)
            count(f"shards[{i}].blocks", sh.blocks)
            if sh.start < end or sh.start + sh.blocks > self.blocks or not isinstance(sh.name, str) or \
                    not DOCUMENT_FOLDER.fullmatch(sh.name):
                raise bad(f"shards[{i}]", "out of order or range, or naming no document folder")
            end = sh.start + sh.blocks


def _session_record(doc) -> SessionRecord | None:
    if doc is None:
        return None
    return SessionRecord(**{**doc, "over": BaseRecord(**doc["over"])})


@dataclass(frozen=True)
class RowLayout:
    """Bytes of one block's row in the files read whole when a memory opens, for ``streams``
    streams: ``tokens.bin``, and ``landmarks.bin`` in a memory from before key files (``legacy``)."""

    streams: int
    shape: ModelShape
    dtype: torch.dtype
    legacy: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        s = self.shape
        return {TOKENS: self.streams * s.block_size * 4, **({LANDMARKS: self.streams * s.n_layer * s.n_kv_head *
                                                            s.head_dim * self.dtype.itemsize} if self.legacy else {})}

    @property
    def key_row_bytes(self) -> int:
        """Bytes of one block's row in a key file: a float32 key."""
        return self.shape.head_dim * 4

    def encode_tokens(self, ids: np.ndarray) -> bytes:
        """Rows of token ids ``ids`` int (streams, n * block_size) of n blocks."""
        n = ids.shape[1] // self.shape.block_size
        return np.ascontiguousarray(ids.reshape(self.streams, n, -1).transpose(1, 0, 2), np.int32).tobytes()

    def decode_tokens(self, data: bytes) -> np.ndarray:
        """int32 (n, streams, block_size) token ids of n rows."""
        return np.frombuffer(data, np.int32).reshape(-1, self.streams, self.shape.block_size)

    def decode_landmarks(self, data: bytes, device: torch.device) -> list[torch.Tensor]:
        """Per layer the landmark keys (streams, H_kv, n, D) of n rows of ``landmarks.bin``."""
        s = self.shape
        lm = torch.frombuffer(bytearray(data), dtype=self.dtype).view(-1, self.streams, s.n_layer, s.n_kv_head,
                                                                       s.head_dim).to(device)
        return [lm[:, :, layer].permute(1, 2, 0, 3).contiguous() for layer in range(s.n_layer)]
