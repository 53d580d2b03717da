"""Where the seconds of a run's final checkpoint go, against what the disk can do.

    python benchmarks/tools/final_save.py [--config speedrun-124m] [--dir DIR] [--repeat 2] [--json OUT]
                                          [-- OVERRIDES]

Builds the preset's model and optimizer on the GPU as one process does (one optimizer step, so
every state tensor exists), then, into DIR (default: a folder under ./runs, the disk a run writes
to), each of these REPEAT times, in turn:

- ``disk``: the checkpoint's byte count written from host memory as 1 and as 8 files on as many
  threads, each file fsynced: what the disk takes;
- ``to host``: the state dict copied to host memory (pageable, then pinned);
- ``dcp N``: ``dcp.save`` of the device state with N writer threads, then an fsync of every file;
- ``dcp host 8``: the same from the host copy;
- ``save_checkpoint``: distlm's own save from the device state, with its phases;
- ``staging``: a ``checkpoint.staging.HostStaging`` prepared (its pinned buffers allocated, as a run does on a
  thread after its first step), then ``save_checkpoint, staged``: the save a run's end makes with it.

Prints one line per measurement and writes them as JSON. The question it answers: is the end of a
run's write the disk's time, or the copying and serialising in front of it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build(config: str, overrides: list[str], device: torch.device):
    from distlm.config import load_config, updated
    from distlm.model.gpt import GPT
    from distlm.train.optim import build_optimizer
    cfg = load_config(config, overrides)
    if cfg.model.vocab_size is None:
        cfg = updated(cfg, model={"vocab_size": 50257})
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    opt = build_optimizer(model, cfg, device.type)
    for prm in model.parameters():
        prm.grad = torch.randn_like(prm) * 1e-3
    opt.step()
    opt.zero_grad()
    return model, opt


def fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def disk(folder: Path, nbytes: int, files: int) -> float:
    """Seconds to write nbytes from host memory as `files` files on as many threads, fsynced."""
    folder.mkdir(parents=True, exist_ok=True)
    each = nbytes // files
    chunk = bytes(64 << 20)

    def one(i: int) -> None:
        left = each
        with open(folder / f"part{i}", "wb") as f:
            while left > 0:
                n = min(left, len(chunk))
                f.write(memoryview(chunk)[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(files)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="speedrun-124m")
    p.add_argument("--dir", default="runs/final-save")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from distlm.checkpoint import store

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt = build(args.config, overrides, device)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    rows: list[dict] = []

    def record(name: str, seconds: float, nbytes: int = 0, **extra) -> None:
        row = {"what": name, "s": round(seconds, 3), **extra}
        if nbytes:
            row["GB/s"] = round(nbytes / seconds / 1e9, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"config": args.config, "tensors": len(tensors), "GB": round(nbytes / 1e9, 3),
                      "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "write_threads": store.write_threads()}), flush=True)
    for r in range(args.repeat):
        for files in (1, 8):
            record(f"disk {files}", disk(root / f"disk{r}-{files}", nbytes, files), nbytes)
        _sync(device)
        t = time.perf_counter()
        host = _map(state, lambda x: x.cpu())
        record("to host, pageable", time.perf_counter() - t, nbytes)
        t = time.perf_counter()
        pinned = _map(state, lambda x: torch.empty_like(x, device="cpu", pin_memory=True).copy_(x, non_blocking=True)
                      if x.is_cuda else x)
        _sync(device)
        record("to host, pinned", time.perf_counter() - t, nbytes)
        del pinned
        for threads in (1, 8, 16):
            out = root / f"dcp{r}-{threads}"
            t = time.perf_counter()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), thread_count=threads))
            mid = time.perf_counter()
            fsync_tree(out)
            record(f"dcp {threads}", time.perf_counter() - t, nbytes, fsync_s=round(time.perf_counter() - mid, 3))
        out = root / f"dcphost{r}"
        t = time.perf_counter()
        dcp.save(host, storage_writer=dcp.FileSystemWriter(str(out), thread_count=8))
        fsync_tree(out)
        record("dcp host 8", time.perf_counter() - t, nbytes)
        del host
        laps: dict = {}
        last = [time.perf_counter()]

        def lap(name: str) -> None:
            now = time.perf_counter()
            laps[name] = round(now - last[0], 3)
            last[0] = now

        t = last[0] = time.perf_counter()
        store.save_checkpoint(root / f"ckpt{r}", r + 1, model, opt, {"step": r + 1}, lap=lap)
        record("save_checkpoint", time.perf_counter() - t, nbytes, phases=dict(laps))
        try:
            from distlm.checkpoint.staging import HostStaging as staging
        except ImportError:  # a copy of distlm from before it
            staging = None
        if staging is not None:
            staging = staging()
            t = time.perf_counter()
            if staging.prepare(model, opt):
                staging._thread.join()
                record("staging", time.perf_counter() - t, nbytes)
                laps.clear()
                t = last[0] = time.perf_counter()
                store.save_checkpoint(root / f"staged{r}", r + 1, model, opt, {"step": r + 1}, lap=lap, staging=staging)
                record("save_checkpoint, staged", time.perf_counter() - t, nbytes, phases=dict(laps))
            del staging
        for d in list(root.iterdir()):
            shutil.rmtree(d, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _map(obj, fn):
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return fn(obj) if isinstance(obj, torch.Tensor) else obj


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(main())
