"""Where metrics go: metrics.csv (the source of truth), TensorBoard, optional W&B; and
text samples: RUN/samples.txt and TensorBoard's text tab.

Only the main rank writes. metrics.csv has one row per logged step: values logged again
for the same step (the final evaluation after the last step's row) are merged into its
row, the file rewritten whole (atomically, so a reader sees the old file or the new one).
On resume, CSV rows and samples past the resumed step are dropped so the files show one
run, not the crashed attempt and its repeat.
"""
from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from distlm.io import atomic_write_text, read_csv, trim_csv, write_csv

# wall_time (Unix seconds) lets a benchmark time each row from its own process start.
COLUMNS = ["step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb",
           "val_loss", "val_ppl", "elapsed_s", "wall_time"]
SAMPLES_FILE = "samples.txt"
SAMPLES_HEADER = "=== step "  # each evaluation's block in samples.txt starts with this


def log_interval(every: int, max_steps: int) -> int:
    """Steps between log rows: log.every, but a short run logs often enough to draw a curve
    (about 20 points: 30 steps with log.every 50 would otherwise give one)."""
    return max(1, min(every, max_steps // 20))


class RunLogger:
    def __init__(self, run_dir: Path, cfg, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.csv_path = Path(run_dir) / "metrics.csv"
        self.tb = None
        self.wandb = None
        self.elapsed_offset = 0.0
        self.samples_path = Path(run_dir) / SAMPLES_FILE
        self._last: dict | None = None  # the newest row written, for merging
        if not enabled:
            return
        self._truncate(resume_step)
        self._trim_samples(resume_step)
        new = not self.csv_path.exists()
        self._file = open(self.csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if new:
            self._csv.writeheader()
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

    def _truncate(self, step: int) -> None:
        rows = trim_csv(self.csv_path, COLUMNS, keep=lambda r: int(r["step"]) <= step)
        # Elapsed time counts across resumes: a resumed run continues from where its rows end.
        times = [float(r["elapsed_s"]) for r in rows if r.get("elapsed_s")]
        self.elapsed_offset = max(times, default=0.0)
        self._last = dict(rows[-1]) if rows else None

    def _trim_samples(self, step: int) -> None:
        """Drop the samples.txt blocks of steps past ``step`` (a crashed attempt's)."""
        if not self.samples_path.is_file():
            return
        blocks, keep = [], True
        for line in self.samples_path.read_text().splitlines(keepends=True):
            if line.startswith(SAMPLES_HEADER):
                n = line[len(SAMPLES_HEADER):].split(" ", 1)[0]
                keep = not n.isdigit() or int(n) <= step
            if keep:
                blocks.append(line)
        text = "".join(blocks)
        if text != self.samples_path.read_text():
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
        self._file.close()
        rows = read_csv(self.csv_path)
        write_csv(self.csv_path, COLUMNS, rows[:-1] + [merged])
        self._file = open(self.csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._last = merged

    def samples(self, step: int, header: str, prompt: str, texts: list[str]) -> None:
        """Text samples of this step: appended to RUN/samples.txt, and to TensorBoard's text
        tab (tag "samples") as code blocks, which keep the text's own line breaks."""
        if not self.enabled or not texts:
            return
        block = [f"{SAMPLES_HEADER}{step} === {header}\n"]
        block += [f"--- sample {i} (seed {i}) ---\n{prompt}{t}\n" for i, t in enumerate(texts)]
        with open(self.samples_path, "a") as f:
            f.write("".join(block) + "\n")
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
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def console_line(step: int, r: dict) -> str:
    """One line per log step: step, loss, lr, grad norm, tokens/s, MFU, memory (and val)."""
    parts = [f"step {step:>6}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}",
             f"tok/s {r['tokens_per_s']:,.0f}", "mfu " + ("n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"),
             "mem " + ("n/a" if r["mem_gb"] is None else f"{r['mem_gb']:.2f}GB")]
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
    return " | ".join(parts)
