"""`distlm bench`: W warm-up steps, then M timed steps of the real Trainer.

    distlm bench --config gpt2-124m-1024 data.source=synthetic
    torchrun --nproc_per_node 2 -m distlm bench --config gpt2-124m-1024 parallel.dp_replicate=2 ...

The Trainer resolves the auto settings (compile, its scope, loss chunking, micro-batch) for
the device and layout (distlm/train/fast_defaults.py) and prints them; the result records
the values that ran.

Timing synchronizes the device before every clock read. Phases (data wait,
forward+backward, optimizer) are timed with CUDA events on GPUs and the host clock on
CPUs. Exposed communication is measured, not guessed: a second timed window runs the
same steps with gradient reduction switched off; the difference in step time is the
communication that compute did not hide.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from distlm.bench.ceilings import flop_rate
from distlm.config import updated
from distlm.io import atomic_write_text
from distlm.train.metrics import device_name

# on_step(phase, i, n) after step i of n of a phase ("warm-up", "timed", "no-sync"): a CPU
# step of a real model takes seconds, and a silent benchmark looks hung.
OnStep = Optional[Callable[[str, int, int], None]]

FORMULA = "MFU = (tokens/s per GPU) x (6N + 12*L*d*T) / peak dense bf16 FLOP/s"


class PhaseTimer:
    """Accumulates time per phase between marks; device-synchronised."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = {}
        self._events: list[tuple[str, object, object]] = []

    def start(self):
        self._last = self._now()

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def mark(self, phase: str):
        now = self._now()
        self._events.append((phase, self._last, now))
        self._last = now

    def collect(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        for phase, a, b in self._events:
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            self.totals[phase] = self.totals.get(phase, 0.0) + dt
        self._events.clear()
        return self.totals


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_window(trainer, steps: int, sync_grads: bool, on_step: OnStep = None) -> tuple[float, dict]:
    timer = PhaseTimer(trainer.device)
    _sync(trainer.device)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        timer.start()
        trainer.train_step(mark=timer.mark, sync_grads=sync_grads)
        if on_step:
            on_step("timed" if sync_grads else "no-sync", i + 1, steps)
    _sync(trainer.device)
    wall = time.perf_counter() - t0
    return wall, {k: v / steps for k, v in timer.collect().items()}


def _max_over_ranks(value: float, device) -> float:
    # The slowest rank sets the pace of a synchronous step.
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def mesh_spread(dims) -> Optional[dict]:
    """For each mesh axis of size > 1: how many nodes its process groups span, at most (1 =
    every group stays inside a node). A node is a launcher: torchrun's GROUP_RANK. This is
    how a two-node run shows that HSDP reduce-scatters inside a node and all-reduces across."""
    import os
    if not dist.is_initialized() or dims.mesh is None:
        return None
    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)))
    mine = {}
    for axis in dims.mesh.mesh_dim_names:
        sub = dims.mesh[axis]
        if sub.size() > 1:
            ranks = dist.get_process_group_ranks(sub.get_group())
            mine[axis] = len({nodes[r] for r in ranks})
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"nodes": len(set(nodes)), "nodes_spanned": {axis: max(m[axis] for m in every) for axis in mine}}


def cap_memory(gib: float) -> None:
    """Let the caching allocator use at most ``gib`` GiB of this process's GPU, so a
    larger card can show whether a layout fits a smaller one (79 GiB: an 80 GB H100)."""
    import os
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)


def run_bench(cfg, warmup: int, steps: int, comm_probe: bool = True, profile_dir: Optional[Path] = None,
              memory_cap_gib: float = 0.0, on_step: OnStep = None) -> dict:
    from distlm.train.trainer import Trainer
    if memory_cap_gib and torch.cuda.is_available():
        cap_memory(memory_cap_gib)
    profile_steps = min(steps, 3) if profile_dir else 0
    cfg = updated(cfg, train={"eval_every": 0,  # the lr schedule must stay in range for every timed step
                              "max_steps": max(cfg.train.max_steps, warmup + 2 * steps + profile_steps + 1)})
    trainer = Trainer(cfg, name_prefix="bench")  # a new runs/bench/bench-TIMESTAMP unless log.name is given
    cfg = trainer.cfg  # resolved against the data
    dims, device = trainer.dims, trainer.device
    for i in range(warmup):
        trainer.train_step()
        if on_step:
            on_step("warm-up", i + 1, warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wall, phases = _timed_window(trainer, steps, sync_grads=True, on_step=on_step)
    wall = _max_over_ranks(wall, device)
    step_s = wall / steps
    exposed = None
    if comm_probe and dims.dp_size > 1:
        wall_nosync, _ = _timed_window(trainer, steps, sync_grads=False, on_step=on_step)
        exposed = max(0.0, step_s - _max_over_ranks(wall_nosync, device) / steps)
    prof = None
    if profile_dir:
        from distlm.bench.profile import profile_steps as run_profile
        rank = dist.get_rank() if dist.is_initialized() else 0
        title = (f"{cfg.model.n_layer}x{cfg.model.d_model} T={cfg.model.block_size}, batch "
                 f"{cfg.train.global_batch_size}/{cfg.train.micro_batch_size}, {device_name(device)} x{dims.world_size}"
                 f", rank {rank}")
        prof = run_profile(trainer, profile_steps, Path(profile_dir) / (f"rank{rank}" if dims.world_size > 1 else ""),
                           title)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.block_size
    tps = tokens_per_step / step_s
    per_gpu = tps / dims.world_size
    fpt = trainer.flops_per_token
    achieved = per_gpu * fpt / 1e12
    peak = trainer.peak
    compute = step_s - (exposed or 0.0)
    # What the planner predicts for this run (the estimate the auto micro-batch and the memory
    # check use, with the state optim.name declares), beside what the busiest rank measured:
    # benchmarks/suites/memory.py compares the two.
    from distlm.train.fast_defaults import Device, memory_estimate
    planned = memory_estimate(cfg, Device(device.type, 0.0), dims, cfg.train.micro_batch_size)
    result = {
        "device": device_name(device), "world_size": dims.world_size, "torch": torch.__version__,
        "layout": dims.degrees(),
        "model": {"n_layer": cfg.model.n_layer, "d_model": cfg.model.d_model, "block_size": cfg.model.block_size,
                  # a pipeline rank holds only part of the model: count the whole one
                  "params": trainer.stepper.num_params(trainer.module, cfg, non_embedding=False)},
        "global_batch_size": cfg.train.global_batch_size, "micro_batch_size": cfg.train.micro_batch_size,
        "accum_steps": trainer.loader.accum_steps, "compile": cfg.train.compile,
        "compile_scope": cfg.train.compile_scope, "loss_chunk": cfg.model.loss_chunk,
        "activation_checkpoint": cfg.parallel.activation_checkpoint, "dtype": str(trainer.amp_dtype or "fp32"),
        "warmup_steps": warmup, "timed_steps": steps,
        "step_s": step_s, "tokens_per_s": tps, "tokens_per_s_per_gpu": per_gpu,
        # classify: time per epoch and examples/s (its tokens/s counts rows padded to block_size)
        **trainer.task.bench_fields(step_s),
        "phases_s": phases, "exposed_comm_s": exposed,
        "compute_comm_ratio": (compute / exposed) if exposed else None,
        "flops_per_token": fpt, "achieved_tflops_per_gpu": achieved, "peak_tflops": peak,
        "mfu": achieved / peak if peak else None, "mfu_formula": FORMULA,
        # the busiest rank: pipeline stages and TP/FSDP ranks need not hold the same amount
        "peak_mem_gb": _max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30, device)
        if device.type == "cuda" else None,
        "optimizer": cfg.optim.name, "planned_mem_gb": planned.total_gb,
        "planned_mem_terms_gb": {"params": planned.params_gb, "grads": planned.grads_gb,
                                 "optimizer_state": planned.optim_gb, "fsdp_buffers": planned.buffers_gb,
                                 "activations": planned.activations_gb,
                                 "optimizer_step_temporaries": planned.step_temporaries_gb},
        "pp_schedule": cfg.parallel.pp_schedule if dims.pp > 1 else None,
        "mesh_spread": mesh_spread(dims),
        "pp_microbatches": trainer.stepper.n_microbatches,
        "date": time.strftime("%Y-%m-%d"), "memory_cap_gib": memory_cap_gib or None, "run_dir": str(trainer.run_dir),
        "profile": prof and {"dir": str(profile_dir), "categories_s": prof["categories_s"], "idle_s": prof["idle_s"],
                            "timeline_s": prof.get("timeline"), "host_busy_s": [t["busy_s"] for t in prof.get("host", [])]},
    }
    return result


def markdown_row(r: dict) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)
    tflops = r["achieved_tflops_per_gpu"]
    lay = r["layout"]
    layout = f"dpr{lay['dp_replicate']}·dps{lay['dp_shard']}·tp{lay['tp']}·pp{lay['pp']}"
    return (f"| {r['date']} | {r['device']} | {r['world_size']} | {layout} | {r['model']['params'] / 1e6:.0f}M "
            f"T={r['model']['block_size']} | {r['global_batch_size']}/{r['micro_batch_size']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{f(tflops, '.1f' if tflops >= 1 else '.3g')} | "
            f"{f(r['mfu'] and 100 * r['mfu'], '.1f')} | {f(r['peak_mem_gb'], '.1f')} | "
            f"{f(r['exposed_comm_s'] and 1e3 * r['exposed_comm_s'], '.1f')} | torch {r['torch']} |")


HEADER = ("| date | device | GPUs | layout | model | batch (global/micro) | tok/s | tok/s/GPU | TFLOP/s/GPU | "
          "MFU % | peak mem GiB | exposed comm ms | torch |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def report(r: dict, results: Optional[Path], json_out: Optional[Path]) -> None:
    """The result on stdout; the JSON file and a Markdown row only where asked."""
    ph = r["phases_s"]
    per = "device" if r["device"] == "cpu" else "GPU"
    print(f"{r['device']} x{r['world_size']}: {r['tokens_per_s']:,.0f} tok/s "
          f"({r['tokens_per_s_per_gpu']:,.0f}/{per}), step {1e3 * r['step_s']:.1f} ms = data "
          f"{1e3 * ph.get('data', 0):.1f} + fwd/bwd {1e3 * ph.get('forward_backward', 0):.1f} + optimizer "
          f"{1e3 * ph.get('optimizer', 0):.1f} ms")
    if "epoch_s" in r:
        print(f"classify: {r['examples_per_s']:,.0f} examples/s, {r['steps_per_epoch']} steps per epoch of "
              f"{r['train_examples']:,} examples: {r['epoch_s']:.2f} s per epoch")
    if r["exposed_comm_s"] is not None:
        print(f"exposed communication {1e3 * r['exposed_comm_s']:.1f} ms/step, compute/comm R = "
              f"{r['compute_comm_ratio'] or float('inf'):.1f}")
    mfu = "n/a (peak unknown for this device: no line for it in distlm/train/metrics.py PEAK_TFLOPS)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    peak = f"peak {r['peak_tflops']:g} TFLOP/s" if r["peak_tflops"] else "peak n/a"
    print(f"{flop_rate(r['achieved_tflops_per_gpu'])} per {per}, MFU {mfu}; {peak}; {FORMULA}")
    if r.get("profile"):
        split = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["profile"]["categories_s"].items())
        print(f"profile (ms per step): {split}, idle {1e3 * r['profile']['idle_s']:.1f}; "
              f"{r['profile']['dir']}/profile.md")
        t = r["profile"].get("timeline_s")
        if t:  # CUDA only: when the kernels ran, so overlap is seen
            print(f"timeline (ms per step, this rank's GPU): compute {1e3 * t['compute_s']:.1f}, "
                  f"communication hidden {1e3 * t['comm_hidden_s']:.1f}, exposed {1e3 * t['comm_exposed_s']:.1f}, "
                  f"no kernel {1e3 * t['idle_s']:.1f}")
        busy = r["profile"].get("host_busy_s")
        if busy:
            print(f"host (ms per step, profiled): the {len(busy)} busiest thread{'s' if len(busy) > 1 else ''} "
                  f"busy {' + '.join(f'{1e3 * b:.1f}' for b in busy)}")
    spread = r.get("mesh_spread")
    if spread and spread["nodes"] > 1:
        print(f"{spread['nodes']} nodes; the process groups of each mesh axis span at most: " + ", ".join(
            f"{axis} {n} node{'s' if n > 1 else ''}" for axis, n in spread["nodes_spanned"].items()))
    if r["peak_mem_gb"] is not None:
        print(f"peak memory {r['peak_mem_gb']:.2f} GiB per GPU (max over ranks)")
    if json_out:
        atomic_write_text(json_out, json.dumps(r, indent=1))
        print(f"wrote {json_out}")
    if results:
        results = Path(results)
        new = not results.exists()
        with open(results, "a") as f:
            f.write((HEADER if new else "") + markdown_row(r) + "\n")
        print(f"appended a row to {results}")
