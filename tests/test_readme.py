"""The README's first screen is what the commands it shows print: its memory is built here, from
the sample book the package ships, and its question asked with SmolLM2 and its adapter."""

import re
from pathlib import Path

import pytest

from landmark_memory.core.names import SAMPLES

pytestmark = pytest.mark.slow  # SmolLM2 reads 7,500 tokens (about a minute on 2 cores)

README = Path(__file__).parents[1] / "README.md"
EXCERPT = 32_000  # characters of the sample book the README's books/ holds


def shown():
    """The README's "Use" screen: the build and ask commands as written, and what ask prints."""
    screen = re.search(r"^## Use\n+```text\n(.*?)```", README.read_text(), re.S | re.M).group(1)
    commands = re.findall(r"^\$ (landmark-memory \w+ .*?)(?:\s+#.*)?$", screen, re.M)
    build = next(c for c in commands if c.startswith("landmark-memory build"))
    ask = next(c for c in commands if c.startswith("landmark-memory ask"))
    search = next(c for c in commands if c.startswith("landmark-memory search"))
    printed, found = ([line for line in screen.split(c, 1)[1].split("\n$ ", 1)[0].splitlines()[1:] if line]
                      for c in (ask, search))  # (what follows each command's own line)
    return build, ask, said(printed), search, found


def said(lines):
    """The lines of an answer: the question, the answer, its quote and what it took from it."""
    return [line for line in lines if line.startswith(("Q: ", "A: ", "Quote: ", "From the quote: ", "Check "))]


def test_the_readmes_question_gets_the_answer_and_the_quote_it_shows(tmp_path, monkeypatch, capsys):
    import shlex

    from landmark_memory.app.cli import main

    build, ask, printed, search, found = shown()
    books = tmp_path / "books"
    books.mkdir()
    text = (SAMPLES / "book" / "up_from_slavery.txt").read_text()
    (books / "up_from_slavery.txt").write_text(text[:EXCERPT])
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(build)[1:] + ["--quiet"]) == 0
    capsys.readouterr()
    assert main(shlex.split(ask)[1:]) == 0
    got = capsys.readouterr().out.replace(str(books.resolve()), "/.../books").splitlines()
    assert said(got) == printed and len(printed) == 4
    assert main(shlex.split(search)[1:]) == 0
    got = capsys.readouterr().out.replace(str(books.resolve()), "/.../books").splitlines()
    assert got[:len(found)] == found and len(found) == 5  # the question, the quote, the first passages
