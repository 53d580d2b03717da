"""The one Trainer. Every mode (1 process, DDP, FSDP2, ...) is this loop with other config.

Single process:   distlm train data.dir=DIR
Data parallel:    torchrun --nproc_per_node 4 -m distlm train data.dir=DIR parallel.dp_shard=4
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Optional

import torch

from distlm.config import Config, ConfigError, to_yaml
from distlm.data.loader import BatchLoader, TokenBlocks, val_micro_batches
from distlm.model.gpt import count_params, flops_per_token
from distlm.model.loss import lm_loss
from distlm.parallel import ParallelDims, init_distributed
from distlm.parallel.comm import TorchComm
from distlm.parallel.grad import clip_grad_norm, grad_sync
from distlm.tasks import build_task
from distlm.train import checkpoint as ckpt
from distlm.train.faults import (StopFlag, TrainingStopped, Watchdog, nonfinite_grads,  # noqa: F401 (re-exported)
                                 nonfinite_verdict, stop_reason)
from distlm.train.logger import RunLogger, console_line
from distlm.train.metrics import memory_gb, mfu, peak_tflops
from distlm.train.optim import build_optimizer
from distlm.train.schedule import lr_at
from distlm.parallel.tp import full
from distlm.train.setup import autocast_dtype, build_model, compute_context, data_dims, resolve_device  # noqa: F401


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims | None = None, run_dir: str | Path | None = None):
        self.cfg = cfg
        # torchrun sets LOCAL_RANK; horovodrun only HOROVOD_LOCAL_RANK (without it every Horovod
        # rank took cuda:0 and NCCL refused: "ncclCommInitRank failed: invalid usage", 2x H200).
        env = __import__("os").environ
        self.device = resolve_device(cfg.train.device, int(env.get("LOCAL_RANK", env.get("HOROVOD_LOCAL_RANK", 0))))
        if dims is None and cfg.parallel.engine == "horovod":
            from distlm.parallel.horovod import init_horovod
            dims = init_horovod(cfg.parallel, self.device.type)
        self.dims = dims or init_distributed(cfg.parallel, self.device.type)
        self.comm = getattr(self.dims, "comm", None) or TorchComm(self.dims)
        self.amp_dtype = autocast_dtype(cfg, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if cfg.init.from_hf:  # the architecture comes from the Hugging Face folder
            from distlm.interop import apply_hf_model_config
            apply_hf_model_config(cfg.model, cfg.init.from_hf, block_size=cfg.model.block_size)
        # A task other than the LM (task.name=classify) supplies its data, model (through
        # build_model), loader, loss and evaluation; for the LM, self.task is None and every
        # line below runs as before.
        self.task = build_task(cfg)
        self.manifest, self.data_dir = (self.task.data_dims(cfg, self.comm, self.dims.is_main) if self.task
                                        else data_dims(cfg))
        if cfg.init.from_hf and self.manifest and int(self.manifest["tokenizer"]["vocab_size"]) != cfg.model.vocab_size:
            raise ConfigError(f"init.from_hf={cfg.init.from_hf} has a {cfg.model.vocab_size}-token vocabulary but "
                              f"{cfg.data.dir} was prepared with {self.manifest['tokenizer']['name']} "
                              f"({self.manifest['tokenizer']['vocab_size']} tokens); prepare it with that tokenizer")
        self.run_dir = Path(run_dir) if run_dir else self._run_dir()
        # Dropout differs per data-parallel rank and pipeline stage, by design, but not
        # across a TP group: its ranks hold the same replicated activations (tp is the
        # mesh's innermost axis, so rank // tp numbers the other coordinates).
        torch.manual_seed(cfg.train.seed + self.dims.rank // self.dims.tp)
        self.model, self.gpt, self.pp = build_model(cfg, self.dims, self.device)
        self.optimizer = build_optimizer(self.model, cfg.train, self.device.type)
        # The pipeline's last stage takes logits: compiled, the fp32 cast, log-softmax and
        # gather fuse into one pass. Under TP the logits are DTensors for loss_parallel
        # (eager). Otherwise the LM's loss runs inside the model (see _loss).
        self.loss_fn = torch.compile(lm_loss) if cfg.train.compile and self.dims.tp == 1 else lm_loss
        self.loader = self._build_loader()
        if self.pp is not None:
            from distlm.parallel.pp import make_schedule
            make_schedule(self.pp, cfg.parallel, cfg.parallel.pp_microbatches or self.loader.accum_steps,
                          self.device, self.loss_fn)
        self.step = 0
        self.tokens_seen = 0
        self.best_val: Optional[float] = None
        self.best_ckpt: Optional[str] = None
        self.protected: list[str] = []  # checkpoints pruning must keep (the last one before a fault)
        self.nan_skips = 0
        n = count_params(cfg.model) if self.pp is not None else self.gpt.num_params()
        self.flops_per_token = flops_per_token(cfg.model, n)
        self.peak = peak_tflops(self.device, cfg.log.peak_tflops)
        self.resumed_from = self._maybe_resume()
        if cfg.parallel.engine == "horovod":  # after the resume: rank 0's state is broadcast
            from distlm.parallel.horovod import wrap_optimizer
            self.optimizer = wrap_optimizer(self.optimizer, self.model, self.loader.accum_steps,
                                            cfg.parallel.fp16_compression)
        self._write_run_files()
        if self.task:
            self.loss_fn = self.task.loss_fn  # in place of lm_loss

    # ---- set-up -------------------------------------------------------------------
    def _run_dir(self) -> Path:
        name = self.cfg.log.name or time.strftime("run-%Y%m%d-%H%M%S")
        if not self.cfg.log.name:
            name = self.comm.broadcast_object(name)  # every rank must agree on the folder
        run_dir = Path(self.cfg.log.root) / name
        if run_dir.exists() and any(run_dir.iterdir()) and self.cfg.train.resume == "never":
            raise ConfigError(f"run directory {run_dir} already exists; pass train.resume=auto to continue it, "
                              f"or choose another log.name")
        self.comm.barrier()  # else rank 0 may create the folder before a slower rank has checked it
        return run_dir

    def _build_loader(self) -> BatchLoader:
        if self.task:
            return self.task.build_loader(self)
        t, m = self.cfg.train, self.cfg.model
        blocks = None
        if self.data_dir is not None:
            if self.cfg.data.verify_checksums and self.dims.is_main:
                from distlm.data.prepare import verify_shards
                verify_shards(self.data_dir, self.manifest)
            blocks = TokenBlocks(self.data_dir, "train", m.block_size, self.manifest)
            # A data set prepared with --val-fraction 0 has no val split: train without evaluation.
            has_val = int(self.manifest["splits"].get("val", {}).get("tokens", 0)) > 0
            self.val_blocks = TokenBlocks(self.data_dir, "val", m.block_size, self.manifest) if has_val else None
        else:
            self.val_blocks = None
        return BatchLoader(blocks, seed=t.seed, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                           dp_rank=self.dims.dp_rank, dp_size=self.dims.dp_size,
                           synthetic_vocab=m.vocab_size, block_size=m.block_size,
                           pin_memory=self.device.type == "cuda")

    def _maybe_resume(self) -> Optional[Path]:
        path = ckpt.resume_target(self.cfg.train.resume, self.run_dir,
                                  say=print if self.dims.is_main else lambda msg: None)
        if path is None:
            return None
        meta = ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.load_state_dict(meta["trainer"])
        if self.dims.is_main:
            print(f"resumed from {path} (step {self.step}, newest complete checkpoint)")
        return path

    def _write_run_files(self) -> None:
        if not self.dims.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_text(self.run_dir / "config.yaml", to_yaml(self.cfg))
        if self.data_dir is not None:  # generation must not depend on the data folder staying put
            from distlm.data.tokenizer import load_tokenizer
            tok_dir = self.run_dir / "tokenizer"
            tok_dir.mkdir(exist_ok=True)
            load_tokenizer(self.manifest["tokenizer"]["name"], self.data_dir).save(tok_dir)
            ckpt.atomic_write_text(tok_dir / "tokenizer.meta.json",
                                   __import__("json").dumps(self.manifest["tokenizer"], indent=1))
        if self.task:
            self.task.write_run_files(self.run_dir)

    # ---- state --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                "best_val": self.best_val, "best_ckpt": self.best_ckpt, "protected": self.protected,
                "nan_skips": self.nan_skips}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.loader.load_state_dict(state["loader"])
        self.best_val, self.best_ckpt = state.get("best_val"), state.get("best_ckpt")
        self.protected, self.nan_skips = list(state.get("protected", [])), int(state.get("nan_skips", 0))

    # ---- the loop -----------------------------------------------------------------
    def _autocast(self):
        """autocast, the SDPA order and (under TP) loss_parallel: see setup.compute_context."""
        return compute_context(self.device, self.amp_dtype, self.dims.tp > 1 and self.cfg.parallel.loss_parallel)

    def train_step(self, mark=None, sync_grads: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over one global batch. Returns (mean loss, grad norm), on device.

        ``mark(phase)`` is called as each phase ends ("data", "forward_backward",
        "optimizer"); `distlm bench` times the phases with it, and runs a few steps with
        sync_grads=False (no gradient reduction at all) to measure exposed communication.
        A step whose loss or gradient is not finite is skipped or stops training (train.on_nan).
        """
        mark = mark or (lambda phase: None)
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, self.cfg.train)
        micro = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                 for x, y in self.loader.next()]
        mark("data")
        if self.pp is not None:
            from distlm.parallel.pp import train_pass
            loss_sum = train_pass(self.pp, micro, self._autocast, self.device)
        else:
            loss_sum = torch.zeros((), device=self.device)
            for i, (x, y) in enumerate(micro):
                with grad_sync(self.model, enabled=sync_grads and i == len(micro) - 1), self._autocast():
                    loss = self._loss(x, y) / len(micro)
                    loss.backward()
                loss_sum += full(loss.detach())
        loss_mean = self._dp_mean(loss_sum)
        mark("forward_backward")
        reduces_itself = hasattr(self.optimizer, "synchronize")  # Horovod: finish its allreduce first
        if reduces_itself:
            self.optimizer.synchronize()
        grad_norm = self._clip()
        # grad_norm is global (reduced over every rank), so all ranks take the same branch.
        # The check reads two numbers on the host: one device sync per step (on_nan=off avoids it).
        if self.cfg.train.on_nan == "off" or (bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss_mean))):
            with self.optimizer.skip_synchronize() if reduces_itself else contextlib.nullcontext():
                self.optimizer.step()
        else:
            self._on_nonfinite(float(loss_mean), float(grad_norm))
        self.optimizer.zero_grad()  # set_to_none, the default since torch 2.0 (Horovod takes no argument)
        mark("optimizer")
        self.step += 1
        self.tokens_seen += self.cfg.train.global_batch_size * self.cfg.model.block_size
        return loss_mean, grad_norm

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The LM without TP asks the model for its loss (GPT.head_loss): the head and the
        cross-entropy then compile with the forward and can run chunked (model.loss_chunk).
        TP's loss_parallel and a task's own loss take the logits."""
        if self.task is None and self.dims.tp == 1:
            return self.model(x, targets=y)
        return self.loss_fn(self.model(x), y)

    def _clip(self) -> torch.Tensor:
        if self.pp is None:
            return clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip)
        from distlm.parallel.pp import duplicate_params
        return clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip, pp_group=self.pp.group,
                              exclude=duplicate_params(self.pp))

    def _on_nonfinite(self, loss: float, grad_norm: float) -> None:
        complete, _ = ckpt.list_checkpoints(self.run_dir / "checkpoints")
        if complete and complete[-1].name not in self.protected:
            self.protected.append(complete[-1].name)  # the last good state survives pruning
        self.nan_skips += 1
        warning = nonfinite_verdict(self.step + 1, loss, grad_norm, nonfinite_grads(self.model),
                                    complete[-1] if complete else None, self.nan_skips, self.cfg.train)
        if self.dims.is_main:
            print(warning)

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.comm.mean(value)

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.task:
            return self.task.evaluate(self)
        if self.val_blocks is None:
            return float("nan")
        self.model.eval()
        batches = val_micro_batches(self.val_blocks, self.cfg.train.eval_batches, self.cfg.train.micro_batch_size,
                                    self.dims.dp_rank, self.dims.dp_size)
        total = torch.zeros((), device=self.device)
        if self.pp is not None:
            from distlm.parallel.pp import eval_pass
            total, n = eval_pass(self.pp, batches, self.loader.accum_steps, self._autocast, self.device)
        else:
            n = len(batches)
            for x, y in batches:
                with self._autocast():
                    total += full(self._loss(x.to(self.device), y.to(self.device)))
        self.model.train()
        return float(self._dp_mean(total / max(1, n)))

    def save(self, val_loss: Optional[float] = None) -> Optional[Path]:
        """A checkpoint of this step (collective). A write error stops training or, with
        train.on_save_error=continue, is reported and training goes on."""
        root = self.run_dir / "checkpoints"
        if val_loss is not None and math.isfinite(val_loss) and (self.best_val is None or val_loss < self.best_val):
            self.best_val, self.best_ckpt = val_loss, f"step_{self.step:07d}"
        meta = {"trainer": self.state_dict(), "config": self.cfg.to_dict(), "world_size": self.dims.world_size,
                "val_loss": val_loss, "saved_at": time.time()}
        self.finish_pending_save()  # an earlier background save reports its own errors, with its own step
        horovod = self.cfg.parallel.engine == "horovod"
        if horovod and not self.dims.is_main:
            self.comm.barrier()  # Horovod replicas are identical: rank 0 writes the state alone
            self._last_saved_step = self.step  # every rank must make the same save calls
            return root / f"step_{self.step:07d}"
        try:
            saved = ckpt.save_checkpoint(root, self.step, self.model, self.optimizer, meta,
                                         async_save=self.cfg.train.async_checkpoint and not horovod)
            if horovod:
                self.comm.barrier()
        except OSError as e:
            self._save_failed(self.step, e)
            return None
        self._last_saved_step = self.step
        if isinstance(saved, ckpt.PendingSave):
            self._pending = saved
            return saved.final
        self._prune()
        return saved

    def _save_failed(self, step: int, e: OSError) -> None:
        complete, _ = ckpt.list_checkpoints(self.run_dir / "checkpoints")
        msg = (f"cannot write checkpoint step_{step:07d} in {self.run_dir / 'checkpoints'}: {e.strerror or e}; "
               f"{'the previous checkpoint ' + str(complete[-1]) + ' is intact' if complete else 'no earlier checkpoint'}")
        if self.cfg.train.on_save_error == "stop":
            raise TrainingStopped(msg + " (train.on_save_error=stop)") from None
        if self.dims.is_main:
            print(f"warning: {msg}; training goes on (train.on_save_error=continue)")

    def finish_pending_save(self) -> None:
        """Complete a background save (collective); only then does it count as a checkpoint."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            return
        try:
            pending.finish()
        except OSError as e:
            self._save_failed(int(pending.meta["step"]), e)
            return
        self._prune()

    def _prune(self) -> None:
        if self.dims.is_main:
            root = self.run_dir / "checkpoints"
            keep = [root / n for n in ([self.best_ckpt] if self.best_ckpt else []) + self.protected]
            ckpt.prune_checkpoints(root, self.cfg.train.keep_last, keep)

    def train(self) -> dict:
        """The loop: step, log, evaluate, checkpoint; stops at max_steps, the time limit,
        or SIGTERM/SIGINT (after saving)."""
        cfg, main = self.cfg, self.dims.is_main
        logger = RunLogger(self.run_dir, cfg, enabled=main, resume_step=self.step)
        bar = None
        if main and cfg.log.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.train.max_steps, initial=self.step, unit="step", dynamic_ncols=True, leave=False)
        say = bar.write if bar is not None else print
        if main:
            say(f"run {self.run_dir} | {self.gpt.num_params(False) / 1e6:.2f}M params | device {self.device} "
                f"x{self.dims.world_size} | dtype {self.amp_dtype or torch.float32} | "
                f"{self.loader.accum_steps} micro-steps/step | FLOPs/token 6N+12LdT = {self.flops_per_token / 1e9:.4f} G")
        stop, watchdog = StopFlag(), Watchdog(cfg.train.watchdog_s, self.dims.rank)
        t_start = time.perf_counter()
        self._window = (time.perf_counter(), self.step)  # (start time, start step) of the tokens/s window
        last_val, last_loss, do_eval, stopped = None, float("nan"), False, None
        self.model.train()
        try:
            while self.step < cfg.train.max_steps:
                loss, grad_norm = self.train_step()
                watchdog.arm(self.step)  # armed after the first step: compilation may take minutes
                if bar is not None:
                    bar.update(1)
                do_eval = bool(cfg.train.eval_every) and self.step % cfg.train.eval_every == 0
                if self.step % cfg.log.every == 0 or self.step == cfg.train.max_steps or do_eval:
                    last_loss, val = self._log_step(logger, say, loss, grad_norm, do_eval, t_start)
                    last_val = val if do_eval else last_val
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                    self.save(last_val if do_eval else None)
                stopped = stop_reason(stop, t_start, cfg.train, self.step, self.dims, self.comm, self.device)
                if stopped:
                    if main:
                        say(f"{stopped} at step {self.step}: saving a checkpoint and exiting")
                    break
        finally:
            watchdog.disarm()
            stop.restore()
        if not stopped and (last_val is None or not do_eval):
            last_val = self.evaluate()
            logger.log(self.step, {"tokens": self.tokens_seen, "val_loss": last_val,
                                   "val_ppl": math.exp(min(last_val, 50))})
        # The last step may have been saved by checkpoint_every already: saving it again
        # would move a complete checkpoint aside for a moment, for nothing.
        if getattr(self, "_last_saved_step", None) == self.step:
            final = self.run_dir / "checkpoints" / f"step_{self.step:07d}"
        else:
            final = self.save(last_val if not stopped else None)
        self.finish_pending_save()
        logger.close()
        if bar is not None:
            bar.close()
        if main:
            from distlm.train.plot import plot_runs
            plot_runs([self.run_dir], self.run_dir / "loss.png")
        return {"step": self.step, "train_loss": last_loss, "val_loss": last_val, "stopped": stopped,
                "checkpoint": str(final) if final else None, "run_dir": str(self.run_dir)}

    def _log_step(self, logger, say, loss, grad_norm, do_eval: bool, t_start: float) -> tuple[float, Optional[float]]:
        cfg = self.cfg
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # time what ran, not what was queued
        t0, step0 = self._window
        dt = time.perf_counter() - t0
        tps = max(1, self.step - step0) * cfg.train.global_batch_size * cfg.model.block_size / dt
        row = {"tokens": self.tokens_seen, "loss": float(loss), "lr": self.optimizer.param_groups[0]["lr"],
               "grad_norm": float(grad_norm), "tokens_per_s": tps,
               "mfu": mfu(tps / self.dims.world_size, self.flops_per_token, self.peak),
               "mem_gb": memory_gb(self.device), "elapsed_s": time.perf_counter() - t_start}
        val = None
        if do_eval:
            val = self.evaluate()
            row.update(val_loss=val, val_ppl=math.exp(min(val, 50)))
        logger.log(self.step, row)
        if self.dims.is_main:
            say(console_line(self.step, row))
        self._window = (time.perf_counter(), self.step)
        return row["loss"], val
