"""Accuracy, macro-F1 and the confusion matrix (rows: true label, columns: predicted)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def scores(confusion: np.ndarray) -> dict:
    """From a C x C count matrix. Macro-F1 averages per-class F1 over the classes that
    occur in the data or the predictions (a class absent from both has no F1)."""
    c = np.asarray(confusion, dtype=np.float64)
    total = c.sum()
    tp = np.diag(c)
    support, predicted = c.sum(1), c.sum(0)
    present = (support + predicted) > 0
    f1 = np.divide(2 * tp, support + predicted, out=np.zeros_like(tp), where=present)
    return {"accuracy": float(tp.sum() / total) if total else float("nan"),
            "macro_f1": float(f1[present].mean()) if present.any() else float("nan"),
            "per_class_f1": f1.tolist(), "support": support.astype(int).tolist(), "examples": int(total),
            "majority_baseline": float(support.max() / total) if total else float("nan")}


def confusion_text(confusion: np.ndarray, labels: list[str]) -> str:
    """The matrix as aligned text, for the console and the log."""
    c = np.asarray(confusion, dtype=np.int64)
    first = max(len("true \\ predicted"), *(len(s) for s in labels)) + 2
    widths = [max(len(s), len(str(int(c[:, j].max(initial=0))))) + 2 for j, s in enumerate(labels)]
    lines = ["true \\ predicted".ljust(first) + "".join(s.rjust(w) for s, w in zip(labels, widths))]
    for name, row in zip(labels, c):
        lines.append(name.ljust(first) + "".join(str(int(v)).rjust(w) for v, w in zip(row, widths)))
    return "\n".join(lines)


def plot_confusion(confusion: np.ndarray, labels: list[str], out: Path, title: str = "") -> Path:
    """A PNG of the row-normalised matrix with the counts written in; atomic."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = np.asarray(confusion, dtype=np.float64)
    norm = c / np.maximum(c.sum(1, keepdims=True), 1)
    n = len(labels)
    fig, ax = plt.subplots(figsize=(1.2 * n + 2.5, 1.1 * n + 1.8), dpi=110)
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{int(c[i, j])}", ha="center", va="center", fontsize=9,
                    color="white" if norm[i, j] > 0.5 else "black")
    ax.set_xticks(range(n), labels, rotation=30, ha="right")
    ax.set_yticks(range(n), labels)
    ax.set(xlabel="predicted", ylabel="true", title=title)
    fig.colorbar(im, ax=ax, fraction=0.046, label="share of the true class")
    fig.tight_layout()
    from distlm.report.plot import save_figure
    return save_figure(fig, out)
