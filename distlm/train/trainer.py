"""The one Trainer. Every mode (1 process, DDP, FSDP2, TP, PP, Horovod) and every task
(language model, classifier) is this loop; what differs is held by objects it is given:

    task      what is trained on what (distlm/tasks/): data, model, loss, evaluation
    plan      what parallelize() made of the model (distlm/parallel/applied.py): the model to
              train, the compute context, the per-batch hook, the layout's answers
    stepper   how a global batch becomes gradients (distlm/parallel/step.py): plain or pipeline
    engine    who reduces gradients and writes checkpoints (distlm/parallel/engine.py)

Single process:   distlm train data.dir=DIR
Data parallel:    torchrun --nproc_per_node 4 -m distlm train data.dir=DIR parallel.dp_shard=4
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from distlm.config import Config, ConfigError, to_yaml
from distlm.device import resolve_device
from distlm.host import local_rank
from distlm.io import atomic_write_text
from distlm.model.float8 import check_float8_on
from distlm.model.gpt import flops_per_token
from distlm.model.moe import ExpertBalance
from distlm.optim import spec_for
from distlm.parallel.engine import make_engine, seed_for_rank
from distlm.tasks import build_task
from distlm.checkpoint import store as ckpt
from distlm.checkpoint.group import background_save_group
from distlm.train.compile_cache import first_step_report
from distlm.train.evaluation import evaluation_for
from distlm.train.faults import (StopFlag, TrainingStopped, Watchdog, checkpoint_schedule, nonfinite_guard,
                                 nonfinite_verdict, stop_reason)
from distlm.train.logger import Progress, ProgressBar, RunLogger, console_line
from distlm.train.metrics import SetupClock, memory_gb, mfu, mfu_basis, peak_tflops
from distlm.train.optim import build_optimizer, config_hyperparameters
from distlm.train.resolve import resolve_run
from distlm.train.resume_check import check_before_resume, check_resume_config
from distlm.train.run_context import run_context
from distlm.train.runlock import RunLock, claim_run_name, holds_no_run
from distlm.report.plot import NothingToPlot, PlotImport, plot_runs
from distlm.report.samples import console_block, describe as describe_samples
from distlm.train.schedule import lr_clock
from distlm.train.seq_schedule import SeqSchedule
from distlm.train.memory_check import check_memory
from distlm.train.setup import autocast_dtype, build_model


class Trainer:
    def __init__(self, cfg: Config, dims=None, run_dir: str | Path | None = None, name_prefix: str = "run"):
        clock = SetupClock()
        self.device = resolve_device(cfg.train.device, local_rank(os.environ))
        check_float8_on(cfg.train.fp8, self.device)  # before anything is made: a CPU or a pre-Ada GPU
        self.engine = make_engine(cfg.parallel.engine)
        if dims is None:
            dims = self.engine.init(cfg.parallel, self.device.type, lap=clock.lap)  # laps the process group
        else:
            clock.lap("device and process group")
        self.dims = dims
        self.comm = self.engine.comm(self.dims)
        # Background saves get a group of their own (distlm/checkpoint/group.py says why).
        self.background_save_group = (background_save_group(cfg.parallel.timeout_s)
                                      if cfg.train.async_checkpoint else None)
        # Apart from the process group: on GPUs each of the mesh's groups is an NCCL communicator
        # split off the world's at start-up (on 4 GPUs the two together took 4.6-6.0 s:
        # docs/results/time-to-loss.md).
        clock.lap("device mesh")
        self.task = build_task(cfg)
        # The config is resolved once, here, against the data, the device, the layout and the
        # optimizer, before anything is built, and frozen from then on: everything below reads
        # values (distlm/train/resolve.py), and config.yaml records what ran.
        resolved = resolve_run(cfg, self.device, self.dims, self.task, self.comm)
        if self.dims.is_main:
            for line in resolved.lines:
                print(line, flush=True)
        self.cfg, self.manifest, self.data_dir = resolved.cfg, resolved.manifest, resolved.data_dir
        self._log_line = resolved.log_line
        cfg = self.cfg
        self.compiled = bool(cfg.train.compile)  # a compiled run reports its compile cache
        # The schedule, from the optimizer's peak rate; with train.time_budget_s a time clock,
        # which agrees its elapsed time over the ranks, so every replica steps with the same rate.
        self.lr_clock = lr_clock(cfg.train, spec_for(cfg).peak_lr(cfg), self._agreed_seconds)
        clock.lap("config and data check")
        self.amp_dtype = autocast_dtype(cfg)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        check_memory(cfg, self.device, self.dims, self.comm)  # before the run folder exists
        clock.lap("memory check")  # on CUDA the first use of the GPU: the CUDA context starts here
        self.run_dir = Path(run_dir) if run_dir else self._run_dir(name_prefix)
        self.lock = RunLock(self.run_dir).acquire() if self.dims.is_main else None
        try:
            self._set_up_run(cfg, clock)
        except BaseException:
            # A start that stops here (a config error found by the model plan, a refused
            # resume, Ctrl-C) leaves no folder behind that would block the corrected command
            # under the same log.name; a folder with a run in it is left as it was.
            if self.lock is not None:
                self.lock.abandon()
            raise

    def _set_up_run(self, cfg: Config, clock: SetupClock) -> None:
        """Set-up from the locked run folder on: the model, optimizer, data, resume and run files."""
        # A checkpoint of another architecture or data is refused here, before the model is
        # built or any weight loaded (and before config.yaml is rewritten).
        check_before_resume(cfg, self.run_dir)
        seed_for_rank(cfg.train.seed, self.dims)
        clock.lap("run folder")
        # four laps: compiler import, model plan, weights, data-parallel wrap
        self.plan = build_model(cfg, self.dims, self.device, self.task, clock)
        # model: what the step calls (DDP-wrapped, sharded); module: the plain model inside it (a GPT or a
        # classifier), for its own methods and parameters
        self.model, self.module, self.stepper = self.plan.model, self.plan.module, self.plan.step
        # model.moe: the routing biases' update after each step, and the experts' load for the log.
        self.balance = ExpertBalance.of(self.module, cfg.model)
        if self.balance is not None:
            self.balance.attach()
        self.optimizer = build_optimizer(self.model, cfg, self.device.type)
        # train.on_nan: who decides whether a step with a NaN/Inf loss or gradient is taken, the
        # device (the optimizer's step takes a found_inf flag) or the host (distlm/train/faults.py).
        self.nan_guard = nonfinite_guard(cfg.train, spec_for(cfg).skips_on_device(self.optimizer), self.model,
                                         self._on_nonfinite)
        self.loader = self.task.build_loader(cfg, self.dims, self.device)
        self.seq_schedule = SeqSchedule.from_config(cfg)  # rows of each step (train.seq_warmup_steps)
        self.stepper.bind(self.task, cfg, self.plan, self.loader.accum_steps)
        self.evaluation = evaluation_for(cfg, self.plan, self.task)
        if cfg.train.compile and self.dims.is_main:
            print(f"evaluation: {self.evaluation.describe}", flush=True)
        clock.lap("optimizer and data loader")
        self.step = 0
        self.tokens_seen = 0
        self.best_val: Optional[float] = None
        self.best_ckpt: Optional[str] = None
        self.protected: list[str] = []  # the checkpoint pruning must keep: the last one before the latest fault
        self.nan_skips = 0
        self._pending: Optional[ckpt.PendingSave] = None
        # Checkpoints this run hashed (saved, resumed from, verified when pruning): unchanged,
        # they are not hashed again.
        self.verified = ckpt.VerifiedFiles()
        # Pinned host memory a synchronous save copies the state into, prepared after the first step
        # (when every optimizer state exists) while the run trains: checkpoint/staging.py says why.
        self.staging = ckpt.HostStaging() if self.device.type == "cuda" and not cfg.train.async_checkpoint else None
        self._last_saved_step: Optional[int] = None
        self._failed_save: Optional[tuple[int, str]] = None  # (step, cause) of the latest failed save
        self.flops_per_token = flops_per_token(cfg.model, self.stepper.num_params(self.module, cfg))
        self.peak = peak_tflops(self.device)  # None where the table does not name the device: MFU n/a
        self.resumed_from = self._maybe_resume()
        self.optimizer = self.engine.wrap_optimizer(self.optimizer, self.model, self.loader.accum_steps, cfg.parallel)
        self._write_run_files()
        clock.lap("resume and run files")
        # printed by train(); compilation comes later, in the first step
        self.setup_line = clock.line()

    # ---- set-up -------------------------------------------------------------------
    def _agreed_seconds(self, seconds: float) -> float:
        if not self.dims.is_distributed:
            return seconds
        return float(self.comm.max(torch.tensor([seconds], dtype=torch.float64, device=self.device))[0])

    def _run_dir(self, prefix: str) -> Path:
        name = self.cfg.log.name
        if not name:  # a new, timestamped run: rank 0 claims the folder, every rank uses it
            name = self.comm.broadcast_object(
                claim_run_name(Path(self.cfg.log.root), prefix) if self.dims.is_main else None)
        run_dir = Path(self.cfg.log.root) / name
        if run_dir.exists() and not holds_no_run(run_dir) and self.cfg.train.resume == "never":
            raise ConfigError(f"run directory {run_dir} already exists; pass train.resume=auto to continue it, "
                              f"or choose another log.name")
        if self.cfg.train.resume == "auto" and not self.cfg.log.name and self.dims.is_main:
            self._say_nothing_resumed(run_dir)
        self.comm.barrier()  # else rank 0 may create the folder before a slower rank has checked it
        return run_dir

    def _say_nothing_resumed(self, run_dir: Path) -> None:
        """resume=auto continues the run named by log.name; without one every start is a new,
        timestamped run, which would silently start from step 0. Said once, on stderr."""
        root = Path(self.cfg.log.root)
        runs = sorted((p for p in root.glob("*/checkpoints") if p.is_dir()), key=lambda p: p.stat().st_mtime,
                      reverse=True) if root.is_dir() else []
        names = ", ".join(p.parent.name for p in runs[:3])
        print(f"warning: train.resume=auto resumed nothing: no run name was given (log.name), so this is a new run, "
              f"{run_dir}, starting from step 0; to continue a run, pass its name: train.resume=auto log.name=NAME"
              + (f" (runs with checkpoints under {root}/: {names})" if names else ""), file=sys.stderr, flush=True)

    def _maybe_resume(self) -> Optional[Path]:
        # With resume=auto a damaged or non-finite newest checkpoint is skipped, with a message,
        # for the newest one that verifies and loads.
        with config_hyperparameters(self.optimizer):
            path, meta = ckpt.resume_and_load(self.cfg.train.resume, self.run_dir, self.model, self.optimizer,
                                              say=print if self.dims.is_main else lambda msg: None,
                                              memo=self.verified)
        if path is None:
            return None
        # Checked before loading for the newest checkpoint; again for the one loaded, which
        # may be an older one when the newest was damaged.
        check_resume_config(meta["config"], self.cfg, path)
        self.load_state_dict(meta["trainer"])
        if self.dims.is_main:
            print(f"resumed from {path} (step {self.step}, the newest checkpoint that verifies)")
        return path

    def _write_run_files(self) -> None:
        """config.yaml and what the task needs (tokenizer, labels), each written whole: a
        signal during start-up leaves a run folder that resumes, or nothing."""
        if not self.dims.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.yaml", to_yaml(self.cfg))
        self.task.write_run_files(self.run_dir)

    # ---- state --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                "best_val": self.best_val, "best_ckpt": self.best_ckpt, "protected": self.protected,
                "nan_skips": self.nan_skips, "lr_clock": self.lr_clock.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.loader.load_state_dict(state["loader"])
        self.best_val, self.best_ckpt = state.get("best_val"), state.get("best_ckpt")
        self.protected, self.nan_skips = list(state.get("protected", [])), int(state.get("nan_skips", 0))
        self.lr_clock.load_state_dict(state.get("lr_clock", {}))  # absent before the time clock existed

    # ---- the step -----------------------------------------------------------------
    def compute(self):
        """The context every forward and backward runs under: the plan's (autocast, attention
        backend, loss parallel: distlm/parallel/applied.py)."""
        return self.plan.compute()

    def train_step(self, mark=None, sync_grads: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over one global batch. Returns (mean loss, grad norm), on device.

        ``mark(phase)`` is called as each phase ends ("data", "forward_backward",
        "optimizer"); `distlm bench` times the phases with it, and runs a few steps with
        sync_grads=False (no gradient reduction at all) to measure exposed communication.
        A step whose loss or gradient is not finite is skipped or stops training (train.on_nan).
        """
        mark = mark or (lambda phase: None)
        lr = self.lr_clock.lr(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # self.step is the step being trained (it advances at the end): a resumed run cuts
        # the same rows at the same steps.
        micro = [self.seq_schedule.apply(self.step, x.to(self.device, non_blocking=True),
                                         y.to(self.device, non_blocking=True)) for x, y in self.loader.next()]
        mark("data")
        loss_mean = self.comm.mean(self.stepper.forward_backward(micro, self.compute, sync_grads))
        mark("forward_backward")
        # The next step's batch is made now, while the device runs this one: a host check of
        # the loss below (train.on_nan=stop) waits for the device, and host work after it would
        # leave the device idle.
        self.loader.prefetch()
        self.engine.finish_grad_reduction(self.optimizer)
        grad_norm = self.stepper.clip(self.cfg.train.grad_clip)
        # grad_norm is global (reduced over every rank) and the loss is the mean over them, so
        # every rank reaches the same verdict. Under the default (train.on_nan=skip) the device
        # decides and the Trainer reads the verdicts with the loss (read_faults); on_nan=stop
        # reads two numbers on the host first, one device sync per step.
        self.nan_guard.step(self.step + 1, loss_mean, grad_norm,
                            lambda found_inf: self.engine.optimizer_step(self.optimizer, found_inf))
        if self.balance is not None:
            self.balance.step()
        self.optimizer.zero_grad()  # set_to_none, the default since torch 2.0 (Horovod takes no argument)
        mark("optimizer")
        self.step += 1
        self.tokens_seen += self.cfg.train.global_batch_size * self.cfg.model.block_size
        return loss_mean, grad_norm

    def read_faults(self) -> None:
        """Read the verdicts of the steps since the last read (train.on_nan=skip decides them on
        the device): a warning for each step left out, TrainingStopped past train.max_nan_skips.
        Called where the loss is read anyway, and before anything is saved: a checkpoint never
        holds a skip count that was not read."""
        self.nan_guard.read()

    def _on_nonfinite(self, faults: list) -> None:
        """Steps left out for a NaN/Inf loss or gradient (distlm/train/faults.py: Fault), told at
        the step (a host check) or at the next read (decided on the device). No checkpoint is
        written between a fault and its read, so the newest one is from before the fault."""
        complete, _ = ckpt.list_checkpoints(self.run_dir / "checkpoints")
        if complete:
            # The last good state survives pruning: one checkpoint, the newest before the latest
            # fault (one per fault kept 6 checkpoints under keep_last=2).
            self.protected = [complete[-1].name]
        for fault in faults:
            self.nan_skips += 1
            warning = nonfinite_verdict(fault.step, fault.loss, fault.grad_norm, fault.bad_grads,
                                        complete[-1] if complete else None, self.nan_skips, self.cfg.train)
            if self.dims.is_main:
                print(warning, flush=True)

    def evaluate(self) -> float:
        # Which graphs, grad mode and train/eval mode: distlm/train/evaluation.py
        with self.evaluation(self.model):
            return self.task.evaluate(run_context(self))

    # ---- checkpoints --------------------------------------------------------------
    def save(self, val_loss: Optional[float] = None, lap=None) -> Optional[Path]:
        """A checkpoint of this step (collective). A write error stops training or, with
        train.on_save_error=continue, is reported and training goes on. ``lap``: a clock's lap,
        called at the end of each phase of the save (the end of a run times its own)."""
        self.read_faults()  # may stop training: then nothing is written
        root = self.run_dir / "checkpoints"
        if val_loss is not None and math.isfinite(val_loss) and (self.best_val is None or val_loss < self.best_val):
            self.best_val, self.best_ckpt = val_loss, f"step_{self.step:07d}"
        meta = {"trainer": self.state_dict(), "config": self.cfg.to_dict(), "world_size": self.dims.world_size,
                "val_loss": val_loss, "saved_at": time.time()}
        self.finish_pending_save()  # an earlier background save reports its own errors, with its own step

        def write(async_allowed: bool):
            return ckpt.save_checkpoint(root, self.step, self.model, self.optimizer, meta,
                                        async_save=self.cfg.train.async_checkpoint and async_allowed,
                                        memo=self.verified, background_group=self.background_save_group, lap=lap,
                                        staging=self.staging)

        try:
            saved = self.engine.save(self.dims, self.comm, write, skipped=lambda: root / f"step_{self.step:07d}")
        except ckpt.CheckpointSaveError as e:
            self._save_failed(self.step, e)
            return None
        self._last_saved_step = self.step
        if isinstance(saved, ckpt.PendingSave):
            self._pending = saved
            return saved.final
        self._prune()
        return saved

    def _save_failed(self, step: int, e: ckpt.CheckpointSaveError) -> None:
        self._failed_save = (step, e.cause)
        complete, _ = ckpt.list_checkpoints(self.run_dir / "checkpoints")
        msg = (f"cannot write checkpoint step_{step:07d} in {self.run_dir / 'checkpoints'}: {e.cause}; "
               f"{'the previous checkpoint ' + str(complete[-1]) + ' is intact' if complete else 'no earlier checkpoint'}")
        if self.cfg.train.on_save_error == "stop":
            raise TrainingStopped(msg + " (train.on_save_error=stop)") from None
        if self.dims.is_main:
            print(f"warning: {msg}; training goes on (train.on_save_error=continue)")

    def finish_pending_save(self) -> None:
        """Complete a background save (collective); only then does it count as a checkpoint."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.finish()
        except ckpt.CheckpointSaveError as e:
            self._save_failed(int(pending.meta["step"]), e)
            return
        self._prune()

    def _prune(self) -> None:
        if self.dims.is_main:
            root = self.run_dir / "checkpoints"
            keep = [root / self.best_ckpt] if self.best_ckpt else []
            protect = root / self.protected[-1] if self.protected else None
            ckpt.prune_checkpoints(root, self.cfg.train.keep_last, keep, memo=self.verified, protect=protect)

    # ---- the loop -----------------------------------------------------------------
    def train(self) -> dict:
        """The loop: step, log, evaluate, checkpoint; stops at max_steps, the time limit,
        or SIGTERM/SIGINT (after saving). The signal handlers stay until the final
        checkpoint is written, so a signal at any point still leaves a resumable run."""
        cfg, main = self.cfg, self.dims.is_main
        logger = RunLogger(self.run_dir, cfg, enabled=main, resume_step=self.step)
        start_step, t_start = self.step, time.perf_counter()
        # The nearer of the two clocks' ends: a stop (time_limit_s) or the schedule's (time_budget_s).
        ends = [s for s in (cfg.train.time_limit_s, cfg.train.time_budget_s) if s > 0]
        progress = Progress(cfg.train.max_steps, min(ends, default=0.0), start_step, t_start)
        bar = None
        # A progress bar only on a terminal: piped to a file, its redraws are thousands of lines.
        if main and cfg.log.progress and sys.stderr.isatty():
            bar = ProgressBar(progress.at(self.step, t_start))
        say = bar.write if bar is not None else print
        if main:
            say(f"run {self.run_dir} | {self.module.num_params(False) / 1e6:.2f}M params | device {self.device} "
                f"x{self.dims.world_size} | dtype {self.amp_dtype or torch.float32} | "
                f"{self.loader.accum_steps} micro-steps/step | FLOPs/token 6N+12LdT = {self.flops_per_token / 1e9:.4f} G"
                + (" (N: active parameters; MFU counts them)" if cfg.model.moe.enabled else "")
                + f" | {mfu_basis(self.device)}")
            say(self.setup_line)
            say(self._paths_line())
            say(checkpoint_schedule(cfg.train))
        stop, watchdog = StopFlag(), Watchdog(cfg.train.watchdog_s, self.dims.rank)
        self.lr_clock.start()
        self._window = (time.perf_counter(), self.step)  # (start time, start step) of the tokens/s window
        last_val, last_loss, do_eval, stopped, final = None, float("nan"), False, None, None
        end = plot_import = None  # the end of the run's clock, and the plot's import beside its save
        loss = grad_norm = None
        every = cfg.log.every  # resolved: a short run still draws a curve
        if main and self._log_line:
            say(self._log_line)
        logged = None  # the step of the newest row
        self.model.train()
        try:
            while not self.lr_clock.complete(self.step):
                for event in self.loader.epoch_events(self.step) + self.seq_schedule.events(self.step) if main else ():
                    say(event)  # a source starts repeating its data; the warm-up's rows grow
                loss, grad_norm = self.train_step()
                watchdog.arm(self.step)  # armed after the first step: compilation may take minutes
                first, last = self.step == start_step + 1, self.lr_clock.complete(self.step)
                if first and main and self.compiled:
                    say(first_step_report(time.perf_counter() - t_start))  # cold or warm, in the log
                if first and self.staging is not None:
                    self.staging.prepare(self.model, self.optimizer)
                status = progress.at(self.step, time.perf_counter(), finished=last)
                if bar is not None:
                    bar.show(status)
                do_eval = bool(cfg.train.eval_every) and self.step % cfg.train.eval_every == 0
                # The first step of a process gets a row whatever log.every is: a user sees the
                # run move (and its ETA) within one step, not after log.every of them.
                if first or self.step % every == 0 or last or do_eval:
                    last_loss, val = self._log_step(logger, say, loss, grad_norm, do_eval, t_start, status)
                    last_val, logged = (val if do_eval else last_val), self.step
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                    self.save(last_val if do_eval else None)
                stopped = stop_reason(stop, t_start, cfg.train, self.step, self.dims, self.comm, self.device)
                if stopped:
                    if main:
                        say(f"{stopped} at step {self.step}: saving a checkpoint and exiting")
                    break
            watchdog.disarm()
            if stopped and logged != self.step and loss is not None:
                # The step the run stopped at gets its row, whatever log.every is: a run stopped
                # early still leaves its last loss in metrics.csv, TensorBoard and the plot.
                # Its Status is the one the bar already shows for this step: one computed now would
                # give the row other elapsed/ETA figures than the bar under it on a loaded machine.
                last_loss, _ = self._log_step(logger, say, loss, grad_norm, False, t_start, status)
            if not stopped and start_step < self.step < cfg.train.max_steps and main:
                say(f"the learning-rate schedule ended at train.time_budget_s={cfg.train.time_budget_s:g}: "
                    f"step {self.step} of train.max_steps={cfg.train.max_steps}")
            # The end of a run is a fixed cost like its set-up: timed phase by phase and said in
            # one line.
            end = SetupClock()
            # The plot's library is imported beside the final checkpoint's write, which waits
            # on the disk without the GIL; not earlier: beside the gathering of the state, which
            # needs the GIL, the import only moved its seconds there (docs/results/time-to-loss.md).
            started = []

            def end_lap(name: str) -> None:
                end.lap(name)
                if main and name == "checkpoint state" and not started:
                    started.append(PlotImport())

            final = self._finish(logger, say, stopped, do_eval, last_val, ran=self.step > start_step, clock=end,
                                 lap=end_lap)
            plot_import = started[0] if started else None
            last_val = final["val_loss"]
        finally:
            watchdog.disarm()
            stop.restore()
            logger.close()
            if bar is not None:
                bar.close()
            if self.lock is not None:
                self.lock.release()
        if main:
            if end is not None:
                end.lap("logs closed")
            try:
                if plot_import is not None:
                    plot_import.join()
                plot_runs([self.run_dir], self.run_dir / "loss.png")
            except NothingToPlot:
                pass  # a run resumed at its end trained nothing and logged nothing: no empty frame
            if end is not None:
                end.lap("plot")
                say(end.line(label="end of run"))
        return {"step": self.step, "train_loss": last_loss, "val_loss": last_val, "stopped": stopped,
                "signal": stop.signal,  # the signal this process received (SIGTERM, SIGINT), if any
                "checkpoint": str(final["checkpoint"]) if final["checkpoint"] else None,
                "run_dir": str(self.run_dir), "val_on": self.task.describe_eval()}

    def _paths_line(self) -> str:
        """Where the run writes and what it reads, resolved: a relative log.root or data.dir
        names a folder under the directory the command was started in."""
        cfg = self.cfg
        line = f"paths: run folder {self.run_dir.resolve()} (log.root={cfg.log.root})"
        if cfg.data.mix:
            return line + f", data.mix={cfg.data.mix}"
        if self.data_dir is not None:
            return line + f", data {Path(self.data_dir).resolve()} (data.dir={cfg.data.dir})"
        return line + f", data.source={cfg.data.source}"

    def _finish(self, logger, say, stopped: Optional[str], evaluated: bool, last_val: Optional[float],
                ran: bool, clock: SetupClock, lap=None) -> dict:
        """The final checkpoint first, then the final evaluation: an evaluation that fails
        must not cost the last steps. A run resumed at its end trains nothing and logs nothing."""
        self.read_faults()  # the run's last steps, before its last checkpoint and evaluation
        ckpt_dir = self.run_dir / "checkpoints" / f"step_{self.step:07d}"
        # The last step may have been saved by checkpoint_every already: saving it again
        # would move a complete checkpoint aside for a moment, for nothing.
        final = ckpt_dir if self._last_saved_step == self.step or not ran else \
            self.save(last_val if evaluated else None, lap=lap or clock.lap)
        self.finish_pending_save()
        if ran and self._failed_save is not None and self._failed_save[0] == self.step:
            final = self._retry_final_save(last_val if evaluated else None)
        clock.lap("checkpoint pruning")
        if not ran:
            complete, _ = ckpt.list_checkpoints(self.run_dir / "checkpoints")
            if self.dims.is_main:
                where = (f"train.max_steps={self.cfg.train.max_steps}" if self.step >= self.cfg.train.max_steps
                         else f"the end of its schedule (step {self.step}, train.time_budget_s)")
                print(f"the run is already at {where}: nothing to train")
            saved_val = ckpt.read_meta(complete[-1]).get("val_loss") if complete else None
            return {"checkpoint": complete[-1] if complete else None,
                    "val_loss": float("nan") if saved_val is None else saved_val}
        if not stopped and not evaluated:
            last_val = self.evaluate()
            logger.log(self.step, {"tokens": self.tokens_seen, "val_loss": last_val,
                                   "val_ppl": math.exp(min(last_val, 50)), **self.task.eval_metrics()})
            if self.dims.is_main and math.isfinite(last_val):
                say(f"final val loss {last_val:.4f} on {self.task.describe_eval()}")
            if final is not None and self.dims.is_main and math.isfinite(last_val):
                self._record_val(final, last_val)
            clock.lap("final evaluation")
            self._samples(logger, say)
            clock.lap("samples")
        return {"checkpoint": final, "val_loss": last_val}

    def _retry_final_save(self, val_loss: Optional[float]) -> Path:
        """train.on_save_error=continue trains on past a failed save, but a run must not end on
        one, or it would end "done ... checkpoint None" with exit 0 and its last steps
        lost. The final checkpoint is tried once more; if that fails too, the run stops
        (exit 3) naming the newest step that can be resumed."""
        self._failed_save = None
        saved = self.save(val_loss)
        self.finish_pending_save()
        if self._failed_save is None:
            return saved
        complete, _ = ckpt.list_checkpoints(self.run_dir / "checkpoints")
        last = (f"the last step that can be resumed is {int(complete[-1].name[5:])} ({complete[-1]})" if complete
                else "no step can be resumed (no checkpoint was written)")
        raise TrainingStopped(f"the final checkpoint step_{self.step:07d} could not be written, twice "
                              f"({self._failed_save[1]}); {last}")

    def _record_val(self, folder: Path, val_loss: float) -> None:
        """The final checkpoint was written before its evaluation: add the loss to it, and
        keep it as the best when it is."""
        if self.best_val is None or val_loss < self.best_val:
            self.best_val, self.best_ckpt = val_loss, folder.name
        ckpt.update_meta(folder, memo=self.verified, val_loss=val_loss, trainer=self.state_dict())

    def _log_step(self, logger, say, loss, grad_norm, do_eval: bool, t_start: float,
                  status) -> tuple[float, Optional[float]]:
        cfg = self.cfg
        self.read_faults()  # the steps left out since the last row, warned about before it
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # time what ran, not what was queued
        t0, step0 = self._window
        dt = time.perf_counter() - t0
        tps = max(1, self.step - step0) * cfg.train.global_batch_size * cfg.model.block_size / dt
        row = {"tokens": self.tokens_seen, "loss": float(loss), "lr": self.optimizer.param_groups[0]["lr"],
               "grad_norm": float(grad_norm), "tokens_per_s": tps,
               "mfu": mfu(tps / self.dims.world_size, self.flops_per_token, self.peak),
               "mem_gb": memory_gb(self.device), "elapsed_s": time.perf_counter() - t_start}
        if self.balance is not None:
            row.update(self.balance.metrics())
        val = None
        if do_eval:
            val = self.evaluate()
            row.update(val_loss=val, val_ppl=math.exp(min(val, 50)), **self.task.eval_metrics())
        logger.log(self.step, row)
        if self.dims.is_main:
            measured_on = self.task.describe_eval()
            say(console_line(status, row) + (f" on {measured_on}" if do_eval and measured_on else ""))
        if do_eval:
            self._samples(logger, say)
        self._window = (time.perf_counter(), self.step)
        return row["loss"], val

    def _samples(self, logger, say) -> None:
        """log.samples continuations of log.sample_prompt, on the main rank, after an
        evaluation: printed, and logged to RUN/samples.txt and TensorBoard. The task decides
        whether there are any (a classifier, synthetic data or a sharded layout: none)."""
        if not self.dims.is_main:
            return
        try:
            texts = self.task.samples(run_context(self))
        finally:
            self.model.train()  # generation puts the model in eval mode
        if texts:
            prompt = self.cfg.log.sample_prompt
            say(console_block(self.step, prompt, texts))
            logger.samples(self.step, describe_samples(len(texts)), prompt, texts)


__all__ = ["Trainer", "TrainingStopped"]
