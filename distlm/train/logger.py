"""Where metrics go: metrics.csv (the source of truth), TensorBoard, optional W&B.

Only the main rank writes. On resume, CSV rows past the resumed step are dropped so
the file shows one run, not the crashed attempt and its repeat.
"""
from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from distlm.io import trim_csv

# wall_time (Unix seconds) lets a benchmark time each row from its own process start.
COLUMNS = ["step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb",
           "val_loss", "val_ppl", "elapsed_s", "wall_time"]


class RunLogger:
    def __init__(self, run_dir: Path, cfg, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.csv_path = Path(run_dir) / "metrics.csv"
        self.tb = None
        self.wandb = None
        self.elapsed_offset = 0.0
        if not enabled:
            return
        self._truncate(resume_step)
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

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        row = {k: ("" if values.get(k) is None else values.get(k)) for k in COLUMNS}
        row["step"] = step
        row["wall_time"] = f"{time.time():.3f}"
        if values.get("elapsed_s") is not None:
            row["elapsed_s"] = values["elapsed_s"] + self.elapsed_offset
        self._csv.writerow(row)
        self._file.flush()
        clean = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in clean.items():
                if k not in ("step",):
                    self.tb.add_scalar(f"{'val' if k.startswith('val') else 'train'}/{k}", v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

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
