"""What the commands and the page show of text from documents, names and answers is text:
terminal escapes and Unicode's direction controls are written as escapes wherever they print."""

import io
import json

import pytest

from landmark_memory.app import chat
from landmark_memory.core.ask_options import AskOptions
from landmark_memory.core.printing import json_text, printable
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.uses.answer import Answer
from landmark_memory.uses.evidence import Quote
from landmark_memory.uses.search import Passage

TITLE = "\x1b]0;owned\x07"  # sets a terminal's window title
BIDI = "report\u202eexe.txt"  # shows as reporttxt.exe
HOSTILE = [TITLE, "\x9b31m", BIDI, "a\u2066b\u2069c", "\u200f\u061c"]


@pytest.mark.parametrize("text", HOSTILE)
def test_printable_and_json_text_leave_no_control_or_direction_character_raw(text):
    for shown in (printable(text), json_text({"t": text})):
        assert shown.isprintable() and all(c not in shown for c in "\x1b\x07\x9b\u202e\u2066\u2069\u200f\u061c")
    assert json.loads(json_text({"t": text}))["t"] == text  # JSON keeps the text as it is


def test_printable_keeps_letters_of_every_script_line_breaks_and_tabs():
    text = "Caf\u00e9 \u4e2d\u6587 \u05e2\u05d1\u05e8\u05d9\u05ea\n\tend"
    assert printable(text) == text and json.loads(json_text([text])) == [text]


class _Tokens:
    """A tokenizer whose ids are characters (what chat decodes as it streams)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


class _Session:
    def __init__(self, tmp_path):
        self.name, self.n_turns = "s", 0
        self.mem = type("M", (), {"dir": type("D", (), {"path": tmp_path / BIDI})()})()


def _answer(text):
    passage = Passage(0, f"/docs/{BIDI}", 0, f"before {TITLE} after", 1.0)
    return Answer("q", text, [ord(c) for c in text], True, [passage], quote=Quote(TITLE + BIDI, 0, 0, 1.0, BIDI, 0))


def test_chat_on_a_terminal_streams_and_shows_passages_as_text(tmp_path, monkeypatch):
    said = f"the title {TITLE} and {BIDI}"

    def say(session, model, line, options, on_token=None):
        for c in said:
            on_token(ord(c))
        return _answer(said)

    lines = iter(["question", "/passages"])
    monkeypatch.setattr(chat, "say", say)
    monkeypatch.setattr(chat, "sessions_text", lambda memory: BIDI)

    def read(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)
    out = io.StringIO()
    assert chat._terminal(_Session(tmp_path), LoadedModel(None, _Tokens()), AskOptions(), out) == 0
    shown = out.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "\\x1b]0;owned\\x07" in shown and "report\\u202eexe.txt" in shown and "before " in shown


@pytest.mark.parametrize("as_json", [False, True])
def test_chat_from_a_pipe_prints_answers_as_text(monkeypatch, as_json):
    said = f"{TITLE}{BIDI}"
    monkeypatch.setattr(chat, "say", lambda *a, **k: _answer(said))
    out = io.StringIO()
    assert chat.chat(None, LoadedModel(None, _Tokens()), AskOptions(), as_json=as_json, stdin=io.StringIO("q\n"),
                     stdout=out) == 0
    shown = out.getvalue()
    assert "\x1b" not in shown and "\u202e" not in shown
    if as_json:
        assert json.loads(shown)["text"] == said
