"""What a memory knows its model by: the sha256 of its config and weights.

A memory only makes sense with the model that computed its keys and values, so a saved memory
records this fingerprint (``Manifest.model``) and opens only with a model that has it. What
turns text into ids is recorded beside it (``kinds.tokenizer_digest``).
"""

import hashlib
import json
import weakref

import torch

# config entries that say where or how a model was loaded, not what it computes (Hugging Face),
# or how it was trained: p_cmt and p_jump change nothing at inference, and a Context Miss Token
# (cmt) shows in the weights, so memories built before these entries existed still open
UNFINGERPRINTED = {"transformers_version", "architectures", "use_cache", "landmark_backend", "cmt", "p_cmt", "p_jump"}


_FINGERPRINTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of a model's config and weights: a memory only makes sense with the model that
    computed its keys and values. Hashed once per loaded model (SmolLM2's weights take most of a
    second): kept until its config or any weight changes (a tensor replaced, or written in place,
    which moves its version counter)."""
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in UNFINGERPRINTED}
    state = sorted(model.state_dict().items())
    seen = (json.dumps(config, sort_keys=True), tuple((name, t.data_ptr(), t._version) for name, t in state))
    cached = _FINGERPRINTS.get(model)
    if cached is not None and cached[0] == seen:
        return cached[1]
    h = hashlib.sha256(seen[0].encode())
    for name, t in state:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    _FINGERPRINTS[model] = seen, h.hexdigest()
    return h.hexdigest()
