"""Training: the loop (``train.py``), book windows and passkey mixes (``data.py``), retrieval
drills, the recall loss, and fine-tuning Hugging Face models (``finetune.py``)."""
