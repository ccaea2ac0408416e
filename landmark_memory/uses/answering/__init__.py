"""Answer policies: how ``answer.converse`` answers a question, one module each, chosen from the
loaded model (``models.loaded.LoadedModel``) by the first of ``POLICIES`` that fits it (or by name,
``AskOptions.policy``). A new policy is a module with a class of ``AnswerPolicy``'s two methods
and one line below.

    plan.py     Plan, what a policy hands converse; AnswerPolicy; the prompt and blocks they share
    heads.py    HeadsEvidence: the retrieval heads find the quote, read before the question
    reader.py   ReaderFirst: the question reader's best blocks read first by every answer token
    text.py     TextFirst: the text index's best block read first (any model, raw prompts)
"""

from ...core.ask_options import AskOptions
from ...models.loaded import LoadedModel
from .heads import HeadsEvidence
from .plan import AnswerPolicy, Plan
from .reader import ReaderFirst
from .text import TextFirst

POLICIES: dict[str, AnswerPolicy] = {  # the first that fits a model answers through it
    "heads": HeadsEvidence(),
    "reader": ReaderFirst(),
    "text": TextFirst(),
}


def choose_policy(model: LoadedModel, options: AskOptions) -> AnswerPolicy:
    """The policy ``options.policy`` names, else the first of ``POLICIES`` that fits ``model``;
    ``ValueError`` for a name not there, or a policy that does not fit the model."""
    if options.policy is None:
        return next(p for p in POLICIES.values() if p.fits(model, options))
    if options.policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {options.policy!r}")
    chosen = POLICIES[options.policy]
    if not chosen.fits(model, options):
        raise ValueError(f"the {options.policy} policy does not fit this model (it lacks what the policy reads "
                         "with, or was asked raw): leave the policy out to use the first that fits")
    return chosen


__all__ = ["POLICIES", "AnswerPolicy", "Plan", "choose_policy"]
