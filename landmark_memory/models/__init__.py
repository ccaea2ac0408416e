"""The models a memory reads with: LandmarkGPT (``model.py``, ``config.py``), the Infini-attention
baseline, the layer pieces a memory drives (``backbone.py``), Hugging Face families (``hf/``) and
which kind a name or folder holds (``kinds.py``)."""
