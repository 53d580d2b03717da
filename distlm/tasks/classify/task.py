"""The ``Task`` for task.name=classify: data dimensions, model, loader, loss, evaluation.

The Trainer asks its task for each of these and otherwise runs its one loop: the same
train_step (accumulation, no_sync, clipping, NaN handling), checkpoints, resume, signals
and logging. Each evaluation also writes, on the main rank, ``RUN/eval-val.json`` (accuracy,
macro-F1, confusion matrix), ``RUN/confusion-val.png`` and a row of ``RUN/classify_metrics.csv``,
and prints the matrix.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlm.config import Config, ConfigError, updated
from distlm.data import fit_vocab
from distlm.io import atomic_write_text, read_csv, write_csv
from distlm.layout import TASKS
from distlm.tasks.classify import data as cdata
from distlm.tasks.classify.loader import ClassifyLoader, eval_batches
from distlm.tasks.classify.metrics import confusion_text, plot_confusion, scores
from distlm.model.classifier import Classifier, classify_loss
from distlm.tasks.base import Resolved, RunContext
from distlm.checkpoint import store as ckpt

METRIC_COLUMNS = ["step", "val_loss", "accuracy", "macro_f1", "examples"]


def load_trunk(model, init_from: str) -> None:
    """An LM run's weights, by name, into the classifier's trunk (everything but its head).
    Collective (DCP); called on the allocated, possibly sharded, not yet DDP-wrapped model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    folder = ckpt.resolve_checkpoint(init_from)
    sd = {k: v for k, v in get_state_dict(model, [])[0].items() if not k.startswith("cls_head.")}
    ckpt.load_model_state(folder, sd)
    set_state_dict(model, [], model_state_dict=sd, optim_state_dict={}, options=StateDictOptions(strict=False))


def default_data_dir(cfg: Config) -> Path:
    return Path("data") / f"20news4-gpt2-L{cfg.model.block_size}"


class ClassifyTask:
    name = "classify"
    needs = TASKS["classify"]  # whole rows, no LM head: data parallelism only (distlm/layout/needs.py)

    def __init__(self):
        self.last: dict | None = None  # the latest evaluation
        self.loader: ClassifyLoader | None = None  # the training batches, for bench_fields

    # ---- configuration --------------------------------------------------------------
    def resolve(self, cfg: Config, comm, is_main: bool) -> Resolved:
        """Read (or, for the default data set, prepare) the data; fill vocab_size and
        take the architecture from task.init_from's LM run."""
        if cfg.task.init_from:
            cfg = dataclasses.replace(cfg, model=self._lm_architecture(cfg))
        if not cfg.data.dir:
            cfg = updated(cfg, data={"dir": str(default_data_dir(cfg))})
            if is_main:
                print(f"data.dir not set: the vendored 4-topic 20 Newsgroups set, prepared into {cfg.data.dir}")
                cdata.prepare_classify([str(cdata.DEFAULT_DATA)], Path(cfg.data.dir), max_len=cfg.model.block_size)
            comm.barrier()
        data_dir = Path(cfg.data.dir)
        self.manifest = manifest = cdata.load_manifest(data_dir)
        cfg = updated(cfg, model={"vocab_size": fit_vocab(cfg.model.vocab_size, manifest, data_dir)})
        if manifest["max_len"] > cfg.model.block_size:
            raise ConfigError(f"{data_dir} was prepared with --max-len {manifest['max_len']}, longer than "
                              f"model.block_size={cfg.model.block_size}; raise model.block_size or prepare again")
        self.labels = manifest["labels"]
        self.train_data = cdata.load_split(data_dir, manifest, "train")
        self.val_data = cdata.load_split(data_dir, manifest, "val") if manifest["splits"]["val"]["rows"] else None
        return Resolved(cfg, manifest, data_dir)

    def _lm_architecture(self, cfg: Config):
        """The trunk's shape is the LM checkpoint's, whatever the preset said."""
        from distlm.config import config_from_dict
        folder = ckpt.resolve_checkpoint(cfg.task.init_from)
        lm = config_from_dict(ckpt.read_meta(folder)["config"])
        if lm.task.name != "lm":
            raise ConfigError(f"task.init_from={cfg.task.init_from}: a {lm.task.name} checkpoint, not a language model")
        meta = folder.parent.parent / "tokenizer" / "tokenizer.meta.json"
        if meta.is_file() and json.loads(meta.read_text())["name"] != "gpt2":
            raise ConfigError(f"task.init_from={cfg.task.init_from}: trained with tokenizer "
                              f"{json.loads(meta.read_text())['name']}; classification data uses gpt2")
        return lm.model

    # ---- model, data, loss ----------------------------------------------------------
    def build_model(self, cfg: Config) -> Classifier:
        return Classifier(cfg.model, len(self.labels), cfg.task.pooling, cfg.task.attention)

    def after_init(self, model, cfg: Config) -> None:
        if cfg.task.init_from:  # an LM's trunk; a resume then loads the run's own weights over it
            load_trunk(model, cfg.task.init_from)

    def build_loader(self, cfg: Config, dims, device: torch.device) -> ClassifyLoader:
        t = cfg.train
        self.loader = ClassifyLoader(self.train_data, seed=t.seed, global_batch=t.global_batch_size,
                                     micro_batch=t.micro_batch_size, dp_rank=dims.dp_rank, dp_size=dims.dp_size,
                                     pin_memory=device.type == "cuda")
        return self.loader

    def loss_fn(self, cfg: Config, plan):
        return lambda model, x, y: classify_loss(model(x), y)

    def pipeline_loss(self, cfg: Config, plan):
        raise ConfigError("task.name=classify does not run under pipeline parallelism")

    def write_run_files(self, run_dir: Path) -> None:
        m = self.manifest
        atomic_write_text(run_dir / "labels.json", json.dumps(
            {"labels": self.labels, "label_field": m["label_field"], "pad_id": m["pad_id"], "max_len": m["max_len"],
             "tokenizer": m["tokenizer"]}, indent=1))

    def bench_fields(self, step_s: float) -> dict:
        loader = self.loader
        return {"task": "classify", "train_examples": loader.n, "steps_per_epoch": loader.steps_per_epoch,
                "epoch_s": step_s * loader.steps_per_epoch, "examples_per_s": loader.global_batch / step_s}

    def eval_metrics(self) -> dict:
        return {k: self.last[k] for k in ("accuracy", "macro_f1")} if self.last else {}

    def describe_eval(self) -> str:
        return f"{self.last['examples']:,} val examples" if self.last else "no val examples"

    def samples(self, ctx: RunContext) -> list[str]:
        return []  # a classifier has no text to show (its evaluation prints the confusion matrix)

    # ---- evaluation ---------------------------------------------------------------
    def evaluates_with_training_loss(self, cfg: Config) -> bool:
        return False  # accuracy and confusion too, on micro-batches 4x the training ones

    @torch.no_grad()
    def evaluate(self, ctx: RunContext) -> float:
        """Loss, accuracy, macro-F1 and confusion over the whole val split (collective)."""
        if self.val_data is None:
            return float("nan")
        C, device, dims = len(self.labels), ctx.device, ctx.dims
        conf = torch.zeros(C * C, dtype=torch.float64, device=device)
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        ctx.model.eval()
        for batch, y, w in eval_batches(self.val_data, 4 * ctx.cfg.train.micro_batch_size, dims.dp_rank,
                                        dims.dp_size):
            batch, y, w = batch.to(device), y.to(device), w.to(device)
            with ctx.compute():
                logits = ctx.model(batch)
            loss_sum += (F.cross_entropy(logits.float(), y, reduction="none") * w).sum().double()
            conf.index_add_(0, y * C + logits.argmax(-1), w.double())
        ctx.model.train()
        totals = torch.cat([loss_sum, conf])
        if dims.dp_size > 1:
            dist.all_reduce(totals, group=dims.dp_mesh.get_group())
        confusion = totals[1:].round().long().view(C, C).cpu().numpy()
        result = scores(confusion)
        loss = float(totals[0]) / max(1, result["examples"])
        self.last = {"step": ctx.step, "val_loss": loss, **result, "labels": self.labels,
                     "confusion": confusion.tolist()}
        if dims.is_main:
            self._report(ctx.run_dir, confusion)
        return loss

    def _report(self, run_dir: Path, confusion: np.ndarray) -> None:
        from tqdm import tqdm
        r = self.last
        tqdm.write(f"eval step {r['step']}: accuracy {r['accuracy']:.4f}, macro-F1 {r['macro_f1']:.4f} over "
                   f"{r['examples']:,} examples (majority class {r['majority_baseline']:.4f}), loss {r['val_loss']:.4f}\n"
                   + confusion_text(confusion, self.labels))
        run_dir.mkdir(parents=True, exist_ok=True)
        # the names `distlm eval` gives its val split's: one file of each, the newest evaluation's
        atomic_write_text(run_dir / "eval-val.json", json.dumps(r, indent=1))
        plot_confusion(confusion, self.labels, run_dir / "confusion-val.png",
                       f"step {r['step']}: accuracy {r['accuracy']:.3f}, macro-F1 {r['macro_f1']:.3f}")
        # A resumed run replaces the rows past its step, as metrics.csv does.
        path = run_dir / "classify_metrics.csv"
        rows = [row for row in read_csv(path) if int(row["step"]) < r["step"]]
        write_csv(path, METRIC_COLUMNS, rows + [{k: r[k] for k in METRIC_COLUMNS}])
