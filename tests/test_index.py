import contextlib

import faiss
import numpy as np
import pytest
import torch

from landmark_memory.index import KINDS, gpu_available, index_from_bytes, new_index, recall_at_k
from landmark_memory.index.rows import KeyFileError, KeyRows


def test_flat_top_k_equals_torch_brute_force():
    g = torch.Generator().manual_seed(0)
    xb, xq = torch.randn(500, 32, generator=g), torch.randn(20, 32, generator=g)
    index = new_index("flat", 32)
    for part in xb.split(64):  # incremental adds
        index.add(part.numpy())
    for lo, hi in [(0, 500), (100, 350), (490, 500)]:
        D, I = index.search(xq.numpy(), 4, lo, hi)
        top = (xq @ xb[lo:hi].T).topk(4)
        np.testing.assert_array_equal(I, (top.indices + lo).numpy())
        np.testing.assert_allclose(D, top.values.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nq", [1, 19, 21, 300])  # FAISS computes few queries one by one, many as a matrix product
def test_flat_search_over_mapped_key_rows_equals_faiss_index_flat_ip_bit_for_bit(tmp_path, nq):
    rng = np.random.default_rng(nq)
    xb, xq = rng.standard_normal((3000, 64)).astype(np.float32), rng.standard_normal((nq, 64)).astype(np.float32)
    xb[100:110] = xb[100]  # ties: the same ids in the same order
    writer = KeyRows(64, tmp_path / "keys.f32")
    for part in np.array_split(xb, 7):  # appended in place, the file grown as it goes
        writer.append(part)
    writer.sync()
    mapped = new_index("flat", 64, rows=KeyRows(64, tmp_path / "keys.f32", writable=False, n=len(xb)))
    reference = faiss.IndexFlatIP(64)
    reference.add(xb)
    for lo, hi in [(0, 3000), (95, 2990), (100, 108)]:
        want = reference.search(xq, 5, params=faiss.SearchParameters(sel=faiss.IDSelectorRange(lo, hi)))
        got = mapped.search(xq, 5, lo, hi)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    writer.close()
    assert (tmp_path / "keys.f32").stat().st_size == xb.nbytes  # the room it grew into given back


def test_a_reader_refuses_key_rows_its_file_does_not_hold(tmp_path):
    (tmp_path / "keys.f32").write_bytes(np.zeros((10, 8), np.float32).tobytes())
    with pytest.raises(KeyFileError, match="truncated"):
        KeyRows(8, tmp_path / "keys.f32", writable=False, n=11)  # never mapped past the file's end
    with pytest.raises(KeyFileError, match="missing"):
        KeyRows(8, tmp_path / "none.f32", writable=False, n=1)
    assert KeyRows(8, tmp_path / "keys.f32", writable=False, n=10).array().shape == (10, 8)


def test_search_pads_with_minus_one_when_range_is_small():
    index = new_index("flat", 8)
    index.add(np.random.rand(10, 8).astype(np.float32))
    D, I = index.search(np.random.rand(3, 8).astype(np.float32), 4, 5, 7)
    assert (I[:, 2:] == -1).all() and np.isneginf(D[:, 2:]).all() and set(I[:, :2].ravel()) <= {5, 6}
    D, I = index.search(np.random.rand(3, 8).astype(np.float32), 4, 7, 7)
    assert (I == -1).all()


def test_a_range_searched_again_after_training_searches_the_trained_index():
    rng = np.random.default_rng(1)
    xb, xq = rng.standard_normal((300, 16)).astype(np.float32), rng.standard_normal((5, 16)).astype(np.float32)
    index, exact = new_index("ivf", 16, train_size=260, nprobe=1000), new_index("flat", 16)
    index.add(xb[:250])
    exact.add(xb)
    untrained = index.index
    np.testing.assert_array_equal(index.search(xq, 4, 100, 250)[1], exact.search(xq, 4, 100, 250)[1])
    index.add(xb[250:])  # trains: the same range now lies in another index
    assert index.trained and index.index is not untrained
    np.testing.assert_array_equal(index.search(xq, 4, 100, 250)[1], exact.search(xq, 4, 100, 250)[1])


@pytest.mark.parametrize("kind", ["ivf", "ivfpq"])
def test_ivf_searches_exactly_until_trained_then_trains_once(kind):
    rng = np.random.default_rng(0)
    xb, xq = rng.standard_normal((800, 16)).astype(np.float32), rng.standard_normal((10, 16)).astype(np.float32)
    index, exact = new_index(kind, 16, train_size=700), new_index("flat", 16)
    index.add(xb[:600])
    exact.add(xb[:600])
    assert not index.trained
    assert recall_at_k(index.search(xq, 4)[1], exact.search(xq, 4)[1]) == 1.0
    index.add(xb[600:])
    assert index.trained and index.ntotal == 800
    assert type(index.index).__name__ == {"ivf": "IndexIVFFlat", "ivfpq": "IndexRefineFlat"}[kind]


def test_recall_at_k_counts_exact_ids_found():
    assert recall_at_k([[1, 2, 3, 4]], [[4, 3, 2, 1]]) == 1.0
    assert recall_at_k([[1, 2, 9, 9], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, -1, -1]]) == pytest.approx(4 / 6)


def test_bad_kind_and_dims_are_explained():
    with pytest.raises(ValueError, match="unknown index kind"):
        new_index("annoy", 8)
    index = new_index("flat", 8)
    with pytest.raises(ValueError, match=r"\(n, 8\)"):
        index.add(np.zeros((3, 7), np.float32))
    if not gpu_available():
        with pytest.raises(ValueError, match="faiss-gpu"):
            new_index("flat-gpu", 8)
    with pytest.raises(TypeError, match="refine"):  # an option its kind does not take
        new_index("flat", 8, refine=4)


def test_the_index_registry_is_what_the_command_line_offers_and_each_kind_makes_its_own_index():
    from landmark_memory.core.names import INDEX_KINDS
    from landmark_memory.index import derived_from_rows
    from landmark_memory.index.faiss_kinds import FaissIndex
    from landmark_memory.index.on_rows import ListsIndex, RowsIndex

    assert tuple(KINDS) == INDEX_KINDS
    assert [k for k, spec in KINDS.items() if spec.on_rows] == ["ivf-rows", "flat", "flat-gpu", "flat-torch"]
    for kind in (k for k in KINDS if gpu_available() or not KINDS[k].gpu):
        index = new_index(kind, 8)
        assert type(index) is KINDS[kind].make and index.kind == kind
        assert derived_from_rows(kind) == isinstance(index, RowsIndex)
    assert [type(new_index(k, 8)) for k in ("ivf-rows", "flat", "hnsw")] == [ListsIndex, RowsIndex, FaissIndex]


@pytest.fixture
def gpu_as_classic_faiss_gpu(monkeypatch):
    """The GPU kinds' code paths on the CPU: faiss-gpu's calls replaced by CPU ones that, as
    classic faiss-gpu does, ignore a search's ID selector."""
    import landmark_memory.index as index_module
    import landmark_memory.index.faiss_kinds as faiss_kinds
    import landmark_memory.index.on_rows as on_rows
    from landmark_memory.core.names import NPROBE

    class SelectorIgnored:  # a "GPU" index: FAISS's CPU index, its searches unrestricted
        def __init__(self, index):
            self.inner = index

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def search(self, xq, k, params=None):  # the index's own settings (the defaults), no selector
            ivf = faiss.SearchParametersIVF(nprobe=NPROBE)
            refined = faiss.IndexRefineSearchParameters(k_factor=4, base_index_params=ivf)
            return self.inner.search(xq, k, params=refined if isinstance(self.inner, faiss.IndexRefine) else ivf)

        def honoured(self, xq, k, params):  # the search as cuVS would make it: the selector honoured
            return self.inner.search(xq, k, params=params)

    def knn_gpu(res, xq, xb, k, metric):  # the range's rows alone, as faiss.knn_gpu searches them
        return faiss.knn(xq, xb, k, metric=metric)

    monkeypatch.setattr(index_module, "gpu_available", lambda: True)
    monkeypatch.setattr(faiss_kinds, "gpu_resources", lambda: None)
    monkeypatch.setattr(on_rows, "gpu_resources", lambda: None)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", lambda res, device, index: SelectorIgnored(index), raising=False)
    monkeypatch.setattr(faiss, "knn_gpu", knn_gpu, raising=False)


@pytest.mark.parametrize("kind", ["flat-gpu", "ivf-gpu", "ivfpq-gpu"])
def test_a_gpu_kind_returns_the_top_k_of_the_range_searched_never_a_block_outside_it(gpu_as_classic_faiss_gpu, kind):
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((600, 16)).astype(np.float32)
    xq = rng.standard_normal((20, 16)).astype(np.float32)
    gpu, flat = new_index(kind, 16, train_size=256), new_index("flat", 16)
    gpu.add(xb)
    flat.add(xb)
    assert kind == "flat-gpu" or gpu.trained  # (an IVF kind searches its "GPU" index from here on)
    for lo, hi in [(0, 600), (0, 590), (100, 400), (595, 600), (37, 38)]:
        D, I = gpu.search(xq, 5, lo, hi)
        assert ((I >= lo) & (I < hi) | (I == -1)).all(), (lo, hi)  # never a block outside the range
        if kind == "flat-gpu":  # exact: as flat's search of the range
            D_want, I_want = flat.search(xq, 5, lo, hi)
        else:  # the range's top 5 among the lists visited: the same index's search with the range honoured
            D_want, I_want = gpu.index.honoured(xq, 5, gpu._params(lo, hi))
            D_want[I_want < 0] = -np.inf
        np.testing.assert_array_equal(I, I_want)
        np.testing.assert_allclose(D, D_want, rtol=1e-5)
    with pytest.raises(ValueError, match="ignores a range") if kind != "flat-gpu" else contextlib.nullcontext():
        gpu.search(xq, 2047, 0, 2)  # more results than faiss-gpu returns would be needed: refused, never wrong


def test_flat_torch_returns_flats_ids_over_any_range_as_rows_grow_and_roll_back(monkeypatch):
    from landmark_memory.index.on_rows import TorchRowsIndex

    monkeypatch.setattr(TorchRowsIndex, "SCORES", 7 * 40)  # slices of 40 rows for 7 queries: merging is exercised
    rng = np.random.default_rng(1)
    xq = rng.standard_normal((7, 16)).astype(np.float32)
    gpu, flat = new_index("flat-torch", 16), new_index("flat", 16)
    assert gpu.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    for step in range(3):
        xb = rng.standard_normal((250, 16)).astype(np.float32)
        gpu.add(xb)
        flat.add(xb)
        n = gpu.ntotal
        for lo, hi, k in [(0, n, 5), (0, n - 3, 5), (100, 230, 12), (n - 2, n, 5), (37, 38, 3), (0, n, 300)]:
            D, I = gpu.search(xq, k, lo, hi)
            D_want, I_want = flat.search(xq, k, lo, hi)
            assert D.dtype == np.float32 and not np.isnan(D).any()
            np.testing.assert_allclose(D, D_want, rtol=1e-5, atol=1e-5)  # (-inf where fewer than k)
            # the same ids in the same order, but for two scores tied within rounding
            assert all(set(a) == set(b) for a, b in zip(I.tolist(), I_want.tolist()))
            assert (I == I_want).mean() > 0.99
        if step == 1:  # a rollback: the last 100 rows dropped, other rows written in their place
            for ix in (gpu, flat):
                ix.rows.follow(n - 100)
                ix.follow(n - 100)
            xb = rng.standard_normal((100, 16)).astype(np.float32)
            gpu.add(xb)
            flat.add(xb)


@pytest.mark.slow
def test_approximate_indexes_reach_recall_on_trained_landmark_keys():
    """Landmark keys and queries of the bundled tiny model on the bundled sample text."""
    from landmark_memory import LandmarkGPT, load_tokenizer
    from landmark_memory.training.data import SAMPLE_DIR, list_text_files, strip_gutenberg

    model = LandmarkGPT.from_pretrained().eval()
    tok = load_tokenizer()
    ids = sum((tok.encode(strip_gutenberg(f.read_text())).ids for f in list_text_files(SAMPLE_DIR / "train")), [])
    x = torch.tensor(ids[:64 * 500]).view(64, 500)  # windows: real keys, no memory needed
    qkv = {}
    hooks = [b.attn.qkv.register_forward_hook(lambda m, i, o, n=n: qkv.__setitem__(n, o))
             for n, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    cfg = model.config
    L, D = cfg.block_size + 1, cfg.head_dim
    is_lm = torch.arange(qkv[0].shape[1]) % L == L - 1
    heads = {n: t.view(x.shape[0], -1, 3, cfg.n_head, D) for n, t in qkv.items()}
    # Layer 0 sees the landmark token's embedding only, and keys carry no RoPE: all its landmark
    # keys are one vector, every search is a tie, and recall is undefined there.
    first = heads[0][:, is_lm, 1].reshape(-1, cfg.n_head, D)
    torch.testing.assert_close(first, first[:1].expand_as(first))
    recalls = {"hnsw": [], "ivf": [], "ivfpq": []}
    for layer in range(1, cfg.n_layer):
        for head in range(cfg.n_head):
            xb = heads[layer][:, is_lm, 1, head].reshape(-1, D).numpy()
            xq = heads[layer][:, ~is_lm, 0, head].reshape(-1, D)[::40].numpy()
            exact = new_index("flat", D)
            exact.add(xb)
            I_exact = exact.search(xq, 4)[1]
            for kind in recalls:
                index = new_index(kind, D, train_size=256)
                index.add(xb)
                assert index.trained
                recalls[kind].append(recall_at_k(index.search(xq, 4)[1], I_exact))
    for kind, r in recalls.items():
        assert np.mean(r) >= 0.9, (kind, np.round(r, 3))


@pytest.mark.parametrize("kind", ["ivf", "ivfpq"])
def test_ivf_indexes_train_again_as_they_grow_and_resume_exactly(kind):
    rng = np.random.default_rng(3)
    xb, xq = rng.standard_normal((1100, 16)).astype(np.float32), rng.standard_normal((20, 16)).astype(np.float32)
    grown = new_index(kind, 16, train_size=64)
    lists = []
    for a in range(0, 1100, 10):
        grown.add(xb[a:a + 10])
        lists.append(faiss.extract_index_ivf(grown.index).nlist if grown.trained else 0)
    assert 0 < lists[10] < lists[30] < lists[-1]  # trained at 64 keys, again at 256 and 1024
    resumed = new_index(kind, 16, train_size=64)
    for a in range(0, 500, 10):
        resumed.add(xb[a:a + 10])
    resumed = index_from_bytes(kind, 16, resumed.to_bytes(), train_size=64)
    for a in range(500, 1100, 10):
        resumed.add(xb[a:a + 10])
    for a, b in zip(grown.search(xq, 4), resumed.search(xq, 4)):
        np.testing.assert_array_equal(a, b)
    exact = new_index("flat", 16)
    exact.add(xb)
    assert recall_at_k(grown.search(xq, 4)[1], exact.search(xq, 4)[1]) > 0.5
