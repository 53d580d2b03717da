"""Next-token prediction: the task the Trainer runs unless told otherwise."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn

from distlm.config import Config, ConfigError, updated
from distlm.data import DataError, fit_vocab, load_manifest
from distlm.data.loader import BatchLoader, TokenBlocks, val_micro_batches
from distlm.io import atomic_write_dir
from distlm.layout import TASKS, check_model_split
from distlm.model.gpt import GPT
from distlm.model.loss import lm_loss
from distlm.report.samples import sample_texts
from distlm.tasks.base import Resolved, RunContext

SYNTHETIC_VOCAB = 50257  # GPT-2's, so a synthetic benchmark costs what real GPT-2 data would


class LMTask:
    name = "lm"
    needs = TASKS["lm"]  # what the axes may split (distlm/layout/needs.py)

    def __init__(self):
        self.val_split: dict = {}     # name ("" for one folder, else each source's) -> val TokenBlocks
        self.val_sets: dict | None = None
        self.source_losses: dict = {}
        self.overall = None            # a mixture's weighting of its sources' losses
        self.manifest: dict = {}
        self.data_dir = None
        self.tokenizer = None          # none for synthetic data: no samples then
        self._no_samples_noted = False

    # ---- configuration --------------------------------------------------------------
    def resolve(self, cfg: Config, comm, is_main: bool) -> Resolved:
        if cfg.init.from_hf:  # the architecture comes from the Hugging Face folder
            from distlm.interop import apply_hf_model_config
            cfg = dataclasses.replace(cfg, model=apply_hf_model_config(cfg.model, cfg.init.from_hf,
                                                                       block_size=cfg.model.block_size))
        if cfg.data.source == "synthetic":
            cfg = updated(cfg, model={"vocab_size": cfg.model.vocab_size or SYNTHETIC_VOCAB})
            check_model_split(cfg.model, cfg.parallel)
            return Resolved(cfg, {}, None)
        if cfg.data.mix:
            # The sources share one tokenizer (checked): the first one's supplies it.
            from distlm.data.mixture import check_tokenizers, parse_mix
            entries = parse_mix(cfg.data.mix)
            manifests = [load_manifest(e.path) for e in entries]
            check_tokenizers([e.path for e in entries], manifests)
            data_dir, manifest = Path(entries[0].path), manifests[0]
        elif not cfg.data.dir:
            raise ConfigError("data.dir is not set: run `distlm prepare INPUT --out DIR` and pass data.dir=DIR "
                              "(or data.mix=... for a weighted mixture of prepared folders)")
        else:
            data_dir = Path(cfg.data.dir)
            manifest = load_manifest(data_dir)
        vocab = fit_vocab(cfg.model.vocab_size, manifest, data_dir)
        self._check_tokenizer(manifest, data_dir)
        if cfg.init.from_hf and int(manifest["tokenizer"]["vocab_size"]) != cfg.model.vocab_size:
            raise ConfigError(f"init.from_hf={cfg.init.from_hf} has a {cfg.model.vocab_size}-token vocabulary but "
                              f"{cfg.data.dir} was prepared with {manifest['tokenizer']['name']} "
                              f"({manifest['tokenizer']['vocab_size']} tokens); prepare it with that tokenizer")
        model = {"vocab_size": vocab}
        if cfg.model.attn_mask == "doc" and cfg.model.eot_id is None:
            eos = manifest["tokenizer"].get("eos_id")  # documents end where prepare put the EOT token
            if eos is None:
                raise ConfigError(f"model.attn_mask=doc: {data_dir}/manifest.json names no eos_id; set model.eot_id")
            model["eot_id"] = int(eos)
        cfg = updated(cfg, model=model)
        check_model_split(cfg.model, cfg.parallel)  # the vocabulary is known only now
        self.manifest, self.data_dir = manifest, data_dir
        return Resolved(cfg, manifest, data_dir)

    def _check_tokenizer(self, manifest: dict, data_dir: Path) -> None:
        """The manifest's tokenizer must be the one beside the data: the same fingerprint and
        vocabulary. A larger vocabulary trains rows no token ever reaches, and a tokenizer.json
        with two ids swapped would train on one mapping and decode samples with another."""
        from distlm.data.tokenizer import load_recorded_tokenizer
        self.tokenizer = load_recorded_tokenizer(manifest.get("tokenizer"), data_dir, data_dir / "manifest.json")

    # ---- model, data, loss ----------------------------------------------------------
    def build_model(self, cfg: Config) -> nn.Module:
        return GPT(cfg.model)

    def after_init(self, model: nn.Module, cfg: Config) -> None:
        if cfg.init.from_hf and cfg.train.resume == "never":  # a resume brings its own weights
            from distlm.interop import load_hf_into
            load_hf_into(model, cfg.init.from_hf)

    def build_loader(self, cfg: Config, dims, device: torch.device):
        t, m = cfg.train, cfg.model
        batch = dict(seed=t.seed, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                     dp_rank=dims.dp_rank, dp_size=dims.dp_size, pin_memory=device.type == "cuda")
        if cfg.data.mix:
            from distlm.data.mixture import MixtureLoader, load_sources
            sources = load_sources(cfg.data.mix, m.block_size, verify_checksums=cfg.data.verify_checksums and dims.is_main)
            loader = MixtureLoader(sources, **batch)
            self.val_split = {s.name: s.val for s in sources if s.val is not None}
            self.overall = loader.overall
            if dims.is_main:
                print(loader.describe())
            return loader
        blocks = None
        if self.data_dir is not None:
            if cfg.data.verify_checksums and dims.is_main:
                from distlm.data import verify_shards
                verify_shards(self.data_dir, self.manifest)
            blocks = TokenBlocks(self.data_dir, "train", m.block_size, self.manifest)
            # A data set prepared with --val-fraction 0 has no val split: train without evaluation.
            if int(self.manifest["splits"].get("val", {}).get("tokens", 0)) > 0:
                self.val_split = {"": TokenBlocks(self.data_dir, "val", m.block_size, self.manifest)}
        return BatchLoader(blocks, synthetic_vocab=m.vocab_size, block_size=m.block_size, **batch)

    def loss_fn(self, cfg: Config, plan):
        # Where the plan lets it, the model computes its own loss (GPT.head_loss): the head
        # and the cross-entropy compile with the forward and can run chunked
        # (model.loss_chunk). Else the logits are vocabulary-sharded DTensors for
        # loss_parallel (TP). ``forward``: the plan's per-batch arguments for the model.
        if plan.model_computes_loss:
            return lambda model, x, y, **forward: model(x, targets=y, **forward)
        return lambda model, x, y, **forward: lm_loss(model(x, **forward), y)

    def pipeline_loss(self, cfg: Config, plan):
        # Compiled, the fp32 cast, log-softmax and gather fuse into one pass; logits that
        # are DTensors (TP's loss_parallel) run eager.
        return torch.compile(lm_loss) if cfg.train.compile and not plan.distributes_logits else lm_loss

    # ---- evaluation -----------------------------------------------------------------
    def evaluates_with_training_loss(self, cfg: Config) -> bool:
        # Whole micro-batches of the training shape, unless a split is smaller than one: it
        # is then scored in one smaller batch, another shape to the compiler.
        return all(len(blocks) >= cfg.train.micro_batch_size for blocks in self.val_split.values())

    def evaluate(self, ctx: RunContext) -> float:
        """The mean loss over a fixed validation set spread across the whole val split (the
        same blocks whatever the world size or step; train.eval_batches micro-batches over all
        ranks, 0 = the whole split); per source and weighted overall for a mixture."""
        if not self.val_split:
            return float("nan")
        if self.val_sets is None:
            t, dims = ctx.cfg.train, ctx.dims
            self.val_sets = {name: val_micro_batches(blocks, t.eval_batches, t.micro_batch_size, dims.dp_rank,
                                                     dims.dp_size, name=name)
                             for name, blocks in self.val_split.items()}
        losses = {}
        for name, vs in self.val_sets.items():
            total, rows = ctx.eval_losses(vs.weighted())
            # Sums over counts, not a mean of per-rank means: exact for any world size.
            both = ctx.mean(torch.stack([total, rows]))
            losses[name] = float(both[0] / both[1])
        self.source_losses = {name: v for name, v in losses.items() if name}
        return losses[""] if "" in losses else self.overall(losses)

    def eval_metrics(self) -> dict:
        return {f"val_loss_{name}": v for name, v in self.source_losses.items()}

    def describe_eval(self) -> str:
        return "; ".join(vs.describe() for vs in (self.val_sets or {}).values())

    # ---- samples --------------------------------------------------------------------
    def samples(self, ctx: RunContext) -> list[str]:
        """log.samples continuations of log.sample_prompt (main rank; distlm/report/samples.py)."""
        n = ctx.cfg.log.samples
        if not n or self.tokenizer is None:
            return []
        if ctx.whole_model is None:
            if not self._no_samples_noted:
                self._no_samples_noted = True
                print(f"note: log.samples={n}: no samples during training: {ctx.no_whole_model}; sample a checkpoint "
                      f"with `distlm generate --checkpoint {ctx.run_dir}` (or set log.samples=0)", flush=True)
            return []
        return sample_texts(ctx.whole_model, self.tokenizer, ctx.cfg.log.sample_prompt, n)

    # ---- run folder -----------------------------------------------------------------
    def write_run_files(self, run_dir: Path) -> None:
        if self.data_dir is None:
            return

        def fill(tmp: Path) -> None:  # generation must not depend on the data folder staying put
            self.tokenizer.save(tmp)
            (tmp / "tokenizer.meta.json").write_text(json.dumps(self.manifest["tokenizer"], indent=1))

        atomic_write_dir(run_dir / "tokenizer", fill)

    def bench_fields(self, step_s: float) -> dict:
        return {}
