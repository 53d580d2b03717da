"""What a folder a command was given is, for the hint of an error that names it: a folder of
runs, a run, a checkpoint, prepared data or a Hugging Face model, and what lies in it.

A user who passes a run folder as data.dir or init.from_hf, or a data folder as --checkpoint,
learns which of them it is and what exists nearby, instead of a hint for the kind the command
expected.
Pure path reads (no torch): the light verbs use it too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

CHECKPOINT_MARKER = "distlm.json"  # distlm/checkpoint/store.py MARKER
SHOWN = 4  # runs or steps named in a hint, newest first


def kind_of(path: str | Path) -> Optional[str]:
    """'checkpoint', 'run', 'data', 'hf', 'runs' (a folder of runs) or None (none of them)."""
    p = Path(path)
    if not p.is_dir():
        return None
    if (p / CHECKPOINT_MARKER).is_file():
        return "checkpoint"
    if (p / "manifest.json").is_file():
        return "data"
    if (p / "checkpoints").is_dir() or (p / "metrics.csv").is_file() or (p / "config.yaml").is_file():
        return "run"
    if (p / "config.json").is_file():
        return "hf"
    if _runs_in(p):
        return "runs"
    return None


NAMES = {"checkpoint": "a checkpoint folder", "run": "a run folder", "data": "a prepared data folder (distlm prepare)",
         "hf": "a Hugging Face model folder", "runs": "a folder of runs"}
# The setting that takes a folder of the kind, for a hint that points the right way.
TAKEN_BY = {"data": "data.dir", "hf": "init.from_hf"}


def describe(path: str | Path) -> str:
    """'it does not exist', 'it is a run folder', 'it is a Hugging Face model folder, for
    init.from_hf', ... for the error's hint."""
    p = Path(path)
    if not p.exists():
        return "it does not exist"
    kind = kind_of(p)
    if not kind:
        return "it is not a folder" if not p.is_dir() else "it holds no run"
    return f"it is {NAMES[kind]}" + (f", for {TAKEN_BY[kind]}" if kind in TAKEN_BY else "")


def not_hf(path: str | Path) -> str:
    """What a folder given as init.from_hf is instead, and what exists there: '' where it is
    none of the kinds (its missing config.json says enough)."""
    p = Path(path)
    kind = kind_of(p)
    if not p.exists():
        return "; it does not exist"
    if kind == "checkpoint":
        return f"; {p} is a checkpoint folder: `distlm export {p} OUT` writes it as a Hugging Face folder"
    if kind == "run":
        steps = _steps(p)
        if not steps:
            return f"; {p} is a run folder with no complete checkpoint"
        return (f"; {p} is a run folder (checkpoints: {', '.join(steps[:SHOWN])}): `distlm export {p} OUT` writes "
                f"its newest as a Hugging Face folder")
    if kind == "runs":
        return f"; {p} is a folder of runs; {checkpoints_near(p)}; `distlm export RUN OUT` writes one as a Hugging Face folder"
    if kind == "data":
        return f"; {p} is {NAMES['data']}, for data.dir"
    return ""


def checkpoints_near(path: str | Path) -> str:
    """The complete checkpoints a mistyped path may have meant: the steps of the run it is in,
    or the runs (with their newest step) of the folder nearest to it that has some."""
    p = Path(path)
    for q in (p, *p.parents):
        if not q.is_dir():
            continue
        run = q.parent if q.name == "checkpoints" else q
        steps = _steps(run)
        if steps:
            return f"checkpoints of {run}: {', '.join(steps[:SHOWN])}"
        runs = _runs_in(q)
        if runs:
            shown = ", ".join(f"{r.name} ({_steps(r)[0]})" for r in runs[:SHOWN])
            more = f", and {len(runs) - SHOWN} more" if len(runs) > SHOWN else ""
            return f"runs with checkpoints under {q}: {shown}{more}"
        if q == Path.cwd() or str(q) in (".", "/"):
            break
    return "no run with a complete checkpoint near it"


def _steps(run: Path) -> list[str]:
    """The run's complete checkpoints, newest first."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((c.name for c in root.iterdir() if c.name.startswith("step_") and not c.is_symlink()
                   and (c / CHECKPOINT_MARKER).is_file()), reverse=True)


def _runs_in(folder: Path) -> list[Path]:
    """Runs with a complete checkpoint directly under ``folder``, newest first."""
    try:
        runs = [r for r in folder.iterdir() if r.is_dir() and not r.is_symlink() and _steps(r)]
    except OSError:
        return []
    return sorted(runs, key=lambda r: (r / "checkpoints").stat().st_mtime, reverse=True)
