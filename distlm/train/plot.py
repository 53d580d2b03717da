"""Loss curves drawn from metrics.csv (``distlm plot RUN...``)."""
from __future__ import annotations

import os
from pathlib import Path

from distlm.data import DataError
from distlm.io import read_csv

# Below this many points a curve also gets markers: a short run logs a handful of rows,
# and one point alone draws no line at all.
FEW_POINTS = 30


def save_figure(fig, out: Path, **kw) -> Path:
    """Write a matplotlib figure atomically (a temporary file, then a rename) and close it."""
    import matplotlib.pyplot as plt
    out = Path(out)
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, **kw)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        what = "no such folder" if not Path(run_dir).exists() else "no metrics.csv in it (is it a distlm run folder?)"
        raise DataError(f"{run_dir}: {what}")
    return read_csv(path)


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    # Every run is read before anything is drawn: a missing one fails with nothing written.
    runs = [(Path(run).name, read_metrics(run)) for run in run_dirs]
    import matplotlib
    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, rows in runs:
        train = [(int(r["step"]), float(r["loss"])) for r in rows if r.get("loss")]
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
        if train:
            ax.plot(*zip(*train), label=f"{name} train", lw=1.2, marker="." if len(train) < FEW_POINTS else None)
        if val:
            ax.plot(*zip(*val), "o--", label=f"{name} val", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, out)
