"""What the commands share: their usage error, their output (text or JSON), the options of a
memory from the command line, one text input, and the model a saved memory records."""

import json
import sys
from pathlib import Path

from ..core.names import NAMED_MODELS
from ..core.printing import printable
from ..format import MemoryDir
from ..format.errors import shown, wrong_model
from ..format.options import MemoryOptions
from ..jobs.build import read_inputs
from ..models.kinds import model_name
from .cli_args import given


class UsageError(ValueError):
    pass


def emit(args, doc, text):
    """One JSON document with --json (its strings escaped by JSON), else human-readable text."""
    print(json.dumps(doc, indent=1) if args.json else printable(text))


def memory_options(args, model, **settings) -> MemoryOptions:
    """The memory's options from the command line and ``settings`` (which win), what they leave
    out the defaults, resolved for ``model``."""
    index_options = {k: getattr(args, k) for k in ("train_size", "nprobe", "ef_search") if getattr(args, k, None)}
    options = given(args, "top_k", "index", "retrieval", "position_mapping", "cmt_cutoff", "store_dtype", "chunk_size")
    resolved = MemoryOptions.of(**{**options, **settings}, index_options=index_options).for_model(model)
    say_block_keys(model, resolved)
    return resolved


def read_one_text(path):
    inputs = read_inputs([path])
    if len(inputs) != 1:
        raise UsageError(f"--input takes one text file, {path} holds {len(inputs)}")
    return inputs[0]


def say_block_keys(model, options: MemoryOptions):
    """Say once, on stderr, that a memory of ``options`` (resolved) reads ``model`` without
    landmarks (no training)."""
    if options.block_keys == "mean":
        print(f"{printable(getattr(model, 'landmark_name', '') or 'the model')}: no landmarks; each block of "
              f"{options.block_size} tokens is searched by the mean of its own keys (training-free)", file=sys.stderr)


def saved_model(args, required=True):
    """The manifest of the memory ``args.memory`` (unless ``required``, None where there is none
    yet), refused in one line, before any model loads, when it records another model than
    ``--model``. Without ``--model``, ``args.model`` becomes the model the memory records when
    that is one the package ships (its weights are checked against the memory's fingerprint as
    it opens); a folder a manifest names is loaded only when the user names it again: a memory
    received from someone else never chooses what is loaded."""
    if not required and not (Path(args.memory) / "manifest.json").exists():
        return None
    saved = MemoryDir(args.memory, writable=False).read_manifest()
    if args.model is None and saved.model.name not in ("", "bundled"):
        if saved.model.name not in NAMED_MODELS:
            raise UsageError(f"{args.memory} was built with the model in {shown(saved.model.name)}; a memory never "
                             "chooses which folder's model is loaded: if you trust that folder, name it with --model")
        args.model = saved.model.name
    if saved.model.name and saved.model.name != model_name(args.model):
        raise UsageError(wrong_model(args.memory, saved.model, model_name(args.model)))
    return saved
