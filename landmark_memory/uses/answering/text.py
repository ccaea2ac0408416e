"""The text index's policy: the prompt read as the answer's, every token of the answer reading
first the ``TEXT_BLOCKS`` blocks the memory's text index ranks first for the question's words.
What a model without retrieval heads or a question reader answers by, and any model asked raw."""

from ..question import Question
from .plan import Plan, prompt_of, text_first


class TextFirst:
    def fits(self, model, options) -> bool:
        return True

    def plan(self, mem, model, messages, options, first) -> Plan:
        prompt, chat = prompt_of(model, messages, options, first)
        question = Question.pose(mem, model.tokenizer, messages[-1].content, prompt, [m.content for m in messages])
        return Plan(chat, 0, list(question.ids), text_first(mem, model.tokenizer, question), rarity=question.rarity)
