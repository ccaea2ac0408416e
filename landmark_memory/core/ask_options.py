"""``AskOptions``: how a question is answered, the one set of options the command line, the chat
and the server answer by (their defaults are these; ``uses/answer.py`` reads them). Kept apart
from torch, as the command line's arguments are (``app/cli_args.py``)."""

from dataclasses import dataclass

from .names import EVIDENCE


@dataclass(frozen=True)
class AskOptions:
    """How an answer is read and generated (``uses.answer.converse``).

    Parameters
    ----------
    max_new_tokens : int, the answer's most tokens.
    temperature : float, 0: greedy; else sampled with ``seed``.
    seed : int, 0 to 2**64 - 1.
    raw : bool, continue the messages' text as written (joined by new lines); by default a
        chat model (a tokenizer with ``chat_text``) gets them as turns of its chat template,
        and a model without one whose retrieval heads were chosen in a plain frame
        (``EvidenceHeads.frame``) gets the question in it.
    passages : int, how many of the passages read to report.
    evidence : what a chat model with retrieval heads reads before the question once its heads
        have found the quote (``EVIDENCE``): ``"quote"``, the quote; ``"quotes"``, the best
        sentences (the quote first), in the memory's order; ``"around"``, the quote with the
        sentence before and after it; ``"none"``, nothing (the answer reads the memory alone).
    refuse : where the quote holds none of the question's own words (``evidence.support`` 0),
        say ``uses.answer.NOT_FOUND`` instead of generating; False: always generate.
    stop : strings that end the answer where it first produces one of them (cut from its text).
    centre : the messages and the answer choose their blocks by landmark scores centred
        (``MemoryOptions.centre``), whatever the memory reads other text with; False: as it
        reads; None: as the model's ``AskPolicy`` says.
    policy : the answer policy (a name of ``uses.answering.POLICIES``); None: the first that fits
        the model.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    raw: bool = False
    passages: int = 3
    evidence: str = EVIDENCE[0]
    refuse: bool = True
    stop: tuple[str, ...] = ()
    centre: bool | None = None
    policy: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.max_new_tokens < 0 or self.passages < 0:
            raise ValueError(f"max_new_tokens and passages must be >= 0, got {self.max_new_tokens} and "
                             f"{self.passages}")
        if self.evidence not in EVIDENCE:
            raise ValueError(f"evidence must be one of {', '.join(EVIDENCE)}, got {self.evidence!r}")
