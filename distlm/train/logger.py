"""Where metrics go: metrics.csv (the source of truth), TensorBoard, optional W&B; and
text samples: RUN/samples.txt and TensorBoard's text tab.

Only the main rank writes. metrics.csv has one row per logged step: values logged again
for the same step (the final evaluation after the last step's row) are merged into its
row, the file rewritten whole (atomically, so a reader sees the old file or the new one).
Nothing is written into a file at these names: metrics.csv is appended to only through the
descriptor of the new file distlm made for it (distlm/io.py: replace_and_keep), and so is
samples.txt, made new with the kept blocks at the first samples of this process; a link
placed at either name is replaced, never written through. On resume, CSV rows and samples
past the resumed step are dropped so the files show one run, not the crashed attempt and
its repeat.
"""
from __future__ import annotations

import csv
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from distlm.io import atomic_write_text, csv_text, read_csv, read_own, replace_and_keep

# wall_time (Unix seconds) lets a benchmark time each row from its own process start.
COLUMNS = ["step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb",
           "val_loss", "val_ppl", "elapsed_s", "wall_time"]
SAMPLES_FILE = "samples.txt"
SAMPLES_HEADER = "=== step "  # each evaluation's block in samples.txt starts with this
SAMPLES_LIMIT = 256 << 20  # samples.txt is read whole on resume: a bound on that read


DEFAULT_LOG_EVERY = 10


def log_interval(every: Optional[int], max_steps: int) -> int:
    """Steps between log rows: log.every as given; auto (None) is DEFAULT_LOG_EVERY, but a
    short run logs often enough to draw a curve (about 20 points)."""
    return every if every else max(1, min(DEFAULT_LOG_EVERY, max_steps // 20))


class RunLogger:
    def __init__(self, run_dir: Path, cfg, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.csv_path = Path(run_dir) / "metrics.csv"
        self.tb = None
        self.wandb = None
        self.elapsed_offset = 0.0
        self.samples_path = Path(run_dir) / SAMPLES_FILE
        self._last: dict | None = None  # the newest row written, for merging
        self._kept_samples = ""  # samples.txt's blocks up to the resumed step, until the first new block
        self._samples = None  # samples.txt's own descriptor, from the first new block on
        if not enabled:
            return
        rows = self._truncate(resume_step)
        self._trim_samples(resume_step)
        self._reopen(rows)
        if cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step or None)
        if cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                print("log.wandb=true but wandb is not installed (pip install wandb); skipping W&B")
            else:
                self.wandb = wandb.init(project=cfg.log.wandb_project, name=Path(run_dir).name,
                                        config=cfg.to_dict(), dir=str(run_dir), resume="allow")

    def _reopen(self, rows: list[dict]) -> None:
        """metrics.csv as a new file holding ``rows``, kept open for the rows to come."""
        self._file = replace_and_keep(self.csv_path, csv_text(COLUMNS, rows))
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS, extrasaction="ignore")

    def _truncate(self, step: int) -> list[dict]:
        """The rows of metrics.csv up to ``step``. A row whose step or elapsed time is not a
        number (a damaged file) is dropped, with one warning: the curves lose a point, the
        run is not refused."""
        rows, bad = [], 0
        for r in read_csv(self.csv_path):
            try:
                n = int(r.get("step") or "")
                elapsed = float(r["elapsed_s"]) if r.get("elapsed_s") else None
            except (TypeError, ValueError):
                bad += 1
                continue
            if n <= step and (elapsed is None or math.isfinite(elapsed)):
                rows.append(r)
        if bad:
            print(f"warning: {self.csv_path}: {bad} damaged row(s) dropped (a step or elapsed time that is not "
                  f"a number)", file=sys.stderr, flush=True)
        # Elapsed time counts across resumes: a resumed run continues from where its rows end.
        times = [float(r["elapsed_s"]) for r in rows if r.get("elapsed_s")]
        self.elapsed_offset = max(times, default=0.0)
        self._last = dict(rows[-1]) if rows else None
        return rows

    def _trim_samples(self, step: int) -> None:
        """Drop the samples.txt blocks of steps past ``step`` (a crashed attempt's)."""
        old = read_own(self.samples_path, SAMPLES_LIMIT).decode("utf-8", errors="replace")
        self._kept_samples = old
        if not old:
            return
        blocks, keep = [], True
        for line in old.splitlines(keepends=True):
            if line.startswith(SAMPLES_HEADER):
                n = line[len(SAMPLES_HEADER):].split(" ", 1)[0]
                keep = not n.isdigit() or int(n) <= step
            if keep:
                blocks.append(line)
        text = "".join(blocks)
        self._kept_samples = text
        if text != old:
            atomic_write_text(self.samples_path, text)

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        row = {k: ("" if values.get(k) is None else values.get(k)) for k in COLUMNS}
        row["step"] = step
        row["wall_time"] = f"{time.time():.3f}"
        if values.get("elapsed_s") is not None:
            row["elapsed_s"] = values["elapsed_s"] + self.elapsed_offset
        if self._last is not None and str(self._last["step"]) == str(step):
            self._merge(row)
        else:
            self._csv.writerow(row)
            self._file.flush()
            self._last = row
        clean = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in clean.items():
                if k not in ("step",):
                    self.tb.add_scalar(f"{'val' if k.startswith('val') else 'train'}/{k}", v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def _merge(self, row: dict) -> None:
        """Values for the step of the newest row (the final evaluation): one row per step,
        so they go into that row, and the file is rewritten whole, atomically."""
        merged = {**self._last, **{k: v for k, v in row.items() if v != ""}}
        self._file.flush()
        self._file.seek(0)
        rows = list(csv.DictReader(self._file))
        self._file.close()
        self._reopen(rows[:-1] + [merged])
        self._last = merged

    def samples(self, step: int, header: str, prompt: str, texts: list[str]) -> None:
        """Text samples of this step: appended to RUN/samples.txt, and to TensorBoard's text
        tab (tag "samples") as code blocks, which keep the text's own line breaks."""
        if not self.enabled or not texts:
            return
        block = [f"{SAMPLES_HEADER}{step} === {header}\n"]
        block += [f"--- sample {i} (seed {i}) ---\n{prompt}{t}\n" for i, t in enumerate(texts)]
        if self._samples is None:
            self._samples = replace_and_keep(self.samples_path, self._kept_samples, newline=None)
            self._kept_samples = ""
        self._samples.write("".join(block) + "\n")
        self._samples.flush()
        if self.tb is not None:
            md = [f"step {step}: {header}"]
            for i, t in enumerate(texts):
                md.append(f"sample {i} (seed {i}):\n\n" + "\n".join("    " + ln for ln in (prompt + t).split("\n")))
            self.tb.add_text("samples", "\n\n".join(md), step)
            self.tb.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._samples is not None:
            self._samples.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def clock_text(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    s = max(0, int(round(seconds)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass(frozen=True)
class Status:
    """Where a run stands after a step: what the console row and the progress bar both show."""
    step: int
    max_steps: int
    elapsed_s: float        # since this process's first step began
    eta_s: Optional[float]  # None until a step has been timed
    by_time_limit: bool     # the time limit, not max_steps, is the nearer end
    fraction: float         # of the run done: the larger of the step and the time shares

    @property
    def text(self) -> str:
        eta = "eta ?" if self.eta_s is None else f"eta {clock_text(self.eta_s)}"
        return f"{clock_text(self.elapsed_s)} elapsed | {eta}{' (time limit)' if self.by_time_limit else ''}"


class Progress:
    """Elapsed time and ETA from this process's own pace: its mean time per step so far
    (evaluations and saves included, as they recur). The run ends at max_steps or at
    train.time_limit_s, whichever comes first; the ETA is to that end."""

    def __init__(self, max_steps: int, time_limit_s: float, start_step: int, t_start: float):
        self.max_steps, self.time_limit_s = max_steps, time_limit_s
        self.start_step, self.t_start = start_step, t_start

    def at(self, step: int, now: float, finished: bool = False) -> Status:
        """``finished``: the schedule ended with this step (max_steps, or a time clock's limit)."""
        elapsed = now - self.t_start
        if finished:
            return Status(step, self.max_steps, elapsed, 0.0, False, 1.0)
        done = step - self.start_step
        eta = (self.max_steps - step) * elapsed / done if done > 0 else None
        by_time = False
        fraction = step / max(1, self.max_steps)
        if self.time_limit_s:
            left = max(0.0, self.time_limit_s - elapsed)
            by_time = eta is not None and left < eta
            eta = left if by_time else eta
            fraction = max(fraction, elapsed / self.time_limit_s)
        return Status(step, self.max_steps, elapsed, eta, by_time, min(1.0, fraction))


class ProgressBar:
    """A tqdm bar on stderr, for terminals only (piped to a file its redraws are thousands of
    lines). It shows the Status the rows show, the step of max_steps, elapsed and ETA, and
    fills by Status.fraction, so a run that will end at its time limit fills by time; tqdm's
    own rate and remaining time, which know neither the time limit nor evaluations, are left
    out. Rows go through write(), after which tqdm redraws the bar: the row and the bar below
    it show the same step and times."""

    def __init__(self, status: Status):
        from tqdm import tqdm
        self._bar = tqdm(total=1.0, bar_format="{percentage:3.0f}%|{bar}| {postfix}", dynamic_ncols=True,
                         leave=False)
        self.show(status)

    def show(self, status: Status) -> None:
        self._bar.set_postfix_str(f"step {status.step}/{status.max_steps} | {status.text}", refresh=False)
        self._bar.update(status.fraction - self._bar.n)  # redraws at most every tqdm.mininterval

    def write(self, text: str) -> None:
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()


def console_line(status: Status, r: dict) -> str:
    """One line per log step: step of max, elapsed, ETA, loss, lr, grad norm, tokens/s, MFU,
    memory (and val)."""
    parts = [f"step {status.step:>6}/{status.max_steps}", status.text, f"loss {r['loss']:.4f}",
             f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}",
             f"tok/s {r['tokens_per_s']:,.0f}", "mfu " + ("n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"),
             "mem " + ("n/a" if r["mem_gb"] is None else f"{r['mem_gb']:.2f}GB")]
    if r.get("moe_load_max_over_mean") is not None:  # the busiest expert's load over the mean, worst block
        parts.append(f"moe max/mean {r['moe_load_max_over_mean']:.2f}")
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
    return " | ".join(parts)
