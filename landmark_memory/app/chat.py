"""``landmark-memory chat``: a session over a memory, in a terminal or a pipe.

On a terminal: a prompt with line editing and history (``readline``), each answer streamed as
it is generated, and a few commands (``/passages``, ``/sessions``, ``/help``, ``/quit``). From a
pipe: each input line is one user turn, and each answer is printed when it is done (one JSON
object per line with ``--json``). Every turn is committed to the session before the next is
read, so a chat stopped at any point resumes with ``--session NAME`` at its last answer.
"""

import sys
from dataclasses import asdict
from typing import TextIO

from ..core.ask_options import AskOptions
from ..core.printing import json_text, printable
from ..format.session_files import list_sessions
from ..memory import LandmarkMemory
from ..models.loaded import LoadedModel
from ..uses.answer import Answer, say
from ..uses.session import Session

HELP = """/passages  the passages the last answer read
/sessions  the sessions of this memory
/help      this list
/quit      end the chat (so does Ctrl-D); Ctrl-C stops an answer, the session stays at its last turn"""


def answer_json(a: Answer) -> dict:
    """An answer as one line of ``chat --json``."""
    return {"session": a.session, "text": a.text, "tokens": a.tokens, "passages": [asdict(p) for p in a.passages],
            **a.evidence_fields()}


def passages_text(a: Answer | None) -> str:
    """The passages of an answer, as the terminal shows them."""
    if a is None or not a.passages:
        return "(no passages: ask something first)" if a is None else "(the answer read no passage of the memory)"
    out = a.evidence_lines()
    for p in a.passages:
        where = (f"session {p.session}, turn {p.turn + 1}" if p.session else f"{p.source or 'the memory'}") + \
            f" at token {p.token_offset:,}"
        out.append(f"--- block {p.block} ({100 * p.share:.0f}% of lookups), {where}:\n{p.text.strip()}")
    return "\n".join(out)


def sessions_text(memory) -> str:
    """The sessions of a memory, one line each (``landmark-memory sessions``)."""
    rows = list_sessions(memory)
    if not rows:
        return "(no sessions yet)"
    return "\n".join(f"{s.name:<24} {s.turns:>6,} turns {s.tokens:>10,} tokens  {s.updated or s.problem}" for s in rows)


def chat(session: Session, model: LoadedModel, options: AskOptions, *, as_json: bool = False,
         stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Hold the chat of ``session`` (over its memory, opened read-only with ``model``'s module)
    until the input ends, each turn answered by ``options`` (``stdin``, ``stdout``: the
    process's as they are when called); the exit status."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if stdin.isatty():
        return _terminal(session, model, options, stdout)
    for line in stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        a = say(session, model, line, options)
        print(json_text(answer_json(a)) if as_json else printable(a.text.strip()), file=stdout, flush=True)
    return 0


def _terminal(session: Session, model: LoadedModel, options: AskOptions, out: TextIO) -> int:
    import readline  # noqa: F401 - line editing and history for input()

    mem: LandmarkMemory = session.mem
    print(f"session {session.name}: {session.n_turns} turns so far over {printable(str(mem.dir.path))} "
          "(/help for commands, Ctrl-D ends)", file=out)
    last = None
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print(file=out)
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/quit", "/exit"):
            return 0
        if command.startswith("/"):
            print(printable(_command_reply(command, last, mem)), file=out)
            continue
        stream = _Stream(model.tokenizer, out)
        print("memory> ", end="", file=out, flush=True)
        try:
            last = say(session, model, line, options, on_token=stream.show)
            print(printable(last.text[len(stream.shown):]), file=out)
        except KeyboardInterrupt:  # the turn is not committed: the session goes back to its last one
            print("\n(stopped: this turn is forgotten, the session stays at its last answer)", file=out)
            session = session.reopen()


def _command_reply(command: str, last, mem: LandmarkMemory) -> str:
    """What a ``/command`` of the chat prints: the last answer's passages, the memory's sessions, help."""
    if command == "/passages":
        return passages_text(last)
    if command == "/sessions":
        return sessions_text(mem.dir.path)
    return HELP if command == "/help" else f"unknown command {command}\n{HELP}"


class _Stream:
    """An answer streamed as its tokens come: a character split over tokens waits for its last one."""

    def __init__(self, tokenizer, out: TextIO):
        self.tokenizer, self.out, self.tokens, self.shown = tokenizer, out, [], ""

    def show(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):
            print(printable(text[len(self.shown):]), end="", file=self.out, flush=True)
            self.shown = text
