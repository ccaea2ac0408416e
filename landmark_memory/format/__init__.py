"""A memory's on-disk format: what its folder holds, how a commit writes it and opening reads
it back, with no model and no engine (docs/design/format.md, "On-disk format"). One job per module:

    options.py    MemoryOptions: what a memory searches, stores and reads; validated once
    shape.py      ModelShape: the sizes a memory's files depend on, a block's rows
    errors.py     MemoryFileError, WriterBusyError, NoMemoryError
    documents.py  InputRecord, DocumentList: a memory's inputs; a corpus's in pages, read when asked
    manifest.py   the manifest's typed records and the row files' byte layout
    directory.py  the files of a saved memory and the commit protocol
    seals.py      a writer's seals: the key files as it let them go; the next reads only those changed
    text_index.py the blocks' text in SQLite FTS5, ranked by BM25; checked, appended, sealed
    text_file.py  the text index's file read as hostile: its seal, bounded checks, damage, info and verify
    token_rows.py the blocks' token ids, as they were added
    session_files.py  a memory's sessions as files: names, turn logs checked, list, delete
    corpus_files.py   a corpus's document folders: their states, their keys, what a merge drops
"""

from .directory import MemoryDir
from .errors import NoMemoryError
from .manifest import InputRecord, Manifest, MemoryFileError
from .options import MAPPINGS, QUERY_OPTIONS, RETRIEVALS, MemoryOptions, default_chunk_size
from .shape import ModelShape

__all__ = ["InputRecord", "MAPPINGS", "Manifest", "MemoryDir", "MemoryFileError", "MemoryOptions", "ModelShape",
           "NoMemoryError", "QUERY_OPTIONS", "RETRIEVALS", "default_chunk_size"]
