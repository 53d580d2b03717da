"""Loss curves drawn from metrics.csv (``distlm plot RUN...``)."""
from __future__ import annotations

import importlib
import threading
from pathlib import Path
from typing import Optional

from distlm.data import DataError
from distlm.io import atomic_file, read_csv

# Below this many points a curve also gets markers: a short run logs a handful of rows,
# and one point alone draws no line at all.
FEW_POINTS = 30


def save_figure(fig, out: Path, **kw) -> Path:
    """Write a matplotlib figure atomically (a new temporary file, then a rename: distlm/io.py)
    and close it. The format is the name's suffix (png without one)."""
    import matplotlib.pyplot as plt
    out = Path(out)
    try:
        with atomic_file(out, "wb") as f:
            fig.savefig(f, format=kw.pop("format", out.suffix[1:] or "png"), **kw)
    finally:
        plt.close(fig)
    return out


class PlotImport:
    """matplotlib imported on a thread of its own, joined before the plot is drawn.

    The import is most of a plot's time when the installation keeps no bytecode for it (2.5 s
    cold on an H200 host, docs/results/time-to-loss.md), and the end of a run has a wait it can
    hide under: the final checkpoint's write, which waits on the disk without the GIL. An import
    that fails is raised by ``join``, in the caller's thread, as it would have been without the
    thread; a daemon thread, so a process that fails before joining does not wait for it.
    """

    def __init__(self) -> None:
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="distlm plot import", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            importlib.import_module("matplotlib").use("Agg")  # as plot_runs sets it: no display
            importlib.import_module("matplotlib.pyplot")
        except BaseException as e:  # kept for join(): raised in the caller's thread
            self._error = e

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        what = "no such folder" if not Path(run_dir).exists() else "no metrics.csv in it (is it a distlm run folder?)"
        raise DataError(f"{run_dir}: {what}")
    return read_csv(path)


class NothingToPlot(DataError):
    """Every run named has a metrics.csv without a loss in it (stopped before its first row)."""


def _points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def _label(name: str, kind: str, points: list) -> str:
    # A single point draws no line: the label says why the curve is a dot.
    return f"{name} {kind}" + (f" (1 point, step {points[0][0]})" if len(points) == 1 else "")


def _loss_unit(run_dirs: list[Path]) -> str:
    """What one loss value averages over: a language model's is per token, a classifier's per
    text (its task, from the run's config.yaml; a run without one is taken for a language model)."""
    import yaml
    units = set()
    for run in run_dirs:
        try:
            task = ((yaml.safe_load((Path(run) / "config.yaml").read_text()) or {}).get("task") or {}).get("name")
        except (OSError, AttributeError, yaml.YAMLError):
            task = None
        units.add("nats/text" if task == "classify" else "nats/token")
    return units.pop() if len(units) == 1 else "nats"


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """The train and validation loss of each run, drawn into ``out``. Raises NothingToPlot
    (nothing written) when no run has a single loss to draw."""
    # Every run is read before anything is drawn: a missing one fails with nothing written.
    runs = [(Path(run).name, read_metrics(run)) for run in run_dirs]
    curves = [(name, _points(rows, "loss"), _points(rows, "val_loss")) for name, rows in runs]
    if not any(train or val for _, train, val in curves):
        names = ", ".join(str(r) for r in run_dirs)
        raise NothingToPlot(f"{names}: metrics.csv has no loss yet (the run stopped before its first logged "
                            f"step): nothing to plot")
    import matplotlib
    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, train, val in curves:
        if train:
            ax.plot(*zip(*train), label=_label(name, "train", train), lw=1.2,
                    marker="." if len(train) < FEW_POINTS else None, ms=8 if len(train) == 1 else 6)
        if val:
            ax.plot(*zip(*val), "o--", label=_label(name, "val", val), ms=4 if len(val) > 1 else 6)
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy loss ({_loss_unit(run_dirs)})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, out)
