"""The question reader's policy (SmolLM2's adapter asks for it where it has no retrieval heads):
the chat prompt read first, the memory's blocks ranked by the model's question reader
(``retrievers.ReaderRetriever``), and every token of the answer reading the best
``AskPolicy.reader_blocks`` of them first: those are the first passages."""

from ..asking import has_chat
from ..question import Question
from ..retrievers import ReaderRetriever
from .plan import Plan, prompt_of, text_first


class ReaderFirst:
    def fits(self, model, options) -> bool:
        return model.reader is not None and model.policy.reader_blocks > 0 and not options.raw and \
            has_chat(model.tokenizer)

    def plan(self, mem, model, messages, options, first) -> Plan:
        prompt, chat = prompt_of(model, messages, options, first)
        question = Question.pose(mem, model.tokenizer, messages[-1].content, prompt, [m.content for m in messages])
        ids = list(question.ids)
        if not question.n_blocks or len(ids) < 2:  # nothing to rank, or nothing to read before the answer
            return Plan(chat, 0, ids, text_first(mem, model.tokenizer, question), rarity=question.rarity)
        read = question.read(mem, len(ids) - 1)  # (its last token is the answer's first)
        k = min(model.policy.reader_blocks, mem.options.top_k)
        pinned = [b for b, _ in ReaderRetriever(mem, model.reader).rank(read, k)]
        return Plan(chat, read.read_ids, ids[read.read_ids:], pinned, rarity=question.rarity)
