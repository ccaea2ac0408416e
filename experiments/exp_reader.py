"""Stage 11: a question reader trained to point a plain-word question at the block that answers
it (``landmark_memory/models/reader.py``), measured against the retrieval heads and ``ask``.

    python experiments/exp_reader.py record --books BOOKS --work DIR     # memories read, states kept
    python experiments/exp_reader.py train --work DIR                    # the reader, chosen on dev
    python experiments/exp_reader.py blend --work DIR --name NAME        # blended with the retrieval heads
    python experiments/exp_reader.py report --work DIR                   # reader.md

``record``: haystacks are read into memories at the defaults (SmolLM2, the shipped stage-9
adapter) and, for every question, what its own tokens search the memory with
(``_attention.question_states``) is kept in ``DIR`` with the memory's landmark keys, one
safetensors file per haystack; the model and its keys are frozen, so a reader trains on these
alone, every other block of the memory a negative that never goes stale.

- ``train|h``: 8K tokens of the books the adapter was fine-tuned on, 6 shapes of ``_facts.py``
  planted twice each (other subjects and answers: each other's distractors), each asked three ways;
  with ``--about N``, N questions about each haystack's own sentences besides
  (``_facts.about_questions``);
- ``dev|h``: ``exp_heads.py``'s development haystacks (its ten ``DEV_FACTS``), to choose by, with
  ``--about`` the same haystacks' own sentences asked apart (``dev|about|h``), and
  ``DEV_FIXTURE``'s natural questions about a trained book (``dev|natural|book``);
- ``eval|n|h``: the retrieval suite's haystacks (held-out books, ``_texts.FACTS``, its seeds);
- ``natural|book``: ``exp_natural.py``'s fixture, the first 8,064 tokens of each held-out book.

Shapes, subjects and wordings of the training facts are apart from dev's and eval's.
"""

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _attention import NULL, landmark_keys, question_states
from _common import ADAPTER, ROOT, SHIPPED_READER, Trials, command_line, load_smollm2, plt, write_result
from _facts import about_questions, draw_facts
from _texts import build, haystack, held_out, is_right
from exp_heads import DEV_FACTS, DEV_SEED, trained_books
from exp_natural import ASK_NEW as NATURAL_NEW
from exp_natural import FIXTURE, TOKENS, evidence_span
from exp_retrieval import ASK_NEW as SUITE_NEW
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from landmark_memory.jobs.build import encode
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.reader import (
    QuestionReader,
    Reader,
    ReaderConfig,
    blended,
    head_attention,
    save_reader,
)
from landmark_memory.training.data import read_text
from landmark_memory.uses.answer import ask

DEV_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "natural_questions_dev.json"  # a trained book's
TRAIN_SEED = 2000
TRAIN_SHAPES = 6  # shapes per training haystack, each planted twice


def memory_of(model, ids, kept):
    """The saved memory of ``ids`` at ``kept`` (read into it first if it is not there yet)."""
    if not kept.is_dir():
        build(model, ids, kept.with_suffix(".part"))
        kept.with_suffix(".part").rename(kept)
    return kept


def record_memory(model, tok, ids, asked, path, kept):
    """Read ``ids`` into a memory (kept at ``kept``, where ``answer`` asks it again); keep its
    landmark keys and, for ``NULL`` and each question of ``asked`` [(question, blocks, words)]
    whose blocks it holds, the question's states."""
    bs = model.config.landmark_block_size
    tensors, rows, scale, null_own = {}, [], 0.0, None
    with tempfile.TemporaryDirectory() as tmp:
        with LandmarkMemory.open(memory_of(model, ids, kept or Path(tmp) / "m"), model, readonly=True) as m:
            n_blocks = m.n_blocks
            tensors["keys"], scale = landmark_keys(m, n_blocks).half(), m.backbone.scale
            for i, (question, span, words) in enumerate([(NULL, (0, 1), [])] + asked):
                blocks = list(range(span[0] // bs, (span[1] - 1) // bs + 1))
                if max(blocks) >= n_blocks:  # in the open chunk after the memory's last block
                    continue
                q, h, (cos, sin), own = question_states(m, tok, question)
                name = "null" if i == 0 else str(len(rows))
                tensors |= {f"q{name}": q.half(), f"h{name}": h.half(), f"cos{name}": cos, f"sin{name}": sin}
                row = {"question": question, "blocks": blocks, "words": words, "own": [own.start, own.stop]}
                if i:
                    rows.append(row)
                else:
                    null_own = row["own"]
    save_file(tensors, str(path), metadata={"rows": json.dumps(rows), "null_own": json.dumps(null_own),
                                            "n_blocks": str(n_blocks), "scale": str(scale)})
    return len(rows)


def record(args):
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_smollm2(args.adapter)
    model, tok = loaded.model, loaded.tokenizer
    trained, held = trained_books(args.books, tok), held_out(args.books, tok)
    jobs = []
    for h in range(args.dev_haystacks):
        jobs.append((f"dev|{h}", lambda h=h: haystack(tok, trained, 8192, h, DEV_SEED, DEV_FACTS)))
        if args.about:
            jobs.append((f"dev|about|{h}", lambda h=h: about(tok, haystack(tok, trained, 8192, h, DEV_SEED, DEV_FACTS),
                                                              args.about, f"dev|{h}", facts=False)))
    for h in range(args.train_haystacks):
        facts = draw_facts(random.Random(f"{TRAIN_SEED}|facts|{h}"), TRAIN_SHAPES)
        jobs.append((f"train|{h}", lambda h=h, facts=facts: about(
            tok, haystack(tok, trained, 8192, h, TRAIN_SEED, facts), args.about, f"train|{h}")))
    for n, count in ((8192, args.eval_haystacks), (32768, args.eval_haystacks_32k)):
        for h in range(count):
            jobs.append((f"eval|{n}|{h}", lambda n=n, h=h: haystack(tok, held, n, h, args.seed)))
    for prefix, path in (("natural", FIXTURE), ("dev|natural", DEV_FIXTURE)):
        fixture = json.loads(path.read_text())
        for book in sorted({q["book"] for q in fixture["questions"]}):
            jobs.append((f"{prefix}|{book}",
                         lambda book=book, fixture=fixture: natural(tok, args.books, book, fixture)))
    for key, make in jobs:
        path = work / (key.replace("|", "_") + ".safetensors")
        if path.exists():
            continue
        t0 = time.perf_counter()
        name, ids, planted = make()
        asked = [(q, span, words) for _, qs, words, span in planted for q in ([qs] if isinstance(qs, str) else qs)]
        kept = None if key.startswith(("train", "dev")) else path.with_suffix(".memory")
        n = record_memory(model, tok, ids, asked, path.with_suffix(".part"), kept)
        path.with_suffix(".part").rename(path)
        print(f"{key}: {name}, {n} questions in {time.perf_counter() - t0:.0f} s", flush=True)


def about(tok, hay, count, seed, facts=True):
    """The haystack ``hay`` (book, ids, planted) with ``count`` questions about its own sentences
    (``_facts.about_questions``) beside its planted facts (or instead of them)."""
    name, ids, planted = hay
    asked = [(None, q, [], evidence_span(tok, ids, s))
             for s, q in about_questions(tok.decode(ids), random.Random(f"{seed}|about"), count)]
    return name, ids, (planted if facts else []) + asked


def natural(tok, books, book, fixture):
    ids = encode(tok, read_text(Path(books) / f"{book}.txt"))[:TOKENS]
    return book, ids, [(None, q["question"], q["words"], evidence_span(tok, ids, q["evidence"]))
                       for q in fixture["questions"] if q["book"] == book]


class Haystack:
    """One recorded memory: its landmark keys and its questions' states, padded to one batch."""

    def __init__(self, path):
        t, head = load_file(str(path)), self.metadata(path)
        self.key, self.rows, self.scale = path.stem, json.loads(head["rows"]), float(head["scale"])
        self.keys = t["keys"].float()  # (L, H_kv, n, D)
        self.n_blocks = self.keys.shape[2]
        owns = [r["own"] for r in self.rows]
        self.null = self._batch(t, ["null"], [json.loads(head["null_own"])], own_only=True)
        self.own = self._batch(t, [str(i) for i in range(len(self.rows))], owns, own_only=True)
        q, _, cos, sin, w = self._batch(t, [str(i) for i in range(len(self.rows))], owns)
        with torch.no_grad():  # the template's tokens by the model's own queries: no reader changes it
            self.template = head_attention(q, cos, sin, w[1:], self.keys, self.scale)[0]  # (N, L * H_kv, n)

    @staticmethod
    def metadata(path):
        """The recorded file's metadata: its questions and their blocks, the memory's blocks."""
        with safe_open(str(path), "pt") as f:
            return f.metadata()

    @staticmethod
    def _batch(t, names, owns, own_only=False):
        """The prompts ``names`` padded to one batch: (q, h, cos, sin, weights); ``weights``
        (2, N, T) averages over the question's own tokens, then over the template's; with
        ``own_only``, (1, N, T) over the question's tokens alone, the only ones kept."""
        cut = (lambda x, own: x[..., own[0]:own[1], :]) if own_only else (lambda x, own: x)  # noqa: E731
        parts = [{k: cut(t[f"{k}{n}"].float(), own) for k in ("q", "h", "cos", "sin")} for n, own in zip(names, owns)]
        T = max(p["cos"].shape[0] for p in parts)
        pad = lambda x: torch.nn.functional.pad(x, [0, 0, 0, T - x.shape[-2]])  # noqa: E731
        q, h, cos, sin = (torch.stack([pad(p[k]) for p in parts]) for k in ("q", "h", "cos", "sin"))
        at = torch.arange(T)
        real = torch.stack([at < p["cos"].shape[0] for p in parts]).float()  # (N, T)
        if own_only:
            weights = real[None]
        else:
            own = torch.stack([(at >= a) & (at < b) for a, b in owns]).float()
            weights = torch.stack([own, real - own])  # the question's tokens, the template's
        return q, h, cos, sin, weights / weights.sum(-1, keepdim=True)

    def scores(self, reader, calibration):
        """Block logits (N, n) of every question by ``reader``, less what ``calibration`` says:
        "null" (a content-free question's attention), "template" (the chat template's own
        tokens around the question) or "none"."""
        own = reader.attention(*self.own, self.keys, self.scale)[0]
        q, _, cos, sin, w = self.own
        base = head_attention(q, cos, sin, w, self.keys, self.scale)[0] if reader.config.blend else None
        if calibration == "template":
            return reader.scores(own, self.template, base)
        if calibration == "none":
            return reader.scores(own, torch.zeros_like(own[:1]), base)
        return reader.scores(own, reader.attention(*self.null, self.keys, self.scale)[0], base)

    def targets(self):
        """bool (N, n): the blocks of each question's fact."""
        y = torch.zeros(len(self.rows), self.n_blocks, dtype=torch.bool)
        for i, r in enumerate(self.rows):
            y[i, r["blocks"]] = True
        return y


def loss_of(z, y):
    """Cross-entropy of the fact's blocks (any of them) among every block of the memory."""
    return (torch.logsumexp(z, -1) - torch.logsumexp(z.masked_fill(~y, float("-inf")), -1)).mean()


def ranks(z, y):
    """1-based rank of each question's best fact block by the logits ``z`` (N, n)."""
    best = z.masked_fill(~y, float("-inf")).max(-1).values
    return (z > best[:, None]).sum(-1) + 1


def load(work, prefix):
    return [Haystack(p) for p in sorted(Path(work).glob(prefix + "*.safetensors"))]


def config_of(h: Haystack, rank):
    q, hh = h.null[0], h.null[1]
    return ReaderConfig(n_layer=q.shape[1], n_head=q.shape[2], n_kv_head=h.keys.shape[1], head_dim=q.shape[4],
                        n_embd=hh.shape[-1], rank=rank)


@torch.no_grad()
def recall(reader, haystacks, calibration, k=5):
    r = torch.cat([ranks(h.scores(reader, calibration), h.targets()) for h in haystacks])
    return float((r <= k).float().mean()), float((1 / r.float()).mean()), len(r)


def development(reader, dev, calibration):
    """(recall@5, mean reciprocal rank) on the development questions: the mean over their kinds
    recorded: planted facts, questions about the text's own sentences (``--about``) and natural
    questions about a trained book (``DEV_FIXTURE``)."""
    kinds = {}
    for h in dev:
        kinds.setdefault(next((k for k in ("about", "natural") if f"_{k}_" in h.key), "planted"), []).append(h)
    got = [recall(reader, part, calibration) for part in kinds.values()]
    return sum(g[0] for g in got) / len(got), sum(g[1] for g in got) / len(got)


def train(args):
    torch.manual_seed(args.seed)
    train_set, dev = load(args.work, "train_"), load(args.work, "dev_")
    print(f"{len(train_set)} training haystacks ({sum(len(h.rows) for h in train_set)} questions), "
          f"{len(dev)} development ({sum(len(h.rows) for h in dev)})", flush=True)
    reader = QuestionReader(config_of(dev[0], args.rank))
    if args.init_heads:
        with torch.no_grad():
            reader.mix.copy_(heads_reader(reader.config, chosen_heads(args.results)).mix.clamp(min=-4.0))
    if args.mix_only:
        reader.A.requires_grad_(False)
        reader.B.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in reader.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=args.weight_decay)
    kept = {k: v.clone() for k, v in reader.state_dict().items()}
    best, log = (development(reader, dev, args.calibration), 0, kept), []
    print(f"epoch 0: dev recall@5 {best[0][0]:.0%} mrr {best[0][1]:.3f}", flush=True)
    for epoch in range(1, args.epochs + 1):
        t0, total = time.perf_counter(), 0.0
        for i in torch.randperm(len(train_set)).tolist():
            h = train_set[i]
            loss = loss_of(h.scores(reader, args.calibration), h.targets())
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        got = development(reader, dev, args.calibration)
        log.append({"epoch": epoch, "loss": total / len(train_set), "dev_recall5": got[0], "dev_mrr": got[1]})
        print(f"epoch {epoch}: loss {total / len(train_set):.3f} dev recall@5 {got[0]:.0%} mrr {got[1]:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if got[1] > best[0][1]:
            best = (got, epoch, {k: v.clone() for k, v in reader.state_dict().items()})
    reader.load_state_dict(best[2])
    out = Path(args.work) / f"{args.name}.safetensors"
    save_file({k: v.contiguous() for k, v in reader.state_dict().items()}, str(out),
              metadata={"config": json.dumps(reader.settings()), "epoch": str(best[1]), "log": json.dumps(log),
                        "calibration": args.calibration, "train_haystacks": str(len(train_set)),
                        "train_questions": str(sum(len(h.rows) for h in train_set)),
                        "about": str(sum(not r["words"] for h in train_set for r in h.rows))})  # no words: about
    print(f"kept epoch {best[1]}: dev recall@5 {best[0][0]:.0%} mrr {best[0][1]:.3f} -> {out}")


def chosen_heads(results):
    """[(layer, key/value head)]: the retrieval heads ``exp_heads.py`` chose (``heads.json``)."""
    chosen = json.loads((Path(results) / "heads.json").read_text())["cells"]["heads"][0]
    return [tuple(lh) for lh in chosen["order"][:chosen["count"]]]


def heads_reader(config, heads):
    """A reader that pools ``heads`` [(layer, key/value head)] alike, untrained: the retrieval
    heads of ``exp_heads.py`` (every head for None)."""
    reader = QuestionReader(config)
    if heads is not None:
        with torch.no_grad():
            reader.mix.fill_(-1e9)
            for layer, h in heads:
                reader.mix[layer * config.n_kv_head + h] = 0.0
    return reader


def saved_reader(path):
    head = Haystack.metadata(path)
    reader = QuestionReader(ReaderConfig(**json.loads(head["config"])))
    reader.load_state_dict(load_file(str(path)))
    return reader, int(head["epoch"]), json.loads(head["log"]), head["calibration"]


def trained_on(path):
    """What the trained reader at ``path`` learned from: haystacks, questions, of them about the text."""
    head = Haystack.metadata(path)
    return {k: int(head.get(k, 0)) for k in ("train_haystacks", "train_questions", "about")}


def heads(args):
    """A reader of no trained correction (rank 0) that mixes the retrieval heads ``exp_heads.py``
    chose alike (QRHead's recipe), calibrated by the chat template's tokens: ``--name`` in
    ``--work``, or ``--out`` (an adapter's ``reader.safetensors``)."""
    chosen = chosen_heads(args.results)
    dev = load(args.work, "dev_")[:1]
    reader = heads_reader(config_of(dev[0], 0), chosen)
    out = Path(args.out) if args.out else Path(args.work) / f"{args.name}.safetensors"
    save_reader(reader, out, "template", epoch="0", log="[]", heads=json.dumps(chosen))
    print(f"{len(chosen)} heads {chosen} -> {out}")


def blend(args):
    """The trained reader ``--name`` blended with the retrieval heads ``exp_heads.py`` chose (read
    by the model's own queries; ``models.reader.blended``), the share of the heads chosen on the
    development questions by mean reciprocal rank: ``--name``-blend in ``--work``, or ``--out``."""
    trained, epoch, log, calibration = saved_reader(Path(args.work) / f"{args.name}.safetensors")
    heads = heads_reader(trained.config, chosen_heads(args.results)).mix.softmax(0)
    dev, best = load(args.work, "dev_"), None
    for share in [i / 10 for i in range(1, 10)]:
        got = development(blended(trained, heads, share), dev, calibration)
        print(f"heads' share {share:.1f}: dev recall@5 {got[0]:.0%} mrr {got[1]:.3f}", flush=True)
        if best is None or got[1] > best[1][1]:
            best = (share, got)
    out = Path(args.out) if args.out else Path(args.work) / f"{args.name}-blend.safetensors"
    save_reader(blended(trained, heads, best[0]), out, calibration, epoch=str(epoch), log=json.dumps(log),
                heads=json.dumps(chosen_heads(args.results)),
                **{k: str(v) for k, v in trained_on(Path(args.work) / f"{args.name}.safetensors").items()})
    print(f"heads' share {best[0]:.1f} -> {out}")


def measure(args):
    """Each recorded evaluation question's rank of its fact's block by today's ``ask`` (its five
    passages, from ``exp_heads.py``'s and ``exp_natural.py``'s states: the same memories and
    questions), every head and the retrieval heads ``exp_heads.py`` chose (calibrated by a
    content-free question, and the heads by the chat template's tokens too), and the trained
    readers (``--name``: their names, comma-separated), into ``--state``."""
    work, results = Path(args.work), Path(args.results)
    state = Trials(args.state, args.command)
    heads = json.loads((results / "heads.json").read_text())["cells"]
    natural = json.loads((results / "natural_questions.json").read_text())["cells"]
    chosen, variants = chosen_heads(results), {}
    for i, name in enumerate(args.name.split(",")):
        trained, epoch, log, calibration = saved_reader(work / f"{name}.safetensors")
        variants[name] = trained, calibration
        state.add("reader", {"name": name, "epoch": epoch, "log": log, "calibration": calibration,
                             "rank": trained.config.rank, "blend": trained.config.blend,
                             **trained_on(work / f"{name}.safetensors")}, at=i)
    config = trained.config
    variants = {"every head": (heads_reader(config, None), "null"), "heads": (heads_reader(config, chosen), "null"),
                "heads, template": (heads_reader(config, chosen), "template")} | variants
    for path in sorted(work.glob("*.safetensors")):
        if not path.stem.startswith(("eval_", "natural_")):
            continue
        h = Haystack(path)
        key = path.stem.replace("_", "|", 2) if path.stem.startswith("eval_") else "natural|" + path.stem[8:]
        today = heads[key] if key.startswith("eval|") else natural["memory|" + key[8:]]
        if [r["question"] for r in today] != [r["question"] for r in h.rows]:
            raise SystemExit(f"{key}: the recorded questions are not today's ask's")
        y = h.targets()
        with torch.no_grad():
            got = {v: h.scores(reader, c) for v, (reader, c) in variants.items()}
        for i, (row, r) in enumerate(zip(h.rows, today)):
            state.add(f"ranks|{key}", {"question": row["question"], "blocks": row["blocks"], "n_blocks": h.n_blocks,
                                       "ask_recall5": r["ask_recall5"],
                                       "ranks": {v: int(ranks(z, y)[i]) for v, z in got.items()},
                                       "tops": {v: z[i].topk(5).indices.tolist() for v, z in got.items()}}, at=i)
        found = {v: f"{float((ranks(got[v], y) <= 5).float().mean()):.0%}" for v in args.name.split(",")}
        print(f"{key}: {len(h.rows)} questions, recall@5 {found}")


def answer(args):
    """Each evaluation question asked through ``ask`` with the trained reader (its ``--pin`` best
    blocks read by every token of the answer), on memories read again as ``record`` read them;
    rows kept in ``--state`` as they are done."""
    state = Trials(args.state, args.command)
    loaded = load_smollm2(args.adapter)
    reader, _, _, calibration = saved_reader(Path(args.work) / f"{args.name}.safetensors")
    loaded = replace(loaded, reader=Reader(reader.eval(), calibration),
                     policy=replace(loaded.policy, reader_blocks=args.pin))
    model, tok = loaded.model, loaded.tokenizer
    held, fixture = held_out(args.books, tok), json.loads(FIXTURE.read_text())
    # answers as long as the baselines' (exp_retrieval.py's and exp_natural.py's)
    tag = f"{args.name}-pin{args.pin}"
    jobs = [(f"eval|{n}|{h}|{tag}", SUITE_NEW, lambda n=n, h=h: haystack(tok, held, n, h, args.seed))
            for n, count in ((8192, args.eval_haystacks), (32768, args.eval_haystacks_32k)) for h in range(count)]
    jobs += [(f"natural|{book}|{tag}", NATURAL_NEW, lambda book=book: natural(tok, args.books, book, fixture))
             for book in sorted({q["book"] for q in fixture["questions"]})]
    bs = model.config.landmark_block_size
    for key, new_tokens, make in jobs:
        if state.cell(key):
            continue
        t0 = time.perf_counter()
        name, ids, planted = make()
        kept = Path(args.work) / (key.rsplit("|", 1)[0].replace("|", "_") + ".memory")
        with LandmarkMemory.open(memory_of(model, ids, kept), model, readonly=True) as m:
            n_blocks, rows = m.n_blocks, []
            for _, question, words, (a, b) in planted:
                blocks = list(range(a // bs, (b - 1) // bs + 1))
                if max(blocks) >= n_blocks:
                    continue
                m.rewind()
                got = ask(m, loaded, question, max_new_tokens=new_tokens, passages=5)
                rows.append({"question": question, "blocks": blocks,
                             "passages": [p.block for p in got.passages],
                             "recall5": any(p.block in blocks for p in got.passages),
                             "answer": got.text.strip(), "right": is_right(got.text, words)})
        for i, row in enumerate(rows):
            state.add(key, row, at=i)
        print(f"{key}: {name}, {len(rows)} questions, recall@5 {np.mean([r['recall5'] for r in rows]):.0%}, right "
              f"{np.mean([r['right'] for r in rows]):.0%} in {time.perf_counter() - t0:.0f} s", flush=True)


SETS = {"8K": "ranks|eval|8192|", "32K": "ranks|eval|32768|", "natural": "ranks|natural|"}


def trained_text(info, count):
    """What the report says of one trained reader (``info``: ``measure``'s record of it)."""
    kept = info["log"][info["epoch"] - 1] if info["epoch"] else {}
    about = (f", {info['about']} of them questions about the haystack's own sentences (`--about`: two or three of "
             "a sentence's rarer words, `_facts.about_questions`)") if info.get("about") else ""
    blend = (f"; its ranking blended with the {count} retrieval heads' (read by the model's own queries), both "
             f"standardised, the heads' share {info['blend']:.1f} chosen on the development questions by mean "
             "reciprocal rank (`blend`)") if info.get("blend") else ""
    return (f"`{info['name']}`: a rank-{info['rank']} correction of every layer's query that only retrieval sees and "
            "trained weights mixing the (layer, key/value head) attentions, calibrated by the chat template's own "
            f"tokens; trained on {info['train_questions']} questions of {info['train_haystacks']} haystacks of 8K "
            "tokens of the books the adapter was trained on (planted facts of `_facts.py`'s 26 shapes, each twice "
            f"per haystack with other subjects and answers, each asked three ways{about}); kept at epoch "
            f"{info['epoch']} of {len(info['log'])} by development mean reciprocal rank (development recall@5 "
            f"{kept.get('dev_recall5', 0):.0%}){blend}.")


def report(args):
    trials = Trials(args.state)
    cells = trials.cells
    if "reader" not in cells:
        return
    trained = cells["reader"]
    heads = json.loads((Path(args.results) / "heads.json").read_text())["cells"]
    natural = json.loads((Path(args.results) / "natural_questions.json").read_text())["cells"]
    count = heads["heads"][0]["count"]
    body = ["Recorded and trained before the commands above (their states in WORK, not kept): "
            "`python experiments/exp_reader.py record --books $BOOKS --work WORK --train-haystacks 40 "
            "--eval-haystacks-32k 1` (then again with `--train-haystacks 56 --about 40`: 16 more training "
            "haystacks with questions about their own text, and the development questions of both kinds), "
            "`python experiments/exp_reader.py train --work WORK --epochs 30 --calibration template --name reader30`, "
            "`python experiments/exp_reader.py train --work WORK --epochs 24 --calibration template --init-heads "
            "--name aboutH24`, `python experiments/exp_reader.py blend --work WORK --name aboutH24` and "
            "`python experiments/exp_reader.py heads --work WORK --name heads8`.", "",
            "Stage 11, trained question readers (`landmark_memory/models/reader.py`); the model and its landmark keys "
            "are stage 9's, frozen: perplexity, the pass key and everything read without `ask` are stage 9's by "
            "construction. Development questions (to choose epochs and shares by, never evaluated): `exp_heads.py`'s "
            "38 planted facts (other shapes, wordings and subjects), 158 questions about the development haystacks' "
            "own "
            "sentences, and 24 natural questions about a book the adapter trained on "
            "(`fixtures/natural_questions_dev.json`); each kind weighs alike. `reader30` was kept by the planted ones "
            "alone (the others were recorded after it), `aboutH24` by the planted ones and those about the text "
            "(the natural ones were written after it), the blend's share by all three.", ""]
    body += [f"- {trained_text(info, count)}" for info in trained]
    body += ["", f"Beside them, untrained: every head and the {count} retrieval heads `exp_heads.py` chose, calibrated "
             "by a content-free question (as `heads.md`) or by the chat template's tokens (what `ask` computes in the "
             "same forward).", "",
             "Evaluation: the retrieval suite's haystacks (held-out books, its ten facts, its seeds: `heads.md`'s and "
             "`retrieval.md`'s questions) and the natural questions (`natural_questions.md`). recall@k: the fact's "
             "block among the k blocks a variant ranks first; today's `ask`: among its five passages (stage 9's "
             "policy); edge: the share of a variant's first 4 blocks that are the memory's first block or its last 3.",
             "", f"| questions | n | today's `ask` recall@5 | every head | {count} heads | {count} heads, template: "
             "recall@4 | recall@5 | edge | " + " | ".join(f"`{t['name']}`: recall@4 | recall@5 | edge" for t in trained)
             + " |", "|---|---|---|---|---|---|---|---|" + "---|---|---|" * len(trained)]
    table = {}

    def edge(rows, v):
        return np.mean([b == 0 or b >= r["n_blocks"] - 3 for r in rows for b in r["tops"][v][:4]])

    for name, prefix in SETS.items():
        rows = [r for k, rs in cells.items() if k.startswith(prefix) for r in rs]
        if not rows:
            continue
        rk = {v: np.array([r["ranks"][v] for r in rows]) for v in rows[0]["ranks"]}
        table[name] = {"today": np.mean([r["ask_recall5"] for r in rows]), "heads": np.mean(rk["heads, template"] <= 5)}
        table[name] |= {t["name"]: np.mean(rk[t["name"]] <= 5) for t in trained}
        body.append(f"| {name} | {len(rows)} | {table[name]['today']:.0%} | {np.mean(rk['every head'] <= 5):.0%} | "
                    f"{np.mean(rk['heads'] <= 5):.0%} | {np.mean(rk['heads, template'] <= 4):.0%} | "
                    f"**{np.mean(rk['heads, template'] <= 5):.0%}** | {edge(rows, 'heads, template'):.0%} | "
                    + " | ".join(f"{np.mean(rk[t['name']] <= 4):.0%} | **{np.mean(rk[t['name']] <= 5):.0%}** | "
                                 f"{edge(rows, t['name']):.0%}" for t in trained) + " |")
    tags = {k.rsplit("|", 1)[1] for k in cells if k.startswith(("eval|", "natural|"))}
    for tag in sorted(tags, key=lambda t: (t != SHIPPED_READER, t)):
        name, pin = tag.rsplit("-pin", 1)
        shipped = " (what SmolLM2's adapter ships)" if tag == SHIPPED_READER else ""
        body += ["", f"Asked through `{name}`{shipped} (`ask` with `reader_blocks` {pin}: its {pin} best blocks "
                 "read first by every answer token at every layer, and named first among the passages), on the same "
                 "memories. "
                 "recall@5: the fact's block among the passages; right: the answer holds the fact's words; today's "
                 "`ask` and the base model reading the text whole in its own context (natural questions only) on the "
                 "same questions.", "",
                 "| questions | n | recall@5 | right | today's `ask` right | base model right |",
                 "|---|---|---|---|---|---|"]
        for label, prefix in (("8K", "eval|8192|"), ("32K", "eval|32768|"), ("natural", "natural|")):
            rows = [r for k, rs in cells.items() if k.startswith(prefix) and k.endswith(tag) for r in rs]
            if not rows:
                continue
            asked = {r["question"] for r in rows}
            if label == "natural":
                today = [r["ask_right"] for k, rs in natural.items() if k.startswith("memory|") for r in rs
                         if r["question"] in asked]
                base = [r["right"] for k, rs in natural.items() if k.startswith("base|") for r in rs
                        if r["question"] in asked]
            else:
                haystacks = {k.split("|")[2] for k in cells if k.startswith(prefix) and k.endswith(tag)}
                today = [r["ask_right"] for h in sorted(haystacks) for r in heads.get(f"{prefix}{h}", [])]
                base = []
            table.setdefault(label, {})[f"right {name}"] = np.mean([r["right"] for r in rows])
            body.append(f"| {label} | {len(rows)} | {np.mean([r['recall5'] for r in rows]):.0%} | "
                        f"**{sum(r['right'] for r in rows)}/{len(rows)}** | {sum(today)}/{len(today)} | "
                        + (f"{sum(base)}/{len(base)}" if base else "-") + " |")
    if table:
        pyplot = plt()
        fig, ax = pyplot.subplots(figsize=(7.5, 3.4))
        names = list(table)
        bars = [("today", "today's ask"), ("heads", f"{count} heads, template")] + [(t["name"], t["name"])
                                                                                 for t in trained]
        bars += [(k, "answers right, " + k[6:]) for k in dict.fromkeys(k for t in table.values() for k in t
                                                                        if k.startswith("right "))]
        width = 0.8 / len(bars)
        for i, (k, label) in enumerate(bars):
            ax.bar(np.arange(len(names)) + (i - (len(bars) - 1) / 2) * width, [table[n].get(k, 0) for n in names],
                   width, label=label)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("recall@5 (or answers right)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(args.results) / "reader.png", dpi=110)
        body += ["", "![recall@5 by today's ask, the retrieval heads and the stage 11 readers; answers right]"
                 "(reader.png)"]
    for info in trained:
        body += ["", f"`{info['name']}`'s training (development recall@5 after each epoch, before any blend):", "",
                 "| epoch | " + " | ".join(str(e["epoch"]) for e in info["log"]) + " |",
                 "|---|" + "---|" * len(info["log"]),
                 "| loss | " + " | ".join(f"{e['loss']:.2f}" for e in info["log"]) + " |",
                 "| dev recall@5 | " + " | ".join(f"{e['dev_recall5']:.0%}" for e in info["log"]) + " |"]
    write_result("reader", "Questions find their evidence: retrieval heads and a trained question reader", body,
                 results=args.results, commands=trials.commands)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["record", "train", "heads", "blend", "measure", "answer", "report"])
    ap.add_argument("--out", help="heads: where the reader is written (default: --name in --work)")
    ap.add_argument("--work", help="where the recorded states are kept (some hundred MB)")
    ap.add_argument("--books")
    ap.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--adapter", default=str(ROOT / ADAPTER.partition("=")[2]))
    ap.add_argument("--train-haystacks", type=int, default=24)
    ap.add_argument("--dev-haystacks", type=int, default=4)
    ap.add_argument("--eval-haystacks", type=int, default=4)
    ap.add_argument("--eval-haystacks-32k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--about", type=int, default=0,
                    help="record: questions about each training haystack's own sentences (and dev's, apart)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--pin", type=int, default=4, help="answer: the reader's blocks every answer token reads")
    ap.add_argument("--state", default=str(ROOT / "experiments" / "results" / "reader.json"))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--name", default="reader", help="the trained reader's file in --work")
    ap.add_argument("--calibration", choices=["null", "template", "none"], default="null")
    ap.add_argument("--init-heads", action="store_true", help="train: start the mix at the retrieval heads'")
    ap.add_argument("--mix-only", action="store_true", help="train the heads' mixing weights alone")
    args = ap.parse_args(argv)
    args.command = command_line(argv)
    {"record": record, "train": train, "heads": heads, "blend": blend, "measure": measure, "answer": answer,
     "report": report}[args.step](args)


if __name__ == "__main__":
    main()
