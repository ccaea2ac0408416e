"""``landmark-memory serve`` as programs reach it: the official OpenAI client, concurrent
requests, every refusal, the page, and SIGTERM."""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from landmark_memory import LandmarkGPT, LandmarkMemory, ask, load_tokenizer, search
from landmark_memory.app.cli import main
from landmark_memory.uses.inspect import describe

pytestmark = pytest.mark.slow  # servers in processes of their own

KEY, MODEL = "test-key", "landmark-memory-tiny"
QUESTIONS = ["The captain said", "Alice was beginning", "Holmes looked at", "The door opened and",
             "It was a dark night", "The doctor came", "She said nothing", "At the inn"]


@pytest.fixture(scope="module")
def server(corpus, serving):
    with serving(corpus, "--api-key", KEY, "--max-tokens", "64", "--max-body", "4096") as url:
        yield url


def library(corpus, question, n=6):
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        return ask(mem, load_tokenizer(), question, max_new_tokens=n, raw=True)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_the_openai_client_completes_chats_and_streams_with_the_passages_read(server, corpus):
    c, want = client(server), library(corpus, QUESTIONS[0])
    assert [m.id for m in c.models.list()] == [MODEL]
    done = c.completions.create(model=MODEL, prompt=QUESTIONS[0], max_tokens=6)
    assert done.choices[0].text == want.text and done.choices[0].finish_reason == "length"
    assert done.passages == [p.__dict__ for p in want.passages] and done.usage.completion_tokens == 6
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=6)
    assert chat.choices[0].message.content == want.text and chat.passages == done.passages
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=6, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].passages == done.passages


def test_eight_requests_four_at_a_time_each_answer_as_the_library_does(server, corpus):
    c = client(server)

    def one(q):
        return c.completions.create(model=MODEL, prompt=q, max_tokens=6).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, QUESTIONS))
    assert got == [library(corpus, q).text for q in QUESTIONS]


def request(url, path, body=None, key=KEY, raw=None):
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path,body,key,raw,status,code", [
    ("/v1/models", None, None, None, 401, "invalid_api_key"),
    ("/v1/models", None, "wrong", None, 401, "invalid_api_key"),
    ("/v1/completions", None, KEY, b'{"model": "x", "prompt":', 400, "invalid_request"),
    ("/v1/completions", {"model": MODEL}, KEY, None, 400, "invalid_request"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "Hello"}, KEY, None, 404, "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, KEY, None, 413, "request_too_large"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 65}, KEY, None, 400, "invalid_max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "Hi"}]}, KEY, None, 400,
     "invalid_request"),
])
def test_bad_requests_get_openai_shaped_errors(server, path, body, key, raw, status, code):
    got, doc = request(server, path, body, key, raw)
    assert got == status and doc["error"]["code"] == code and doc["error"]["message"]


def test_the_page_and_the_memory_it_shows_are_served(server, corpus):
    with urllib.request.urlopen(server + "/", timeout=10) as r:
        page = r.read().decode()
    assert r.headers["content-type"].startswith("text/html") and 'id="question"' in page and json.dumps(MODEL) in page
    status, memory = request(server, "/v1/memory")
    assert status == 200 and memory == json.loads(json.dumps(describe(corpus)))


def test_a_server_opened_once_follows_a_build_beside_it_and_answers_as_a_fresh_open(documents, tmp_path, serving):
    first, more, memory = tmp_path / "first", tmp_path / "more", tmp_path / "m"
    first.mkdir()
    more.mkdir()
    (first / "a.txt").write_bytes((documents / "a.txt").read_bytes())
    (more / "b.txt").write_bytes((documents / "b.txt").read_bytes())
    assert main(["build", str(memory), "--input", str(first), "--chunk-size", "100", "--quiet"]) == 0
    with serving(memory, "--api-key", KEY, "--max-tokens", "64", "--max-body", "4096") as url:
        c = client(url)
        for question in QUESTIONS[:2]:  # the same kept memory twice: the first answer leaves nothing behind
            got = c.completions.create(model=MODEL, prompt=question, max_tokens=6)
            want = library(memory, question)
            assert got.choices[0].text == want.text and got.passages == [p.__dict__ for p in want.passages]
        assert request(url, "/v1/memory")[1]["commit"] == 1
        # a build commits beside the running server; its next answers read the new document too
        assert main(["build", str(memory), "--input", str(first), str(more), "--chunk-size", "100", "--quiet"]) == 0
        status, info = request(url, "/v1/memory")
        assert status == 200 and info == json.loads(json.dumps(describe(memory)))
        assert [e["path"] for e in info["inputs"]] == [str(first / "a.txt"), str(more / "b.txt")]
        for question in QUESTIONS[2:4]:
            got = c.completions.create(model=MODEL, prompt=question, max_tokens=6)
            want = library(memory, question)
            assert got.choices[0].text == want.text and got.passages == [p.__dict__ for p in want.passages]
        assert any(p["source"] == str(more / "b.txt") for q in QUESTIONS for p in
                   c.completions.create(model=MODEL, prompt=q, max_tokens=2, extra_body={"passages": 8}).passages)


def test_a_search_request_gives_the_passages_and_quote_as_the_library_does_and_refuses_bad_ones(server, corpus):
    status, got = request(server, "/v1/search", {"question": "the treasure map", "passages": 2})
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        want = search(mem, load_tokenizer(), "the treasure map", k=2).to_json()
    assert status == 200 and got["passages"] == want["passages"] and got["ranking"] == want["ranking"]
    for body, code in [({"question": " "}, "invalid_question"),
                       ({"question": "map", "passages": 0}, "invalid_passages")]:
        status, err = request(server, "/v1/search", body)
        assert status == 400 and err["error"]["code"] == code
