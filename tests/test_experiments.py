"""The benchmark scripts run end to end on tiny settings (their figures come from full runs)."""

import importlib.util
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def script(name):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_benchmark_reports_ratios_against_sdpa(capsys):
    script("bench_kernel").main(["--T", "64", "--D", "32", "--H", "1", "--reps", "1", "--decode", "500",
                                 "--block-size", "7"])
    out = capsys.readouterr().out
    assert "| 64 | 32 | sdpa |" in out and "| 64 | 32 | reference |" in out and "1.00x" in out
    assert "| 500 | " in out and "OOM" not in out


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
