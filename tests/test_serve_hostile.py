"""``landmark-memory serve`` against hostile clients and web pages: Host checks (DNS rebinding),
keys (empty, from the environment, not ASCII), values that used to be tracebacks, OpenAI's error
shape for every refusal, stop strings, clients that leave, cheap routes behind a queue of
answers, damage found while serving, and property-based requests to every route."""

import contextlib
import http.client
import json
import math
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlparse

import pytest
from helpers import damage_segments, rewrite_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer, search
from landmark_memory.app import serve as served
from landmark_memory.app import serve_routes
from landmark_memory.app.cli import API_KEY_VARIABLE, main
from landmark_memory.format.text_file import TEXT_INDEX
from landmark_memory.models.loaded import LoadedModel

pytestmark = pytest.mark.slow  # servers in processes of their own

KEY, MODEL = "kéy-ü", "landmark-memory-tiny"  # not ASCII: clients send it as UTF-8 bytes
ALLOWED = "memory.example"


@pytest.fixture(scope="module")
def server(corpus, serving):
    with serving(corpus, "--api-key", KEY, "--max-tokens", "64", "--max-body", "4096",
                 "--allowed-host", ALLOWED) as url:
        yield url


def call(url, path, body=None, *, method=None, key=KEY, host=None, chunked=False, raw=None, headers=None):
    """``(status, body bytes)`` of one request, its headers as given (``host``: the Host header;
    ``headers``: others, None to leave one out)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {k: v for k, v in {"Content-Type": "application/json", **({"Host": host} if host else {}),
                                 **(headers or {})}.items() if v is not None}
    if key:
        headers["Authorization"] = b"Bearer " + key.encode()
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    if chunked:
        data = iter([data[i:i + 1000] for i in range(0, len(data), 1000)])
        headers["Transfer-Encoding"] = "chunked"
    conn.request(method or ("GET" if data is None else "POST"), path, body=data, headers=headers,
                 encode_chunked=chunked)
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def refusal(status, data, code=None):
    """OpenAI's error shape, with ``code`` where given."""
    doc = json.loads(data)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "code"}, doc
    assert doc["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert code is None or doc["error"]["code"] == code, doc
    return doc["error"]


def events(data: bytes) -> list:
    """The server-sent events of a streamed answer, ``[DONE]`` as the string."""
    lines = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    return [x if x == "[DONE]" else json.loads(x) for x in lines]


def test_only_the_hosts_the_server_is_bound_as_and_those_allowed_are_answered(server):
    port = urlparse(server).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", ALLOWED):
        assert call(server, "/v1/models", host=host)[0] == 200, host
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example", "[::2]"):
        status, data = call(server, "/v1/memory", host=host)
        assert status == 403 and "--allowed-host" in refusal(status, data, "host_not_allowed")["message"], host
        assert call(server, "/", host=host)[0] == 403  # the page too: it would run the rebinding page's script


@pytest.mark.parametrize("headers, status, code", [
    ({"Content-Type": None}, 415, "unsupported_media_type"),
    ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
    ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "unsupported_media_type"),
    ({"Origin": "http://evil.example"}, 403, "origin_not_allowed"),
    ({"Origin": "null"}, 403, "origin_not_allowed"),
    ({"Origin": "http://127.0.0.1:1"}, 403, "origin_not_allowed"),  # this machine, another port: another page
    ({"Origin": "http://evil.example", "Content-Type": "text/plain"}, 403, "origin_not_allowed"),
    ({"Origin": "http://[::1"}, 403, "origin_not_allowed"),  # no URL: no bare 500
    ({"Origin": "http://[evil]"}, 403, "origin_not_allowed")])
@pytest.mark.parametrize("body", [None, b"", b'{"name": "from-a-page"}'])
def test_a_web_page_of_another_origin_or_a_body_not_declared_json_changes_nothing(server, headers, status, code, body):
    got, data = call(server, "/v1/sessions", method="POST", raw=body, headers=headers)
    assert got == status
    refusal(got, data, code)
    got, data = call(server, "/v1/completions", COMPLETION, headers=headers)
    assert got == status
    assert json.loads(call(server, "/v1/sessions")[1])["data"] == []  # no session was made


def test_a_request_with_two_origin_headers_is_refused_whichever_comes_last(server):
    u = urlparse(server)
    for origins in (("http://evil.example", f"http://127.0.0.1:{u.port}"), (f"http://127.0.0.1:{u.port}",) * 2):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        body = json.dumps({"name": "two-origins"}).encode()
        conn.putrequest("POST", "/v1/sessions")
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("Authorization", b"Bearer " + KEY.encode()), *[("Origin", o) for o in origins]]:
            conn.putheader(name, value)
        conn.endheaders(body)
        r = conn.getresponse()
        status, data = r.status, r.read()
        conn.close()
        assert status == 403 and "more than one Origin" in refusal(status, data, "origin_not_allowed")["message"]
    assert json.loads(call(server, "/v1/sessions")[1])["data"] == []


def test_the_servers_own_page_and_allowed_hosts_pages_may_change_what_they_ask(server):
    port = urlparse(server).port
    for origin, host, name in ((f"http://127.0.0.1:{port}", None, "own"), ("http://memory.example", ALLOWED, "named")):
        status, data = call(server, "/v1/sessions", {"name": name}, host=host, headers={"Origin": origin})
        assert status == 201, data
        assert call(server, f"/v1/sessions/{name}", method="DELETE", host=host, headers={"Origin": origin})[0] == 200
    assert call(server, "/v1/completions", COMPLETION, headers={"Content-Type": "application/json; charset=utf-8"}
                )[0] == 200


def test_a_session_name_is_bounded_in_bytes_and_every_session_made_can_be_deleted(server):
    longest, over = "名" * 85, "名" * 86  # 255 and 258 bytes in UTF-8, both within 100 characters
    status, data = call(server, "/v1/sessions", {"name": over})
    assert status == 400 and "at most 255 bytes" in refusal(status, data, "invalid_session_name")["message"]
    assert call(server, "/v1/sessions", {"name": longest})[0] == 201
    status, data = call(server, "/v1/sessions/" + quote(longest), method="DELETE")
    assert status == 200, data
    assert json.loads(call(server, "/v1/sessions")[1])["data"] == []


def test_a_session_whose_turn_log_is_a_link_a_hard_link_or_damaged_is_503_and_nothing_is_written(server, corpus,
                                                                                                 tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("x" * 22_000)
    body = {**CHAT, "session": "linked"}
    assert call(server, "/v1/sessions", {"name": "linked"})[0] == 201
    assert call(server, "/v1/chat/completions", body)[0] == 200
    log = corpus / "sessions" / "linked" / "turns.jsonl"
    good = log.read_bytes()
    log.unlink()
    log.symlink_to(outside)
    for stream in (False, True):
        status, data = call(server, "/v1/chat/completions", {**body, "stream": stream})
        error = refusal(status, data, "session_unavailable") if not stream else events(data)[-2]["error"]
        assert (status == 503 or stream) and "symbolic link" in error["message"]
    assert outside.read_text() == "x" * 22_000
    log.unlink()
    outside.write_bytes(good)
    os.link(outside, log)  # a hard link to a file outside: refused, never written through
    status, data = call(server, "/v1/chat/completions", body)
    assert status == 503 and "hard links" in refusal(status, data, "session_unavailable")["message"]
    assert outside.read_bytes() == good
    log.unlink()
    log.write_bytes(good[:len(good) // 2])
    status, data = call(server, "/v1/chat/completions", body)
    assert status == 503 and "truncated" in refusal(status, data, "session_unavailable")["message"]
    assert log.read_bytes() == good[:len(good) // 2]
    log.write_bytes(good)
    assert call(server, "/v1/chat/completions", body)[0] == 200
    assert call(server, "/v1/sessions/linked", method="DELETE")[0] == 200


def test_a_key_that_is_not_ascii_authorizes_and_any_other_is_401(server):
    assert call(server, "/v1/models")[0] == 200
    for key in (None, "kéy", "key-u", KEY[:-1], KEY + "x"):
        status, data = call(server, "/v1/models", key=key)
        refusal(status, data, "invalid_api_key")
        assert status == 401


def test_an_empty_key_is_refused_and_the_environment_gives_one(corpus, serving, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:  # --api-key "$UNSET"
        main(["serve", str(corpus), "--api-key", ""])
    assert stop.value.code == 2 and "empty" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_VARIABLE, " ")
    assert main(["serve", str(corpus)]) == 2 and API_KEY_VARIABLE in capsys.readouterr().err
    monkeypatch.delenv(API_KEY_VARIABLE)
    with serving(corpus, env={API_KEY_VARIABLE: "from-the-environment"}) as url:
        assert call(url, "/v1/models", key=None)[0] == 401
        assert call(url, "/v1/models", key="from-the-environment")[0] == 200


COMPLETION = {"model": MODEL, "prompt": "The captain said", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "The captain said"}], "max_tokens": 4}


@pytest.mark.parametrize("route,change,code", [
    ("/v1/completions", {"temperature": math.nan}, "invalid_temperature"),
    ("/v1/completions", {"temperature": -0.5}, "invalid_temperature"),
    ("/v1/completions", {"seed": 2**70}, "invalid_seed"),
    ("/v1/completions", {"prompt": "caf\ud800"}, "invalid_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "invalid_content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "invalid_prompt"),
    ("/v1/completions", {"n": 2}, "invalid_n"),
    ("/v1/completions", {"logprobs": 3}, "invalid_logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "invalid_logprobs"),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "invalid_stop"),
    ("/v1/completions", {"stop": ""}, "invalid_stop"),
    ("/v1/chat/completions", {"evidence": "all"}, "invalid_evidence"),
    ("/v1/chat/completions", {"policy": "everything"}, "invalid_policy"),
    ("/v1/chat/completions", {"policy": "heads"}, "invalid_policy"),  # the bundled model has no heads
])
@pytest.mark.parametrize("stream", [False, True])
def test_values_that_were_tracebacks_are_400_streamed_or_not(server, route, change, code, stream):
    body = {**(CHAT if "chat" in route else COMPLETION), **change, "stream": stream}
    status, data = call(server, route, raw=json.dumps(body).encode())  # NaN as Python's json writes it
    assert status == 400
    refusal(status, data, code)


def test_a_search_question_that_is_no_text_is_400_as_a_chats_is(server):
    status, data = call(server, "/v1/search", {"question": "zebra crossings \ud800"})
    assert status == 400 and "not valid text" in refusal(status, data, "invalid_question")["message"]


def test_a_damaged_or_hostile_text_index_never_makes_search_or_memory_a_500(corpus, tmp_path):
    memory = tmp_path / "m"
    shutil.copytree(corpus, memory)
    damage_segments(memory, "flipped")  # sealed: the server reads it as it lies, and meets the damage
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        want = search(mem, load_tokenizer(), "the treasure map", k=3).to_json()["passages"]
    with in_process(memory) as url:
        status, data = call(url, "/v1/search", {"question": "the treasure map", "passages": 3}, key=None)
        assert status == 200 and json.loads(data)["passages"] == want
        os.utime(memory / TEXT_INDEX)  # now a received one: a recursive view named meta
        rewrite_index(memory, ["DROP TABLE meta", "CREATE VIEW meta(key, value) AS WITH RECURSIVE r(i) AS "
                                                  "(SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT 'blocks', i FROM r"])
        status, data = call(url, "/v1/memory", key=None)
        assert status == 200 and "other tables" in json.loads(data)["text_index"]["problem"]


def test_a_tiny_temperature_over_http_answers_as_greedy_decoding_does(server):
    status, greedy = call(server, "/v1/completions", {**COMPLETION, "max_tokens": 8})
    status_tiny, tiny = call(server, "/v1/completions", {**COMPLETION, "max_tokens": 8, "temperature": 1e-300,
                                                          "seed": 2**64 - 1})
    assert status == status_tiny == 200
    assert json.loads(tiny)["choices"][0]["text"] == json.loads(greedy)["choices"][0]["text"]


@pytest.mark.parametrize("how", ["chunked body over the limit", "invalid UTF-8", "JSON nested deep", "no route",
                                 "wrong method", "POST to a GET route"])
def test_every_refusal_has_openais_shape(server, how):
    status, data = {
        "chunked body over the limit": lambda: call(server, "/v1/completions", {**COMPLETION, "prompt": "a" * 6000},
                                                    chunked=True),
        "invalid UTF-8": lambda: call(server, "/v1/completions", raw=b'{"model": "\xff\xfe"}'),
        "JSON nested deep": lambda: call(server, "/v1/completions", raw=b"[" * 2000 + b"]" * 2000),
        "no route": lambda: call(server, "/v1/nothing"),
        "wrong method": lambda: call(server, "/v1/models", method="DELETE"),
        "POST to a GET route": lambda: call(server, "/v1/memory", {}),
    }[how]()
    assert status == {"chunked body over the limit": 413, "invalid UTF-8": 400, "JSON nested deep": 400,
                      "no route": 404}.get(how, 405), data
    refusal(status, data)


def test_a_stop_string_ends_the_answer_before_it_streamed_or_not(server):
    full = json.loads(call(server, "/v1/completions", {**COMPLETION, "max_tokens": 24})[1])["choices"][0]["text"]
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]  # a word well inside the answer
    want = full[:full.index(stop)]
    done = json.loads(call(server, "/v1/completions", {**COMPLETION, "max_tokens": 24, "stop": [stop, "\x00"]})[1])
    assert done["choices"][0]["text"] == want and done["choices"][0]["finish_reason"] == "stop"
    got = events(call(server, "/v1/completions", {**COMPLETION, "max_tokens": 24, "stop": stop, "stream": True})[1])
    assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in got[:-1]) == want


@contextlib.contextmanager
def in_process(corpus, **options):
    """The server's application in this process (uvicorn in a thread), so that a test can
    watch what its answers do; its URL."""
    import uvicorn

    cfg = served.ServeConfig(corpus, MODEL, **options)
    app = served.create_app(cfg, LoadedModel(LandmarkGPT.from_pretrained(), load_tokenizer()))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_stops_its_answer_streamed_or_not(corpus, monkeypatch, stream):
    generated, ask = [], serve_routes.converse

    def counted(*args, on_token=None, **kwargs):
        def tap(t):
            generated.append(t)
            on_token(t)
        return ask(*args, on_token=tap, **kwargs)

    monkeypatch.setattr(serve_routes, "converse", counted)
    with in_process(corpus, max_tokens=512, parallel=1) as url:
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({**COMPLETION, "max_tokens": 512, "stream": stream}),
                     headers={"Content-Type": "application/json"})
        if stream:
            r = conn.getresponse()
            while b'"text": "' not in r.readline():  # the first piece of text
                pass
        while not generated:  # its answer under way
            time.sleep(0.01)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()  # and leave
        seen = -1
        while seen != len(generated):  # until the answer stops
            seen = len(generated)
            time.sleep(0.5)
        assert 0 < len(generated) < 512
        status, data = call(url, "/v1/completions", COMPLETION, key=None)  # its turn is free again
        assert status == 200, data


def test_after_a_dropped_stream_the_next_request_on_its_session_waits_its_turn(corpus, monkeypatch):
    with in_process(corpus, max_tokens=512, parallel=2) as url:
        assert call(url, "/v1/sessions", {"name": "dropped"}, key=None)[0] == 201
        body = {**CHAT, "session": "dropped"}
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "max_tokens": 512, "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        while b'"content": "' not in r.readline():  # the first piece of text
            pass
        conn.close()  # and leave, the next request on the session at once
        status, data = call(url, "/v1/chat/completions", body, key=None)
        assert status == 200, data
        turns = json.loads(call(url, "/v1/sessions/dropped", key=None)[1])["turns"]
        assert [t["role"] for t in turns] == ["user", "assistant"]  # the dropped turn is not kept
        assert call(url, "/v1/sessions/dropped", method="DELETE", key=None)[0] == 200


def test_cheap_routes_answer_while_answers_wait_their_turn(corpus, monkeypatch):
    release, ask = threading.Event(), serve_routes.converse

    def held(*args, **kwargs):  # an answer that holds its turn until the test lets it go
        release.wait(60)
        return ask(*args, **kwargs)

    monkeypatch.setattr(serve_routes, "converse", held)
    with in_process(corpus, parallel=1) as url, ThreadPoolExecutor(48) as pool:
        queued = [pool.submit(call, url, "/v1/completions", COMPLETION, key=None) for _ in range(45)]
        time.sleep(0.5)
        try:
            for path in ("/v1/models", "/", "/v1/memory"):
                assert call(url, path, key=None)[0] == 200, path
            assert not any(f.done() for f in queued)  # they were waiting all along
        finally:
            release.set()
        assert all(f.result()[0] == 200 for f in queued)


def test_damage_found_while_serving_is_503_and_the_server_lives_on(documents, tmp_path, serving):
    memory = tmp_path / "m"
    assert main(["build", str(memory), "--input", str(documents), "--chunk-size", "100", "--quiet"]) == 0
    manifest = (memory / "manifest.json").read_bytes()
    stores = {f: f.read_bytes() for f in memory.glob("store/lmdb/data.mdb")}
    with serving(memory) as url:
        assert call(url, "/v1/completions", COMPLETION)[0] == 200
        for store, data in stores.items():  # cut under the running server: its next read would be a SIGBUS
            with open(store, "r+b") as f:
                f.truncate(len(data) // 2)
        status, data = call(url, "/v1/completions", COMPLETION)
        assert status == 503 and "data.mdb" in refusal(status, data, "memory_unavailable")["message"]
        status, data = call(url, "/v1/chat/completions", {**CHAT, "stream": True})  # 200 sent before the damage is met
        got = events(data)
        assert status == 200 and got[-1] == "[DONE]" and got[-2]["error"]["code"] == "memory_unavailable"
        (memory / "manifest.json").write_text("{")
        status, data = call(url, "/v1/memory")
        refusal(status, data, "memory_unavailable")
        assert status == 503
        for store, data in stores.items():  # restored: served again
            store.write_bytes(data)
        (memory / "manifest.json").write_bytes(manifest)
        assert call(url, "/v1/memory")[0] == 200


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stream",
          "passages", "stop", "n", "logprobs", "top_logprobs"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/memory", "/",
                              "/v1/nothing"]),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
       base=st.sampled_from([COMPLETION, CHAT, {}]),
       changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4),
       encoding=st.sampled_from(["json", "utf-16", "bytes", "chunked"]),
       noise=st.binary(max_size=64))
def test_fuzzed_requests_never_get_a_500_and_refusals_have_openais_shape(server, route, method, base, changes,
                                                                       encoding, noise):
    body = {**base, **changes}
    if "max_tokens" not in changes and "max_completion_tokens" not in changes:
        body["max_tokens"] = 2  # answers stay short
    raw = {"json": json.dumps(body).encode(), "utf-16": json.dumps(body).encode("utf-16"),
           "bytes": noise, "chunked": json.dumps(body).encode()}[encoding]
    status, data = call(server, route, method=method, raw=raw if method != "GET" else None,
                        chunked=encoding == "chunked" and method != "GET")
    assert status < 500, (status, data)
    if status >= 400:
        refusal(status, data)
    elif data.startswith(b"data: "):  # a stream ends with [DONE], after an error event or not
        assert events(data)[-1] == "[DONE]"
