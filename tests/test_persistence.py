import hashlib
import json

import numpy as np
import pytest
import torch

from landmark_memory import LandmarkConfig, LandmarkGPT
from landmark_memory.format import MemoryFileError
from landmark_memory.memory import LandmarkMemory


def small_model(seed=0):
    torch.manual_seed(seed)
    cfg = LandmarkConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=5, landmark_id=1)
    return LandmarkGPT(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def text():
    return torch.randint(4, 64, (1, 173), generator=torch.Generator().manual_seed(1))


def dir_digest(path):
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file() and f.name != "lock.mdb"}


@pytest.mark.parametrize("store,index,dtype", [("lmdb", "flat", "float32"), ("mmap", "ivf", "float32"),
                                               ("lmdb", "ivfpq", "float32"), ("lmdb", "flat", "int8"),
                                               ("mmap", "flat", "int8"), ("lmdb", "ivf-rows", "int8"),
                                               ("mmap", "ivf-rows", "float32")])
def test_save_reopen_continue_equals_never_stopping(model, text, tmp_path, store, index, dtype):
    opts = dict(index=index, top_k=2, chunk_size=10, index_options={"train_size": 16}, store_dtype=dtype)
    cut = 57  # mid-chunk: the open chunk's keys and values must survive too
    whole = LandmarkMemory(model, **opts)  # the same pieces, never stopped
    expected = torch.cat([whole.forward(text[:, :cut]).logits, whole.forward(text[:, cut:]).logits], 1)
    mem = LandmarkMemory(model, store=store, path=tmp_path / "m", **opts)
    first = mem.forward(text[:, :cut]).logits
    mem.close()
    mem = LandmarkMemory.open(tmp_path / "m", model)
    assert mem.n_tokens == cut and mem.pending_count == cut % 10
    rest = mem.forward(text[:, cut:]).logits
    torch.testing.assert_close(torch.cat([first, rest], 1), expected, rtol=0, atol=0)
    assert len(mem.inspection.indexes()) == model.config.n_layer * model.config.n_head
    for a, b in zip(mem.inspection.indexes(), whole.inspection.indexes()):  # same index contents, same store
        assert a.ntotal == b.ntotal
        xq = np.random.default_rng(0).standard_normal((7, model.config.head_dim)).astype(np.float32)
        np.testing.assert_array_equal(a.search(xq, 3)[1], b.search(xq, 3)[1])
    keys = [(0, layer, blk) for layer in range(2) for blk in range(mem.n_blocks)]
    for x, y in zip(mem.inspection.stored(keys), whole.inspection.stored(keys)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    np.testing.assert_array_equal(mem.tokens(), text[0, :mem.n_blocks * 5].numpy())
    mem.close()


def test_readers_share_a_memory_and_never_write_it(model, text, tmp_path):
    with LandmarkMemory(model, store="lmdb", path=tmp_path, top_k=2, chunk_size=10) as mem:
        mem.forward(text[:, :100])
    before = dir_digest(tmp_path)
    r1 = LandmarkMemory.open(tmp_path, model, readonly=True)
    r2 = LandmarkMemory.open(tmp_path, model, readonly=True)
    r1.forward(text[:, 100:])  # new blocks stay in this process
    assert r1.n_tokens == text.shape[1] and r2.n_tokens == 100
    with pytest.raises(ValueError, match="read-only"):
        r1.commit()
    r1.close()
    r2.close()
    assert dir_digest(tmp_path) == before


def test_a_second_writer_is_refused(model, text, tmp_path):
    mem = LandmarkMemory(model, store="lmdb", path=tmp_path, top_k=2, chunk_size=10)
    mem.forward(text[:, :30])
    with pytest.raises(MemoryFileError, match="only one writer"):
        LandmarkMemory.open(tmp_path, model)
    mem.close()
    LandmarkMemory.open(tmp_path, model).close()  # the lock goes with the writer


def test_opening_with_another_model_is_refused(model, text, tmp_path):
    with LandmarkMemory(model, store="lmdb", path=tmp_path, chunk_size=10) as mem:
        mem.forward(text[:, :30])
    with pytest.raises(MemoryFileError, match="another model"):
        LandmarkMemory.open(tmp_path, small_model(seed=1))


def test_opening_with_the_same_weights_but_another_tokenizer_is_refused(tmp_path, text):
    model = small_model()
    model.tokenizer_digest = "a" * 64  # as load_model tags a model with its tokenizer
    with LandmarkMemory(model, store="lmdb", path=tmp_path, chunk_size=10) as mem:
        mem.forward(text[:, :30])
    assert json.loads((tmp_path / "manifest.json").read_text())["model"]["tokenizer"] == "a" * 64
    model.tokenizer_digest = "b" * 64
    with pytest.raises(MemoryFileError, match="another tokenizer"):
        LandmarkMemory.open(tmp_path, model, readonly=True)
    del model.tokenizer_digest  # a model given without its tokenizer (the Python API): its weights decide
    LandmarkMemory.open(tmp_path, model, readonly=True).close()


def test_a_memory_that_records_no_tokenizer_opens_and_its_next_commit_records_it(tmp_path, text):
    model = small_model()
    with LandmarkMemory(model, store="lmdb", path=tmp_path, chunk_size=10) as mem:  # (no tokenizer known)
        mem.forward(text[:, :30])
    assert json.loads((tmp_path / "manifest.json").read_text())["model"]["tokenizer"] == ""
    model.tokenizer_digest = "c" * 64
    with LandmarkMemory.open(tmp_path, model) as mem:
        mem.forward(text[:, 30:60])
    assert json.loads((tmp_path / "manifest.json").read_text())["model"]["tokenizer"] == "c" * 64


def test_the_tokenizer_digest_covers_its_ids_and_its_chat_template():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from landmark_memory.core.tokenizer import load_tokenizer
    from landmark_memory.models.hf.tokenizer import TextTokenizer
    from landmark_memory.models.kinds import tokenizer_digest

    tok = load_tokenizer()
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped
    swapped = Tokenizer.from_str(json.dumps(spec))
    assert tokenizer_digest(load_tokenizer()) == tokenizer_digest(tok) != tokenizer_digest(swapped)
    chat = TextTokenizer(PreTrainedTokenizerFast(tokenizer_object=load_tokenizer()))
    plain = tokenizer_digest(chat)
    chat.hf.chat_template = "{{ messages[0]['content'] }}"
    assert plain != tokenizer_digest(chat)


def test_structural_options_cannot_change_on_open(model, tmp_path):
    LandmarkMemory(model, store="lmdb", path=tmp_path, chunk_size=10).close()
    with pytest.raises(ValueError, match="chunk_size cannot change"):
        LandmarkMemory.open(tmp_path, model, chunk_size=20)
    mem = LandmarkMemory.open(tmp_path, model, top_k=7, nprobe=2)  # query-time options can
    assert mem.options.top_k == 7 and mem.options.index_options["nprobe"] == 2
    mem.close()


def test_creating_over_an_existing_memory_is_refused(model, tmp_path):
    LandmarkMemory(model, store="lmdb", path=tmp_path, chunk_size=10).close()
    with pytest.raises(MemoryFileError, match="already holds a memory"):
        LandmarkMemory(model, store="lmdb", path=tmp_path, chunk_size=10)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(MemoryFileError, match="not empty"):
        LandmarkMemory(model, store="lmdb", path=tmp_path / "other", chunk_size=10)


def saved(model, text, path):
    with LandmarkMemory(model, store="lmdb", path=path, top_k=2, chunk_size=10) as mem:
        mem.forward(text[:, :64])
    return json.loads((path / "manifest.json").read_text())


@pytest.mark.parametrize("damage,message", [
    ("manifest_truncated", "manifest.json is damaged"),
    ("manifest_missing", "manifest.json is missing"),
    ("newer_format", "newer landmark-memory"),
    ("state_truncated", "truncated or corrupted"),
    ("state_missing", "is missing"),
    ("tokens_truncated", "tokens.bin is truncated"),
    ("store_missing", "block store"),
])
def test_damaged_memories_are_refused_with_the_cause(model, text, tmp_path, damage, message):
    doc = saved(model, text, tmp_path)
    state = tmp_path / doc["files"]["state"]["name"]
    if damage == "manifest_truncated":
        (tmp_path / "manifest.json").write_text(json.dumps(doc)[:40])
    elif damage == "manifest_missing":
        (tmp_path / "manifest.json").unlink()
    elif damage == "newer_format":
        (tmp_path / "manifest.json").write_text(json.dumps({**doc, "format_version": 99}))
    elif damage == "state_truncated":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "state_missing":
        state.unlink()
    elif damage == "tokens_truncated":
        f = tmp_path / "tokens.bin"
        f.write_bytes(f.read_bytes()[:8])
    else:
        for f in (tmp_path / "store" / "lmdb").iterdir():
            f.unlink()
        import lmdb

        lmdb.open(str(tmp_path / "store" / "lmdb")).close()  # an empty store
    with pytest.raises(MemoryFileError, match=message):
        LandmarkMemory.open(tmp_path, model, readonly=True)


def test_a_writer_cuts_an_uncommitted_tail(model, text, tmp_path):
    saved(model, text, tmp_path)
    committed = (tmp_path / "tokens.bin").read_bytes()
    with open(tmp_path / "tokens.bin", "ab") as f:  # what a crash between commits can leave
        f.write(b"\x07" * 44)
    mem = LandmarkMemory.open(tmp_path, model)
    assert (tmp_path / "tokens.bin").read_bytes() == committed
    mem.forward(text[:, 64:])
    mem.close()
    again = LandmarkMemory.open(tmp_path, model, readonly=True)
    np.testing.assert_array_equal(again.tokens(), text[0, :again.n_blocks * 5].numpy())
    again.close()
