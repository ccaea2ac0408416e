"""The retrieval heads' policy (a model with retrieval heads asked through its chat template, or
in the plain frame its heads were chosen in): the messages read first, their evidence found
(``retrievers.find_evidence``: the text index and the heads, fused, and the quote), every token
of the answer reading the fusion's best ``EvidenceHeads.blocks`` first. A chat model then reads
the evidence (``AskOptions.evidence``) and the question again as the next user turn, and answers
after it."""

from ...core.tokenizer import encode_prompt
from ..asking import chat_prompt, has_chat
from ..evidence import Quote, around
from ..question import Question
from ..retrievers import find_evidence
from ..search import placed
from .plan import Plan, plain_prompt, text_first

# the turn the evidence and the question are read in (chosen on development questions: experiments/exp_answers.py)
EVIDENCE_PROMPT = "{evidence}\n\n{question}"
QUOTES = 2  # the sentences the "quotes" evidence reads


class HeadsEvidence:
    def fits(self, model, options) -> bool:
        heads = model.heads
        return heads is not None and not options.raw and (heads.frame is not None or has_chat(model.tokenizer))

    def plan(self, mem, model, messages, options, first) -> Plan:
        tok, heads, text = model.tokenizer, model.heads, messages[-1].content
        n_blocks = mem.n_blocks
        chat = chat_prompt(tok, messages, first=first, answer=True)
        frame = heads.frame if chat is None else None
        stop = () if frame is None else tuple(w.strip() for w in frame.split("{question}") if w.strip())
        reads_evidence = options.evidence != "none" and chat is not None and n_blocks > 0
        if reads_evidence:  # the messages a closed turn: the heads score it, the evidence and question follow
            chat = chat_prompt(tok, messages, first=first, answer=False)
        prompt = chat if chat is not None else plain_prompt(messages, frame.replace("{question}", text))
        question = Question.pose(mem, tok, text, prompt, [m.content for m in messages])
        ids, read, pinned, best = list(question.ids), 0, [], []
        if n_blocks and len(ids) > 1:  # (a prompt the answer opens on: its last token is the answer's first)
            asked = question.read(mem, len(ids) if reads_evidence else len(ids) - 1)
            count = QUOTES if options.evidence == "quotes" else 1
            ranking, best = find_evidence(mem, tok, heads, asked, max(min(heads.blocks, mem.options.top_k), 1), count)
            pinned, read = [b for b, _ in ranking.fused][:heads.blocks], asked.read_ids
        else:
            pinned = text_first(mem, tok, question)
        rest, said, opening = ids[read:], None, None
        if reads_evidence:  # the next turn: the evidence and the question (or, with no quote, the answer's opening)
            said = _evidence(mem, tok, options.evidence, best, n_blocks) if best else None
            turn = [{"role": "user", "content": EVIDENCE_PROMPT.format(evidence=said, question=text)}] if said else []
            rest = encode_prompt(tok, tok.chat_text(turn, first=False, answer=True), [t["content"] for t in turn]).ids
            opening = encode_prompt(tok, tok.chat_text([], first=False, answer=True), []).ids
        return Plan(chat is not None, read, rest, pinned, placed(mem, best[0] if best else None, tok), said,
                    question.rarity, stop, opening)


def _evidence(mem, tokenizer, evidence: str, best: list[Quote], n: int) -> str:
    """What ``evidence`` (``AskOptions.evidence``) reads before the question, of the quotes
    ``best`` (the quote first; as many as it asks for) of the memory's first ``n`` blocks."""
    if evidence == "around":
        return around(mem, tokenizer, best[0], n)
    return " ".join(q.text for q in sorted(best, key=lambda q: q.token))  # in the memory's order
