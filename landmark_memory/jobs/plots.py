"""PNG plots of the passkey and index-comparison results (matplotlib, no display needed)."""

from pathlib import Path


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_passkey(series, path, title="Passkey retrieval"):
    """``series``: {label: [{"length", "accuracy"}, ...]}; accuracy vs prompt length, log x."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in series.items():
        ax.plot([r["length"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=label)
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="accuracy (%)", ylim=(-3, 103), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(path), dpi=120)
    plt.close(fig)


def plot_compare(rows, path, title="Exact vs approximate retrieval"):
    """``rows`` from ``evaluate.compare_indexes``: perplexity delta, recall and search latency per index."""
    plt = _figure()
    names = [r["index"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, key, label in zip(axes, ("ppl_delta_pct", "recall", "search_ms"),
                              ("perplexity vs exact (%)", "recall@k vs exact", "search latency (ms / call)")):
        ax.bar(names, [r[key] for r in rows], color="tab:blue")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=120)
    plt.close(fig)
