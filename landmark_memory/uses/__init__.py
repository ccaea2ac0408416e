"""What a user does with a memory, over the engine's one door (``memory.LandmarkMemory``):

    answer.py     asking a memory: the answer and the passages it read; a session's turns
    asking.py     what a question is asked with: its messages, the loaded model, the chat prompt
    answering/    the answer policies, one module each, and the registry that chooses one
    question.py   a question read into a memory: whether it can be asked, its words, their rarity, its
                  prompt and own tokens, what it searches with
    retrievers.py what ranks blocks for a question (text index, heads, reader), and their fusion
    evidence.py   a question's evidence read by retrieval heads token by token: blocks, a quote
    search.py     the passages a question points at, without generating: retrieved and fused
    choose_heads.py  choosing a model's retrieval heads on development questions
    session.py    a session: a named conversation in a memory of its own over a memory
    corpus.py     a corpus: documents read apart, their blocks merged into one memory
    inspect.py    a saved memory read without its model: describe (info) and verify
    hf_cache.py   LandmarkMemoryCache: a memory as a transformers Cache for ``generate``
"""
