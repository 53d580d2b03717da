"""Loss curves drawn from metrics.csv (``distlm plot RUN...``)."""
from __future__ import annotations

import csv
import os
from pathlib import Path


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
        raise FileNotFoundError(f"{path}: no metrics.csv (is {run_dir} a distlm run directory?)")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for run in run_dirs:
        rows = read_metrics(run)
        train = [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]]
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
        name = Path(run).name
        if train:
            ax.plot(*zip(*train), label=f"{name} train", lw=1.2)
        if val:
            ax.plot(*zip(*val), "o--", label=f"{name} val", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, out)
