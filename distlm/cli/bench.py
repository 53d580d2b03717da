"""`distlm bench`: the timed training step, and its three other modes (--ceilings,
--scaling, --pp-sweep). The measuring lives in distlm/bench/; this is the command line."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from json import dumps
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence

from distlm.config import Config, ConfigError, load_config

Axis = Literal["dp_replicate", "dp_shard"]

# On a 2-core CPU `tiny` (1.3M parameters, 2k tokens per step) trains at ~10k tokens/s; a
# step's cost grows with both numbers, and gpt2-124m-1024's 25 steps would take hours.
CPU_MAX_PARAMS = 20_000_000
CPU_MAX_TOKENS_PER_STEP = 65_536


def bench(
    overrides: Sequence[str] = (), /, *,
    config: Optional[str] = None,
    warmup: Annotated[int, "untimed steps first (compilation, allocator, autotuning)"] = 5,
    steps: Annotated[int, "timed steps"] = 20,
    json: Annotated[Optional[str], "write the result as JSON to this file"] = None,
    results: Annotated[Optional[str], "append the result as a Markdown row to this file"] = None,
    no_comm_probe: Annotated[bool, "skip the window without gradient sync (exposed communication)"] = False,
    allow_cpu: Annotated[bool, "run a GPU-sized model on a CPU anyway"] = False,
    profile: Annotated[Optional[str], "also profile a few steps into this folder (torch profiler): device "
                                      "time by category, top kernels, how busy the host's threads were, a "
                                      "Chrome trace"] = None,
    memory_cap_gib: Annotated[float, "cap each process's GPU memory, e.g. 79 to check that a run fits an "
                                     "80 GB card; 0 = no cap"] = 0.0,
    scaling: Annotated[Optional[str], "e.g. 1,2,4: run at each world size (torchrun) and report scaling"] = None,
    axis: Annotated[Axis, "--scaling: DDP (dp_replicate) or FSDP2 (dp_shard)"] = "dp_replicate",
    mode: Annotated[Literal["weak", "strong"], "--scaling: keep the per-GPU or the global batch"] = "weak",
    out_dir: Annotated[str, "--scaling, --pp-sweep: where the table and plots go"] = "bench-scaling",
    pp_sweep: Annotated[Optional[str], "e.g. 1,2,4,8: under torchrun with parallel.pp>=2, step time and bubble "
                                       "of naive, GPipe and 1F1B against these microbatch counts"] = None,
    ceilings: Annotated[bool, "measure this device's matmul rate and memory bandwidth, then exit"] = False,
    device: Annotated[Literal["auto", "cpu", "cuda"], "--ceilings: which device"] = "auto",
) -> int:
    """Measure tokens/s, MFU, the step-time split and memory.

    W warm-up steps, then M timed steps of the real training step, with a progress line per
    step on stderr. MFU = tokens/s per GPU x (6N + 12*L*d*T) / peak dense bf16 FLOP/s.
    data.source=synthetic isolates model throughput from I/O. train.compile,
    train.compile_scope, model.loss_chunk and train.micro_batch_size default to auto: the
    fastest that fits this device and layout, printed as one `fast defaults` line; a value
    given on the command line is kept. The run folder (under
    runs/bench unless log.root says otherwise) is printed; JSON and Markdown are written
    only with --json / --results. On a CPU a GPU-sized model is refused (try --config tiny).
    """
    if ceilings:
        return _ceilings(device, json)
    if scaling:
        _refuse_gpu_sized_on_cpu(load_config(config, list(overrides)), allow_cpu)
        from distlm.bench.scaling import run_scaling
        text = run_scaling(_counts("--scaling", scaling), config, list(overrides), axis, mode, warmup, steps,
                           Path(out_dir), allow_cpu=allow_cpu)
        print(text + f"\nwrote {out_dir}/scaling-{mode}.md, .json and .png")
        return 0
    cfg = load_config(config, ["log.root=runs/bench", "log.progress=false", "log.tensorboard=false", *overrides])
    _refuse_gpu_sized_on_cpu(cfg, allow_cpu)
    main = os.environ.get("RANK", "0") == "0"
    if pp_sweep:
        return _pp_sweep(cfg, _counts("--pp-sweep", pp_sweep), warmup, steps, Path(out_dir), main)
    from distlm.bench.throughput import report, run_bench
    result = run_bench(cfg, warmup, steps, comm_probe=not no_comm_probe, profile_dir=Path(profile) if profile else None,
                       memory_cap_gib=memory_cap_gib, on_step=StepLines() if main else None)
    if main:
        report(result, Path(results) if results else None, Path(json) if json else None)
        print(f"run folder: {result['run_dir']}")
    return 0


class StepLines:
    """bench's progress on stderr: one line per step into a pipe or a file, one line
    rewritten in place on a terminal."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, phase: str, i: int, n: int) -> None:
        line = f"bench: {phase} step {i}/{n} ({time.perf_counter() - self.t0:.1f} s)"
        if self.tty:
            sys.stderr.write(f"\r{line}\033[K" + ("\n" if i == n else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _counts(flag: str, text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"{flag} {text}: expected positive integers separated by commas, e.g. 1,2,4")
    return counts


def _on_cpu(cfg: Config) -> bool:
    import torch
    return cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())


def _refuse_gpu_sized_on_cpu(cfg: Config, allow: bool) -> None:
    """A GPU-sized benchmark on a CPU runs for hours before printing a number: refuse it
    with what to do instead."""
    if allow or not _on_cpu(cfg):
        return
    from distlm.model.gpt import count_params
    model = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=50257)
    params = count_params(model, non_embedding=False)
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    if params > CPU_MAX_PARAMS or tokens > CPU_MAX_TOKENS_PER_STEP:
        raise ConfigError(f"this is a GPU-sized run ({params / 1e6:.0f}M params, {tokens:,} tokens per step) and "
                          f"there is no GPU here; on CPU try --config tiny, or pass --allow-cpu to run it anyway")


def _ceilings(device: str, json_out: Optional[str]) -> int:
    from distlm.bench.ceilings import measure, report
    from distlm.io import atomic_write_text
    from distlm.device import resolve_device
    r = measure(resolve_device(device))
    print(report(r))
    if json_out:
        atomic_write_text(json_out, dumps(r, indent=1))
    return 0


def _pp_sweep(cfg: Config, counts: list[int], warmup: int, steps: int, out_dir: Path, main: bool) -> int:
    from distlm.bench.pipeline import run_sweep, write_report
    if cfg.parallel.pp < 2:
        raise ConfigError("--pp-sweep needs parallel.pp >= 2 (launch with torchrun, one process per stage)")
    rows = run_sweep(cfg, counts, warmup, steps)
    if main:
        print(write_report(rows, out_dir) + f"\nwrote {out_dir}/pp-sweep.md, .json and .png")
    return 0
