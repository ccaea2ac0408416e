"""The engine: a landmark model reading inputs of any length chunk by chunk, each query
retrieving its top-k blocks (docs/DESIGN.md), over the files ``format/`` defines. One job per
part:

    retrieval.py  the retrieval policy as pure functions: top-k selection, block positions
    key_sums.py   running sums of the block keys (the mean key that centring subtracts)
    block_keys.py the block key rows (landmark or mean keys) and their indexes per (stream, layer, kv head)
    blocks.py     BlockMemory: block keys, FAISS indexes, block store and hot cache, and
                  what a commit writes of them and opening reads back
    lookup.py     BlockLookup, which blocks each query reads: landmark scores, policy, positions
    decoding.py   Decoder, the open chunk and the step that reads tokens through the memory
    saved.py      SavedFiles, a memory's folder and its commits; open_folder
    generating.py generate: a prompt, then token after token, over the engine's forward
    outputs.py    MemoryOutput, RetrievalStats: what the engine returns and counts
    attachment.py AttachedBlocks: a session's own blocks, read after a read-only memory's
    transfer.py   BlockTransfer: a memory's blocks between processes (served shares, documents)
    text.py       MemoryText, TextSearch: the memory's text index, kept by its writer's commits, searched by words
    inspection.py MemoryInspection: what experiments and tests look at inside a memory
    engine.py     LandmarkMemory: its parts together and the one door to them: forward, commit,
                  open, refresh, and what sessions and corpora ask of a memory
"""

from .engine import LandmarkMemory
from .outputs import MemoryOutput, RetrievalStats

__all__ = ["LandmarkMemory", "MemoryOutput", "RetrievalStats"]
