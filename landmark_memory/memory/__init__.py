"""The memory: a landmark model reading inputs of any length chunk by chunk, each query
retrieving its top-k blocks (docs/DESIGN.md). One job per part:

    options.py    MemoryOptions: what a memory searches, stores and reads; validated once
    retrieval.py  the retrieval policy as pure functions: top-k selection, block positions
    blocks.py     BlockMemory: landmark keys, FAISS indexes, block store and hot cache, and
                  what a commit writes of them and opening reads back
    landmark_keys.py  the landmark key rows and their indexes per (stream, layer, kv head)
    key_sums.py   running sums of the landmark keys (the mean key that centring subtracts)
    token_rows.py the blocks' token ids, as they were added
    manifest.py   the manifest's typed records and the row files' byte layout
    documents.py  InputRecord, DocumentList: a memory's inputs; a corpus's in pages, read when asked
    errors.py     MemoryFileError, WriterBusyError, NoMemoryError
    shape.py      ModelShape: the sizes a memory's files depend on, a block's rows
    directory.py  the files of a saved memory and the commit protocol
    seals.py      a writer's seals: the key files as it let them go; the next reads only those changed
    saved.py      SavedFiles, a memory's folder and its commits; open_folder
    engine.py     LandmarkMemory: its parts together and the one door to them: forward, commit,
                  open, refresh, and what sessions, corpora and served shares ask of a memory
    generating.py generate: a prompt, then token after token, over the engine's forward
    lookup.py     BlockLookup, which blocks each query reads: landmark scores, policy, positions
    decoding.py   Decoder, the open chunk and the step that reads tokens through the memory
    corpus.py     a corpus: documents read apart, merged into one memory; their states
    session.py    a session: a named conversation in a memory of its own over a memory
    session_files.py  a memory's sessions as files: names, turn logs checked, list, delete
    outputs.py    MemoryOutput, RetrievalStats: what the engine returns and counts
    inspect.py    a saved memory read without its model: describe (info) and verify
    answer.py     asking a memory: the answer and the passages it read; a session's turns
    evidence.py   a question's evidence read by retrieval heads token by token: blocks, a quote
    choose_heads.py  choosing a model's retrieval heads on development questions
    hf_cache.py   LandmarkMemoryCache: a memory as a transformers Cache for ``generate``
"""

from ..models.fingerprint import model_fingerprint
from .blocks import BlockMemory
from .directory import MemoryDir
from .engine import LandmarkMemory
from .manifest import InputRecord, Manifest, MemoryFileError
from .options import MAPPINGS, QUERY_OPTIONS, RETRIEVALS, MemoryOptions, default_chunk_size
from .outputs import MemoryOutput, RetrievalStats
from .shape import ModelShape

__all__ = ["BlockMemory", "InputRecord", "LandmarkMemory", "MAPPINGS", "Manifest", "MemoryDir", "MemoryFileError",
           "MemoryOptions", "MemoryOutput", "ModelShape", "QUERY_OPTIONS", "RETRIEVALS", "RetrievalStats",
           "default_chunk_size", "model_fingerprint"]
