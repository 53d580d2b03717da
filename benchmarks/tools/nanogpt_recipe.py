"""nanoGPT's own recipe, run from its checkout, timed and scored the way distlm's runs are.

    python benchmarks/tools/nanogpt_recipe.py export DATA OUT
    python benchmarks/tools/nanogpt_recipe.py run --nanogpt DIR --data OUT --run-dir RUN [--gpus N] [--cpu]

export: the train and val shards of a folder written by `distlm prepare` (GPT-2 tokens, uint16)
concatenated into nanoGPT's train.bin and val.bin under OUT (the shards are raw uint16 tokens,
as nanoGPT's files are). The time-to-loss suite does this when it prepares a corpus, so no run
pays for it.

run: nanoGPT's train.py with the recipe of ../shared/anchors/README.md (GPT-2 124M, 1024 context,
16 x 1024 tokens x 4 accumulation steps = 65,536 tokens a step, lr 6e-4 with 100 warm-up steps and
cosine to 6e-5 over 1,500 steps), under torchrun on N GPUs (nanoGPT divides the accumulation by N,
so the tokens per step stay). The checkout (an ignored folder such as carry/nanogpt) is run as it
is; nothing of it is copied into the project. Each line nanoGPT prints is stamped with the wall
time it arrived (RUN/nanogpt-log.txt). nanoGPT's own validation loss is an estimate over 20
random batches, so once it exits its final checkpoint is scored over the whole val split (every
non-overlapping 1024-token block, as distlm's evaluation with train.eval_batches=0 takes them),
with its own model code, and the runs are written as distlm writes them:

    RUN/metrics.csv   step, wall_time, tokens, loss, val_loss, val_loss_estimate, tokens_per_s, mfu:
                      a row per logged iteration; the final evaluation's row carries the whole-val
                      loss, at the time nanoGPT printed its final (estimated) loss
    RUN/result.json   the final losses (whole val and nanoGPT's estimate), its time, tokens, the
                      time to the first logged iteration (start-up with compilation) and the
                      steady tokens/s

so benchmarks/tools/speedrun_report.py reads a nanoGPT run like any other. --cpu runs a tiny
model for 4 iterations on the CPU (plumbing only).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# ../shared/anchors/README.md: nanoGPT's recipe used as the baseline.
RECIPE = ["--batch_size=16", "--gradient_accumulation_steps=4", "--max_iters=1500", "--lr_decay_iters=1500",
          "--warmup_iters=100", "--learning_rate=6e-4", "--min_lr=6e-5", "--eval_interval=100", "--eval_iters=20",
          "--log_interval=50", "--always_save_checkpoint=False", "--wandb_log=False"]
# --cpu: after the recipe's, so they win (nanoGPT's configurator applies its arguments in order).
CPU = ["--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=2", "--n_head=2", "--n_embd=64",
       "--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=1", "--max_iters=4", "--lr_decay_iters=4",
       "--warmup_iters=1", "--eval_interval=2", "--eval_iters=2", "--log_interval=1", "--backend=gloo"]

ITER = re.compile(r"iter (\d+): loss ([0-9.]+), time ([0-9.]+)ms")
EVAL = re.compile(r"step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")
TOKENS = re.compile(r"tokens per iteration will be: ([0-9,]+)")


def export(data: Path, out: Path) -> dict:
    manifest = json.loads((data / "manifest.json").read_text())
    if np.dtype(manifest["dtype"]) != np.uint16:
        raise SystemExit(f"error: {data}/manifest.json: dtype {manifest['dtype']}; nanoGPT reads uint16 tokens")
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "val"):
        tmp = out / f"{split}.bin.tmp"
        with open(tmp, "wb") as fh:
            for shard in manifest["splits"][split]["shards"]:
                fh.write((data / shard["file"]).read_bytes())
        os.replace(tmp, out / f"{split}.bin")
        counts[split] = sum(s["tokens"] for s in manifest["splits"][split]["shards"])
    print(f"wrote {out}/train.bin ({counts['train']:,} tokens) and val.bin ({counts['val']:,})")
    return counts


def whole_val_loss(nanogpt: Path, ckpt: Path, val_bin: Path, device: str, batch: int = 16,
                   max_blocks: int = 0) -> tuple[float, int, int]:
    """(mean loss, blocks, the checkpoint's iteration) of nanoGPT's checkpoint over every non-overlapping block of val.bin
    (the first ``max_blocks`` when it is not 0), with nanoGPT's model code. The checkpoint is
    read with weights_only (tensors and plain values: nothing it holds is run)."""
    import torch
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's, from its checkout
    ck = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**ck["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
    model.to(device).eval()
    T = model.config.block_size
    val = np.memmap(val_bin, dtype=np.uint16, mode="r")
    n = (len(val) - 1) // T
    n = min(n, max_blocks) if max_blocks else n
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu",
                                                                                                      enabled=False)
    total = 0.0
    with torch.no_grad(), amp:
        for start in range(0, n, batch):
            ids = range(start, min(n, start + batch))
            x = torch.from_numpy(np.stack([val[i * T:(i + 1) * T] for i in ids]).astype(np.int64)).to(device)
            y = torch.from_numpy(np.stack([val[i * T + 1:(i + 1) * T + 1] for i in ids]).astype(np.int64)).to(device)
            _, loss = model(x, y)
            total += float(loss) * len(ids)
    return total / n, n, int(ck["iter_num"])


def run(args) -> int:
    nanogpt, run_dir = Path(args.nanogpt).resolve(), Path(args.run_dir).resolve()
    data = Path(args.data).resolve()
    for need in (nanogpt / "train.py", data / "train.bin", data / "val.bin"):
        if not need.is_file():
            print(f"error: {need}: not found", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    train = ["train.py", "config/train_gpt2.py", f"--dataset={data}", f"--out_dir={run_dir / 'out'}", *RECIPE,
             *(CPU if args.cpu else [])]
    python = args.python
    argv = [python, *train] if args.gpus <= 1 else [python, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={args.gpus}", *train]
    print("nanoGPT:", " ".join(argv), flush=True)
    stamped: list[tuple[float, str]] = []
    with open(run_dir / "nanogpt-log.txt", "w") as log:
        # nanoGPT imports its model.py from the script's folder, which PYTHONSAFEPATH (set by
        # benchmarks/run.py for distlm's sake) would leave off sys.path.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
        proc = subprocess.Popen(argv, cwd=nanogpt, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**env, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            now = time.time()
            stamped.append((now, line.rstrip("\n")))
            log.write(f"{now:.3f} {line}")
            print(line, end="", flush=True)
        rc = proc.wait()
    if rc:
        print(f"nanoGPT exited with {rc}", file=sys.stderr)
        return rc
    tokens_per_iter = next((int(m.group(1).replace(",", "")) for _, l in stamped if (m := TOKENS.search(l))), None)
    iters = [(t, int(m.group(1)), float(m.group(2)), float(m.group(3))) for t, l in stamped if (m := ITER.search(l))]
    evals = [(t, int(m.group(1)), float(m.group(3))) for t, l in stamped if (m := EVAL.search(l))]
    if not (tokens_per_iter and iters and evals):
        print("error: nanoGPT's log has no iterations or evaluations to read", file=sys.stderr)
        return 1
    device = "cpu" if args.cpu else "cuda"
    loss, blocks, saved = whole_val_loss(nanogpt, run_dir / "out" / "ckpt.pt", data / "val.bin", device,
                                         max_blocks=args.val_blocks)
    # nanoGPT saves only an evaluation that improved on the best so far: the checkpoint scored is
    # that of its last improving evaluation, normally the final one.
    final_t, final_step, final_est = next(e for e in reversed(evals) if e[1] == saved)
    if saved != evals[-1][1]:
        print(f"note: nanoGPT's last checkpoint is from step {saved}, not its final step {evals[-1][1]} "
              f"(its later evaluations did not improve)")
    # nanoGPT takes one more step after its final evaluation (iteration max_iters); its
    # checkpoint and final loss are from before it, so that step is not counted.
    iters = [i for i in iters if i[1] < final_step]
    rows = [{"step": it + 1, "wall_time": f"{t:.3f}", "tokens": (it + 1) * tokens_per_iter, "loss": l,
             "val_loss": "", "val_loss_estimate": "", "tokens_per_s": f"{tokens_per_iter / (ms / 1000):.1f}",
             "mfu": ""} for t, it, l, ms in iters]
    rows += [{"step": s, "wall_time": f"{t:.3f}", "tokens": s * tokens_per_iter, "loss": "",
              "val_loss": f"{loss:.6f}" if s == final_step else "", "val_loss_estimate": est, "tokens_per_s": "",
              "mfu": ""} for t, s, est in evals if s > 0]
    rows.sort(key=lambda r: float(r["wall_time"]))
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    steady = sorted(tokens_per_iter / (ms / 1000) for _, _, _, ms in iters[1:]) or [0.0]
    launch = float(Path(args.launch_time).read_text()) if args.launch_time else stamped[0][0]
    result = {"recipe": "nanoGPT", "gpus": args.gpus, "final_val_loss": loss, "val_blocks": blocks,
              "final_val_loss_estimate": final_est, "final_step": final_step, "tokens": final_step * tokens_per_iter,
              "s_to_final": final_t - launch, "startup_s": iters[0][0] - launch,
              "steady_tok_s": steady[len(steady) // 2]}
    (run_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.result:
        Path(args.result).write_text(json.dumps(result, indent=1) + "\n")
    print(f"nanoGPT: final loss {loss:.4f} over the whole val split ({blocks} blocks; its own estimate "
          f"{final_est:.4f}), {result['s_to_final']:.1f} s from launch, {result['tokens'] / 1e6:.1f}M tokens")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanogpt_recipe.py", description=__doc__.strip().splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    e = sub.add_parser("export", help="a prepared folder's shards as nanoGPT's train.bin and val.bin")
    e.add_argument("data")
    e.add_argument("out")
    r = sub.add_parser("run", help="nanoGPT's recipe, timed, then scored over the whole val split")
    r.add_argument("--nanogpt", required=True, help="nanoGPT's checkout (an ignored folder, e.g. carry/nanogpt)")
    r.add_argument("--data", required=True, help="a folder holding train.bin and val.bin (export's OUT)")
    r.add_argument("--run-dir", required=True, help="where metrics.csv, result.json and nanoGPT's output go")
    r.add_argument("--gpus", type=int, default=1)
    r.add_argument("--python", default=sys.executable)
    r.add_argument("--launch-time", help="a file holding the launch's unix time (default: nanoGPT's first line)")
    r.add_argument("--result", help="also write result.json here")
    r.add_argument("--cpu", action="store_true", help="a tiny model for 4 iterations on the CPU")
    r.add_argument("--val-blocks", type=int, default=0, help="score the first N val blocks only (0 = all: what a "
                                                              "figure needs; N is for plumbing checks)")
    args = p.parse_args(argv)
    if args.verb == "export":
        export(Path(args.data), Path(args.out))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
