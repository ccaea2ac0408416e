"""A corpus served by Ray actors, each holding a share of its blocks, on a local cluster of two
nodes: the same retrieved blocks and answers as one process, bit for bit; a share that dies
fails the request in one line, the server lives on and nothing on disk changes; a key file cut
under it is a 503, not a SIGBUS."""

import os
import shutil

import pytest
import ray
import torch
from helpers import snapshot
from ray.cluster_utils import Cluster

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.serve_guard import APIError
from landmark_memory.app.serve_readers import Readers, ServeConfig
from landmark_memory.app.served import Shares
from landmark_memory.format import MemoryFileError
from landmark_memory.uses.answer import ask

pytestmark = pytest.mark.slow  # servers and Ray shares

QUESTIONS = ["What did the captain keep in his chest?", "Who came to the inn?", "The rabbit ran"]


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of one CPU each: a share on each."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model():
    return LandmarkGPT.from_pretrained()


def test_a_corpus_served_by_two_shares_answers_bit_for_bit_as_one_process(corpus, cluster, model):
    shares = Shares(corpus, None, 2, threads=1)
    tok, probe = load_tokenizer(), torch.tensor([load_tokenizer().encode(" and the parrot said").ids])
    try:
        assert len({ray.get(a.blocks.remote()) for a in shares.actors}) == 1 and shares.ranges[0][1] > 0
        with LandmarkMemory.open(corpus, model, readonly=True) as one, \
                shares.serve(LandmarkMemory.open(corpus, model, readonly=True)) as front:
            for q in QUESTIONS:
                assert ask(front, tok, q, max_new_tokens=8, raw=True, passages=4) == ask(
                    one, tok, q, max_new_tokens=8, raw=True, passages=4)
                one.rewind()
                front.rewind()
            assert torch.equal(front.forward(probe).logits, one.forward(probe).logits)
            assert front.retrieval_stats.searches == one.retrieval_stats.searches
        assert shares.searches > 0 and all(shares.reads)  # every share searched and read from
    finally:
        shares.close()


def test_a_share_that_dies_fails_the_request_in_one_line_and_the_server_lives_on(corpus, cluster, model):
    before = snapshot(corpus)
    readers = Readers(ServeConfig(corpus, "landmark-memory-tiny", shares=2), model)
    try:
        with readers.take() as mem:
            ask(mem, load_tokenizer(), QUESTIONS[0], max_new_tokens=4, raw=True)
        ray.kill(readers.shares.actors[1])
        with pytest.raises(APIError) as e:
            with readers.take() as mem:
                ask(mem, load_tokenizer(), QUESTIONS[1], max_new_tokens=4, raw=True)
        assert e.value.status == 503 and "served on Ray" in str(e.value) and "\n" not in str(e.value)
        assert readers.describe()["blocks"] > 0  # the server answers on
    finally:
        readers.close()
    assert snapshot(corpus) == before


def test_shares_refuse_a_front_of_another_commit(corpus, cluster, model, documents, tmp_path):
    from landmark_memory.app.cli import main

    other = tmp_path / "other"
    assert main(["build", str(other), "--input", str(documents / "a.txt"), "--chunk-size", "100", "--quiet"]) == 0
    shares = Shares(corpus, None, 2, threads=1)
    try:
        with pytest.raises(MemoryFileError, match="restart the server"):
            shares.serve(LandmarkMemory.open(other, model, readonly=True))
    finally:
        shares.close()


def test_serve_takes_a_ray_address_only_with_shares(corpus, capsys):
    from landmark_memory.app.cli import main

    assert main(["serve", str(corpus), "--ray-address", "auto", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--shares" in err


def test_a_key_file_cut_under_a_served_corpus_is_a_503_not_a_sigbus(corpus, cluster, model, tmp_path):
    served = tmp_path / "m"
    shutil.copytree(corpus, served)
    readers = Readers(ServeConfig(served, "landmark-memory-tiny", shares=2), model)
    try:
        with readers.take() as mem:
            ask(mem, load_tokenizer(), QUESTIONS[0], max_new_tokens=4, raw=True)
        key = served / "keys" / "s0_l1_h0.f32"
        os.truncate(key, 8)  # (the front and both shares map it)
        with pytest.raises(APIError) as e:
            with readers.take():
                pass  # (checked before an answer reads anything)
        assert e.value.status == 503 and "truncated" in str(e.value) and "\n" not in str(e.value)
    finally:
        readers.close()
