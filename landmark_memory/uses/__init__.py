"""What a user does with a memory, over the engine's one door (``memory.LandmarkMemory``):

    answer.py     asking a memory: the answer and the passages it read; a session's turns
    question.py   a question read into a memory: whether it can be asked, what it searches with, its own
                  tokens, a reader's blocks
    evidence.py   a question's evidence read by retrieval heads token by token: blocks, a quote
    search.py     the passages a question points at, without generating: text index and heads fused
    choose_heads.py  choosing a model's retrieval heads on development questions
    session.py    a session: a named conversation in a memory of its own over a memory
    corpus.py     a corpus: documents read apart, their blocks merged into one memory
    inspect.py    a saved memory read without its model: describe (info) and verify
    hf_cache.py   LandmarkMemoryCache: a memory as a transformers Cache for ``generate``
"""
