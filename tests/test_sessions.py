"""Sessions: conversations kept in a memory of their own over a corpus, resumed by name in a new
process bit for bit, isolated from each other, safe when killed mid-turn, seeing a corpus that
grows, through the library, the ``chat`` and ``sessions`` commands and the server."""

import io
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest
import torch
from helpers import turns_read_as_one_forward

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.format import MemoryFileError
from landmark_memory.format.session_files import SessionError, check_name, delete_session, list_sessions
from landmark_memory.uses.answer import Message, converse, say
from landmark_memory.uses.session import Session

TURNS = ["The captain came to the inn on a cold night, with his sea chest on a barrow, and he looked round the cove "
         "and whistled to himself as he did so, and then he said that",
         "Then the doctor, who had a powdered wig and bright black eyes, sat down by the fire and spoke to my "
         "mother about the old seaman, who",
         "My friend Jim Hawkins keeps a map of the island in his sea chest, folded in oilcloth, with three red crosses "
         "on it, and he told me that",
         "At the inn there was", "What did the captain keep in his chest?"]
OPTIONS = dict(raw=True, max_new_tokens=12, passages=4)
KEY, MODEL = "test-key", "landmark-memory-tiny"


@pytest.fixture(scope="module")
def model():
    return LandmarkGPT.from_pretrained()


def held(corpus, model, name, turns, top_k=2):
    """The answers to ``turns`` in the session ``name`` (made or resumed) over ``corpus``, in this process."""
    with LandmarkMemory.open(corpus, model, readonly=True, top_k=top_k) as mem, Session.open(mem, name) as s:
        return [say(s, load_tokenizer(), t, **OPTIONS) for t in turns]


def probe(corpus, model, name, top_k=2):
    """The logits of a probe text read after the session ``name`` (not committed)."""
    with LandmarkMemory.open(corpus, model, readonly=True, top_k=top_k) as mem, Session.open(mem, name) as s:
        s.attach()
        return mem.forward(torch.tensor([load_tokenizer().encode(" and the parrot said").ids])).logits


def unnamed(a):
    """An answer's passages, their session's name left out."""
    return [replace(p, session=p.session and "-") for p in a.passages]


def in_new_process(corpus, name, turns, kill_after=None):
    """``held`` in a process of its own; ``kill_after``: SIGKILL it after that many tokens of its last answer."""
    script = f"""
import os, signal, sys
from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.uses.answer import say
from landmark_memory.uses.session import Session
turns, kill = {turns!r}, {kill_after!r}
with LandmarkMemory.open({str(corpus)!r}, LandmarkGPT.from_pretrained(), readonly=True, top_k=2) as mem:
    with Session.open(mem, {name!r}) as s:
        for i, t in enumerate(turns):
            seen = []
            def on_token(tok):
                seen.append(tok)
                if kill is not None and i == len(turns) - 1 and len(seen) == kill:
                    os.kill(os.getpid(), signal.SIGKILL)
            say(s, load_tokenizer(), t, on_token=on_token, **{OPTIONS!r})
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_session_resumed_in_a_new_process_answers_bit_for_bit_as_one_that_never_stopped(corpus, model):
    straight = held(corpus, model, "straight", TURNS)
    for i in range(len(TURNS) - 1):  # every turn but the last in processes of their own, one each
        assert in_new_process(corpus, "resumed", TURNS[i:i + 1]).returncode == 0
    last = held(corpus, model, "resumed", TURNS[-1:])[0]
    assert last.tokens == straight[-1].tokens and unnamed(last) == unnamed(straight[-1])
    assert any(p.session == "straight" for a in straight for p in a.passages)  # the session's own blocks are read
    assert torch.equal(probe(corpus, model, "resumed"), probe(corpus, model, "straight"))
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, Session.open(mem, "resumed") as s:
        assert [t.role for t in s.turns] == ["user", "assistant"] * len(TURNS)
        assert [t.text for t in s.turns[::2]] == TURNS and s.turns[-1].text == last.text
        assert s.turns[-1].passages == [p.__dict__ for p in last.passages]


def test_importing_the_library_keeps_mkl_reproducible_run_to_run_unless_the_user_chose():
    code = "import os, landmark_memory; print(os.environ.get('MKL_CBWR'))"
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    for given, expected in ((None, "AUTO"), ("COMPATIBLE", "COMPATIBLE")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=env if given is None else {**env, "MKL_CBWR": given})
        assert run.stdout.strip() == expected, run.stderr


def test_what_one_session_was_told_the_other_cannot_retrieve(corpus, model):
    alone = held(corpus, model, "bob-alone", TURNS[3:])
    held(corpus, model, "alice", TURNS[:3])  # told of the map, its blocks in its own files
    beside = held(corpus, model, "bob", TURNS[3:])
    assert [a.tokens for a in beside] == [a.tokens for a in alone]
    assert list(map(unnamed, beside)) == list(map(unnamed, alone))
    assert {p.session for a in beside for p in a.passages} <= {None, "bob"}
    assert torch.equal(probe(corpus, model, "bob"), probe(corpus, model, "bob-alone"))


def test_a_session_killed_mid_turn_resumes_at_its_last_commit(corpus, model):
    done = in_new_process(corpus, "killed", TURNS[:3], kill_after=5)
    assert done.returncode == -signal.SIGKILL
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, Session.open(mem, "killed") as s:
        assert len(s.turns) == 4  # two turns committed, the third lost whole
    assert held(corpus, model, "killed", TURNS[2:])[-1].tokens == held(corpus, model, "unkilled", TURNS)[-1].tokens


def test_a_session_is_held_by_one_process_and_deleted_whole(corpus, model):
    held(corpus, model, "gone", TURNS[:1])
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, Session.open(mem, "gone"):
        with pytest.raises(SessionError, match="in use") as e:
            delete_session(corpus, "gone")
        assert e.value.kind == "busy"
    delete_session(corpus, "gone")
    assert "gone" not in {s.name for s in list_sessions(corpus)}
    assert not [p for p in (corpus / "sessions").iterdir() if p.name.startswith(".")]
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        with pytest.raises(SessionError, match="no session") as e:
            Session.open(mem, "gone", create=False)
        assert e.value.kind == "missing"
        with Session.open(mem, "gone") as s:
            assert s.turns == [] and s.n_tokens == 0


@pytest.mark.parametrize("name", ["../x", "/etc", "", "a" * 101, "bad\x01name", ".hidden", "-x", "a/b", "a b"])
def test_a_session_name_is_a_name_never_a_path(name):
    with pytest.raises(SessionError, match="no session name"):
        check_name(name)


def test_a_session_name_that_is_a_name_is_taken():
    assert check_name("Zoë_notes-2.v1") == "Zoë_notes-2.v1" and check_name("a" * 100)


def test_a_session_opened_as_a_memory_is_refused_in_one_line(corpus, model):
    held(corpus, model, "plain", TURNS[:1])
    with pytest.raises(MemoryFileError, match="is the session 'plain' of the memory"):
        LandmarkMemory.open(corpus / "sessions" / "plain", model, readonly=True)


def test_a_corpus_that_gains_documents_is_seen_from_the_next_turn_on(documents, tmp_path, model):
    (tmp_path / "in").mkdir()
    first, second, third = sorted(documents.glob("*.txt"))
    for f in (first, second):
        (tmp_path / "in" / f.name).write_text(f.read_text())
    mem_path, tok = tmp_path / "m", load_tokenizer()
    assert main(["build", str(mem_path), "--input", str(tmp_path / "in"), "--chunk-size", "100", "--quiet"]) == 0
    with LandmarkMemory.open(mem_path, model, readonly=True, top_k=2) as mem, Session.open(mem, "s") as s:
        say(s, tok, TURNS[0], **OPTIONS)
        assert in_new_process(mem_path, "t", TURNS[:1]).returncode == 0
        base = mem.attachment.base_blocks
        read = mem.tokens(0, base)  # the session's blocks
        assert main(["build", str(mem_path), "--input", str(tmp_path / "in"), str(third), "--quiet"]) == 0
        kept = [say(s, tok, t, **OPTIONS) for t in TURNS[1:3]]  # the kept memory follows the corpus's new commit
        with LandmarkMemory.open(mem_path, model, readonly=True) as grown:
            base = mem.attachment.base_blocks
            assert base == grown.n_blocks and len(mem.inputs) == 3  # every document committed before
        assert (mem.tokens(0, base)[:len(read)] == read).all()  # its earlier turns stay as they were read
    resumed = held(mem_path, model, "t", TURNS[1:3])  # the same turns, resumed in this process over the grown corpus
    assert [a.tokens for a in resumed] == [a.tokens for a in kept]
    other = tmp_path / "other"
    assert main(["build", str(other), "--input", str(third), "--chunk-size", "100", "--quiet"]) == 0
    os.rename(mem_path / "sessions", other / "sessions")  # a session moved to another corpus
    with LandmarkMemory.open(other, model, readonly=True) as mem, Session.open(mem, "s") as s:
        with pytest.raises(SessionError, match="held over another memory") as e:
            say(s, load_tokenizer(), TURNS[2], **OPTIONS)
        assert e.value.kind == "other"


def test_chat_from_a_pipe_answers_each_line_and_sessions_lists_and_deletes(corpus, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{TURNS[0]}\n\n{TURNS[1]}\n"))
    assert main(["chat", str(corpus), "--session", "piped", "--raw", "--json", "--max-new-tokens", "5"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(d["session"] == "piped" and len(d["tokens"]) == 5 for d in lines)
    assert main(["sessions", str(corpus), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["piped"]["turns"] == 4 and rows["piped"]["tokens"] > 10
    assert main(["sessions", str(corpus), "--delete", "piped"]) == 0
    assert "deleted the session piped" in capsys.readouterr().out and not (corpus / "sessions" / "piped").exists()
    assert main(["sessions", str(corpus), "--delete", "piped"]) == 2
    assert "no session 'piped'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["chat", "M", "--session", "../x"], ["sessions", "M", "--delete", "/etc"],
                                  ["chat", "M", "--session", "x" * 101]])
def test_a_path_for_a_session_name_is_refused_before_anything_loads(argv, corpus, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(corpus) if a == "M" else a for a in argv])
    assert e.value.code == 2 and "no session name" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(corpus, serving):
    with serving(corpus, "--api-key", KEY, "--max-tokens", "64", "--parallel", "2") as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


@pytest.mark.slow
def test_the_openai_client_holds_a_session_by_sending_only_its_new_messages(server, corpus, model):
    c = client(server)
    c.post("/sessions", body={"name": "web"}, cast_to=object)
    got = [c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": t}], max_tokens=12,
                                     extra_body={"session": "web", "passages": 4}) for t in TURNS[:2]]
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, Session.open(mem, "web-library") as s:
        want = [say(s, load_tokenizer(), t, max_new_tokens=12, passages=4) for t in TURNS[:2]]
    assert [g.choices[0].message.content for g in got] == [w.text for w in want]
    assert got[1].passages == [p.__dict__ for p in want[1].passages]
    streamed = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TURNS[2]}],
                                              max_tokens=12, stream=True, extra_body={"session": "web"}))
    listed = {s["name"]: s for s in c.get("/sessions", cast_to=object)["data"]}
    assert listed["web"]["turns"] == 6
    turns = c.get("/sessions/web", cast_to=object)["turns"]
    assert turns[-1]["text"] == "".join(ch.choices[0].delta.content or "" for ch in streamed)
    assert c.delete("/sessions/web", cast_to=object) == {"name": "web", "deleted": True}
    with pytest.raises(openai.NotFoundError, match="has no session 'web'"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                  extra_body={"session": "web"})


def test_without_a_session_the_whole_conversation_sent_is_read(server, corpus, model):
    messages = [Message("system", "You answer from the book."), Message("user", TURNS[0]),
                Message("assistant", "he would stay."), Message("user", TURNS[1])]
    got = client(server).chat.completions.create(model=MODEL, messages=[m.__dict__ for m in messages], max_tokens=8)
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        want = converse(mem, load_tokenizer(), messages, max_new_tokens=8)
        mem.rewind()
        last_only = converse(mem, load_tokenizer(), messages[-1:], max_new_tokens=8)
    assert got.choices[0].message.content == want.text != last_only.text


def test_requests_on_one_session_are_answered_one_after_the_other_and_sessions_in_parallel(server, corpus, model):
    c = client(server)
    for name in ("p1", "p2"):
        c.post("/sessions", body={"name": name}, cast_to=object)
    work = [(name, t) for t in TURNS[:3] for name in ("p1", "p2")]

    def one(job):
        name, text = job
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=6,
                                         extra_body={"session": name}).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, work))
    for name in ("p1", "p2"):  # whatever order they came in, each turn read the whole turn before it
        turns = c.get(f"/sessions/{name}", cast_to=object)["turns"]
        assert [t["role"] for t in turns] == ["user", "assistant"] * 3
        with LandmarkMemory.open(corpus, model, readonly=True) as mem, Session.open(mem, name + "-replay") as s:
            replay = [say(s, load_tokenizer(), t["text"], max_new_tokens=6).text for t in turns[::2]]
        assert replay == [t["text"] for t in turns[1::2]]


@pytest.mark.parametrize("body, status, code", [
    ({"session": "../etc"}, 400, "invalid_session_name"), ({"session": "x" * 101}, 400, "invalid_session_name"),
    ({"session": "nobody"}, 404, "session_not_found")])
def test_a_bad_or_missing_session_in_a_request_is_refused_in_openais_shape(server, body, status, code):
    c = client(server)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], extra_body=body)
    assert e.value.status_code == status and e.value.body["code"] == code
    with pytest.raises(openai.APIStatusError) as e:
        c.post("/sessions", body={"name": "ok"}, cast_to=object)
        c.post("/sessions", body={"name": "ok"}, cast_to=object)
    assert e.value.status_code == 409 and e.value.body["code"] == "session_exists"
    c.delete("/sessions/ok", cast_to=object)


def test_a_damaged_session_is_named_by_verify_and_refused_in_one_line(corpus, model, capsys):
    held(corpus, model, "damaged", TURNS[:2])
    folder = corpus / "sessions" / "damaged"
    for name, match in (("turns.jsonl", "turns.jsonl does not match"), ("turns.idx", "turns.idx does not match")):
        data = bytearray((folder / name).read_bytes())
        data[10] ^= 1
        (folder / name).write_bytes(bytes(data))
        assert main(["info", str(corpus), "--verify"]) == 2
        assert f"session damaged: {folder / name} does not match" in capsys.readouterr().out
        with LandmarkMemory.open(corpus, model, readonly=True) as mem:
            with pytest.raises(MemoryFileError, match=match), Session.open(mem, "damaged") as s:
                _ = s.turns  # (the turns' text is read where it is asked for)
        data[10] ^= 1
        (folder / name).write_bytes(bytes(data))
    assert main(["info", str(corpus), "--verify"]) == 0


def test_a_session_folder_that_is_a_link_is_refused(corpus, model, tmp_path):
    (corpus / "sessions").mkdir(exist_ok=True)
    os.symlink(tmp_path, corpus / "sessions" / "linked")
    try:
        with LandmarkMemory.open(corpus, model, readonly=True) as mem:
            with pytest.raises(MemoryFileError, match="symbolic link"):
                Session.open(mem, "linked")
        assert list(tmp_path.iterdir()) == []
    finally:
        os.unlink(corpus / "sessions" / "linked")


@pytest.mark.slow
def test_sessions_outlive_the_server(corpus, serving, model):
    for attempt in range(2):  # a turn, the server stopped, a turn on a new server
        with serving(corpus, "--api-key", KEY) as url:
            c = client(url)
            if attempt == 0:
                c.post("/sessions", body={"name": "lasting"}, cast_to=object)
            got = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TURNS[attempt]}],
                                            max_tokens=8, extra_body={"session": "lasting"})
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, Session.open(mem, "lasting-library") as s:
        want = [say(s, load_tokenizer(), t, max_new_tokens=8) for t in TURNS[:2]]
    assert got.choices[0].message.content == want[1].text


@pytest.mark.slow
def test_chat_on_a_terminal_streams_answers_and_shows_passages_and_sessions(corpus):
    import pty
    import select

    main_fd, child_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "landmark_memory.app.entry", "chat", str(corpus), "--raw",
                             "--session", "tty", "--max-new-tokens", "6"], stdin=child_fd, stdout=child_fd,
                            stderr=child_fd, close_fds=True)
    os.close(child_fd)
    seen = b""

    def prompt(n, timeout=120):  # until the n-th prompt: input typed before it could be lost when it starts
        nonlocal seen
        while seen.count(b"you> ") < n:
            ready, _, _ = select.select([main_fd], [], [], timeout)
            assert ready, seen.decode(errors="replace")
            seen += os.read(main_fd, 4096)

    try:
        prompt(1)
        for n, line in enumerate([TURNS[0], "/passages", "/sessions"], 2):
            os.write(main_fd, (line + "\r").encode())
            prompt(n)
        os.write(main_fd, b"\x04")  # Ctrl-D ends it
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        os.close(main_fd)
    assert b"memory> " in seen and b"% of lookups" in seen and b"\r\ntty " in seen
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem, \
            Session.open(mem, "tty-library") as s:
        want = say(s, load_tokenizer(), TURNS[0], raw=True, max_new_tokens=6)
    assert seen.split(b"memory> ")[1].split(b"you> ")[0].decode() == want.text.replace("\n", "\r\n") + "\r\n"


def test_a_session_of_another_model_is_refused_in_one_line(documents, corpus, model, tmp_path, capsys, monkeypatch):
    held(corpus, model, "moved", TURNS[:1])
    torch.manual_seed(0)
    LandmarkGPT(model.config).save_pretrained(tmp_path / "other-model")
    other = tmp_path / "other"
    assert main(["build", str(other), "--input", str(sorted(documents.glob("*.txt"))[0]), "--model",
                 str(tmp_path / "other-model"), "--chunk-size", "100", "--quiet"]) == 0
    (other / "sessions").mkdir()
    os.rename(corpus / "sessions" / "moved", other / "sessions" / "moved")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    assert main(["chat", str(other), "--model", str(tmp_path / "other-model"), "--session", "moved", "--raw"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was held with another model" in err[0]


def test_a_session_with_every_block_retrieved_reads_as_one_forward_over_the_memory_and_the_conversation(tmp_path):
    from landmark_memory import LandmarkConfig

    torch.manual_seed(0)
    small = LandmarkGPT(LandmarkConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=5,
                                       landmark_id=1)).eval()
    text = torch.randint(4, 64, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = small(text)
    s = turns_read_as_one_forward(small, text, full, tmp_path, chunk_size=10, turns=((33, 51), (51, 80)), rtol=1e-5)
    assert s.mem.attachment is None and s.mem.n_blocks == 6  # closed: the memory let go, rewound to its own
    assert s.blocks.n_blocks == 10 and s.manifest.pending_tokens == 0


