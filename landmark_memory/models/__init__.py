"""The models a memory reads with: LandmarkGPT (``model.py``, ``config.py``), the Infini-attention
baseline, the layer pieces a memory drives (``backbone.py``), Hugging Face families (``hf/``),
which kind a name or folder holds (``kinds.py``), what a memory knows a model by
(``fingerprint.py``), the question reader ``ask`` points a question at its blocks with
(``reader.py``) and a model's retrieval heads (``heads.py``)."""
