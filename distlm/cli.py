"""`distlm <verb>`: each verb is a plain function; argparse only maps flags onto it.

    distlm prepare INPUT... --out DIR
    distlm train [--config FILE_OR_PRESET] [section.key=value ...]
    torchrun --nproc_per_node 4 -m distlm train parallel.dp_shard=4 ...
    distlm eval --checkpoint RUN_OR_CKPT
    distlm generate --checkpoint RUN_OR_CKPT --prompt TEXT
    distlm plot RUN... [--out loss.png]
    distlm demo
    distlm env [--json]                      (torchrun ... -m distlm env: every rank, one all-reduce)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from distlm.config import ConfigError, list_presets, load_config, updated

TRAIN_HELP = """\
Train a GPT. Settings come from the defaults, then --config (a YAML file or a preset
name), then dotted overrides such as model=gpt2-124m data.dir=DIR train.max_steps=200.
Presets: {presets}.

Metrics: tokens/s is global; MFU = tokens/s per device x FLOPs/token / peak, with
FLOPs/token = 6N + 12*L*d*T (N non-embedding params incl. the head, L layers, d width,
T context) and the peak dense bf16 TFLOP/s looked up by device name (H100 SXM 989,
H100 PCIe 756, H200 989, A100 312, ...) or set with log.peak_tflops. Unknown peak -> n/a.
"""


def cmd_prepare(args) -> int:
    if args.task == "classify":
        from distlm.tasks.classify.cli import cmd_prepare_classify
        return cmd_prepare_classify(args)
    from distlm.data.prepare import prepare
    m = prepare(args.inputs, Path(args.out), tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                seed=args.seed, workers=args.workers, separator=args.separator, text_field=args.text_field,
                progress=not args.quiet)
    splits = m["splits"]
    print(f"prepared {args.out}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} tokens, "
          f"tokenizer {m['tokenizer']['name']} (vocab {m['tokenizer']['vocab_size']})")
    return 0


def cmd_train(args) -> int:
    from distlm.train.trainer import Trainer
    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    summary = trainer.train()
    if trainer.dims.is_main and summary["stopped"]:
        print(f"stopped: {summary['stopped']}; checkpoint {summary['checkpoint']}; "
              f"continue with: distlm train ... log.name={trainer.run_dir.name} train.resume=auto")
    elif trainer.dims.is_main:
        print(f"done: step {summary['step']}, val loss {summary['val_loss']:.4f}, checkpoint {summary['checkpoint']}")
    _shutdown()
    return 0


def _shutdown():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def cmd_eval(args) -> int:
    from distlm.tasks.classify.cli import checkpoint_task, cmd_eval_classify
    if checkpoint_task(args.checkpoint) == "classify":  # accuracy, macro-F1, confusion matrix
        return cmd_eval_classify(args)
    import torch
    from distlm.data.loader import TokenBlocks, val_micro_batches
    from distlm.data.prepare import load_manifest
    from distlm.inference import load_model
    from distlm.model.loss import lm_loss
    from distlm.train.trainer import resolve_device
    device = resolve_device(args.device)
    model, cfg, folder = load_model(args.checkpoint, device)
    data_dir = Path(args.data or cfg.data.dir or "")
    manifest = load_manifest(data_dir)
    if int(manifest["tokenizer"]["vocab_size"]) > cfg.model.vocab_size:
        raise ConfigError(f"{data_dir}: vocabulary {manifest['tokenizer']['vocab_size']} does not fit the model's "
                          f"{cfg.model.vocab_size} (data and checkpoint use different tokenizers)")
    blocks = TokenBlocks(data_dir, args.split, cfg.model.block_size, manifest)
    batches = val_micro_batches(blocks, args.batches, cfg.train.micro_batch_size)
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            total += float(lm_loss(model(x.to(device)), y.to(device)))
    loss = total / len(batches)
    result = {"checkpoint": str(folder), "data": str(data_dir), "split": args.split, "loss": loss,
              "perplexity": math.exp(loss), "tokens": sum(x.numel() for x, _ in batches)}
    print(json.dumps(result) if args.json else
          f"{folder}: {args.split} loss {loss:.4f}, perplexity {math.exp(loss):.2f} over {result['tokens']:,} tokens")
    return 0


def cmd_generate(args) -> int:
    from distlm.inference import load_model, load_run_tokenizer
    from distlm.model.generate import SamplingConfig, generate_text
    from distlm.train.trainer import resolve_device
    device = resolve_device(args.device)
    model, cfg, folder = load_model(args.checkpoint, device)
    tok = load_run_tokenizer(folder, cfg)
    sc = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                        top_p=args.top_p, seed=args.seed)
    if args.prompts_file:
        return _generate_batch(model, tok, sc, args)
    if args.interactive:
        return _repl(model, tok, sc, args)
    if args.prompt is None:
        raise ConfigError("give --prompt TEXT, --prompts-file FILE --out F.jsonl, or --interactive")
    _print_samples(model, tok, sc, args.prompt, args.num_samples, stream=not args.no_stream)
    return 0


def _print_samples(model, tok, sc, prompt: str, n: int, stream: bool) -> list[str]:
    from distlm.model.generate import generate_text
    if stream and n == 1:
        sys.stdout.write(prompt)
        texts = generate_text(model, tok, prompt, sc, 1, on_token=lambda i, piece: (sys.stdout.write(piece),
                                                                                     sys.stdout.flush()))
        sys.stdout.write("\n")
        return texts
    texts = generate_text(model, tok, prompt, sc, n)
    for i, t in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{prompt}{t}")
    return texts


def _generate_batch(model, tok, sc, args) -> int:
    from distlm.model.generate import generate_text
    from distlm.train.checkpoint import atomic_write_text
    src = Path(args.prompts_file)
    if not src.is_file():
        raise ConfigError(f"--prompts-file {src}: no such file")
    prompts = [line.rstrip("\n") for line in src.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts-file {src}: no prompts in it")
    if not args.out:
        raise ConfigError("--prompts-file needs --out F.jsonl")
    lines = []
    for i, prompt in enumerate(prompts):
        texts = generate_text(model, tok, prompt, sc, args.num_samples)
        lines.append(json.dumps({"index": i, "prompt": prompt, "completions": texts, "seed": sc.seed}))
    atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts x {args.num_samples} samples to {args.out}")
    return 0


def _repl(model, tok, sc, args) -> int:
    print("interactive: type a prompt and press enter; an empty line or Ctrl-D quits")
    while True:
        try:
            prompt = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not prompt:
            return 0
        _print_samples(model, tok, sc, prompt, args.num_samples, stream=True)


def cmd_plot(args) -> int:
    from distlm.train.plot import plot_runs
    out = plot_runs([Path(r) for r in args.runs], Path(args.out))
    print(f"wrote {out}")
    return 0


def cmd_bench(args) -> int:
    if args.ceilings:
        from distlm.bench.ceilings import measure, report
        from distlm.train.checkpoint import atomic_write_text
        from distlm.train.setup import resolve_device
        r = measure(resolve_device(args.device))
        print(report(r))
        if args.json:
            atomic_write_text(Path(args.json), json.dumps(r, indent=1))
        return 0
    if args.scaling:
        from distlm.bench.scaling import run_scaling
        sizes = [int(x) for x in args.scaling.split(",")]
        text = run_scaling(sizes, args.config, args.overrides, args.axis, args.mode, args.warmup, args.steps,
                           Path(args.out_dir))
        print(text + f"\nwrote {args.out_dir}/scaling-{args.mode}.md, .json and .png")
        return 0
    from distlm.bench.throughput import report, run_bench
    overrides = ["log.root=runs/bench", "log.progress=false", "log.tensorboard=false", *args.overrides]
    cfg = load_config(args.config, overrides)
    if not cfg.log.name:
        import time
        cfg = updated(cfg, log={"name": time.strftime("bench-%Y%m%d-%H%M%S")})
    if args.pp_sweep:
        return _pp_sweep(cfg, args)
    result = run_bench(cfg, args.warmup, args.steps, comm_probe=not args.no_comm_probe,
                       profile_dir=Path(args.profile) if args.profile else None, memory_cap_gib=args.memory_cap_gib)
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        report(result, None if args.no_results else Path(args.results), args.json)
    _shutdown()
    return 0


def _pp_sweep(cfg, args) -> int:
    import torch.distributed as dist
    from distlm.bench.pipeline import run_sweep, write_report
    if cfg.parallel.pp < 2:
        raise ConfigError("--pp-sweep needs parallel.pp >= 2 (launch with torchrun, one process per stage)")
    rows = run_sweep(cfg, [int(x) for x in args.pp_sweep.split(",")], args.warmup, args.steps)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(write_report(rows, Path(args.out_dir)) + f"\nwrote {args.out_dir}/pp-sweep.md, .json and .png")
    _shutdown()
    return 0


def cmd_plan(args) -> int:
    from distlm.planner import explain, format_table, plan
    overrides = list(args.overrides)
    if args.seq:
        overrides.append(f"model.block_size={args.seq}")
    cfg = load_config(args.config, overrides)
    if cfg.model.vocab_size is None:
        cfg = updated(cfg, model={"vocab_size": 50257})  # GPT-2 BPE, what a preset trains on unless told otherwise
    gb = args.global_batch or cfg.train.global_batch_size
    mb = args.micro_batch or cfg.train.micro_batch_size
    ests = plan(cfg.model, args.gpus, args.gpu_mem_gb, gb, mb, peak_tflops=args.peak_tflops,
                link_gbs=args.link_gbs, compute_bytes=2 if args.dtype == "bf16" else 4)
    if not ests:
        raise ConfigError(f"no layout of {args.gpus} GPUs divides global batch {gb} into micro-batches of {mb}")
    print(f"{args.config or 'config'}: {cfg.model.n_layer} layers x {cfg.model.d_model}, T={cfg.model.block_size}, "
          f"global batch {gb}, micro-batch {mb}, {args.gpus} GPUs x {args.gpu_mem_gb:g} GiB")
    print(format_table(ests))
    fits = [e for e in ests if e.fits]
    if not fits:
        print(f"no layout fits in {args.gpu_mem_gb:g} GiB: lower train.micro_batch_size, or add GPUs")
        return 1
    print(explain(fits[0], ests, args.gpu_mem_gb))
    return 0


def cmd_demo(args) -> int:
    from distlm.demo import run_demo
    return run_demo(args)


def cmd_env(args) -> int:
    from distlm.launch.env import print_env
    return print_env(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distlm", description="Train GPT-style language models from scratch, "
                                "from one CPU to many GPUs (torch.distributed).")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    s = sub.add_parser("prepare", help="tokenize text into token shards + manifest",
                       description="Tokenize INPUT files (txt, folders, globs, jsonl, parquet, HF save_to_disk "
                       "folders, gzip, tar, or nanoGPT/llm.c train.bin+val.bin) into uint16/uint32 shards.")
    s.add_argument("inputs", nargs="+", metavar="INPUT")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--tokenizer", default="gpt2", help="gpt2 (default) or bpe:N to train an N-token byte-level BPE")
    s.add_argument("--val-fraction", type=float, default=0.05, help="fraction of documents held out (default 0.05)")
    s.add_argument("--seed", type=int, default=0, help="seed of the per-document split")
    s.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    s.add_argument("--separator", default=None, help="split files into documents on this string")
    s.add_argument("--text-field", default="text", help="text column of jsonl/parquet/arrow inputs")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    __import__("distlm.tasks.classify.cli", fromlist=["x"]).add_prepare_args(s)
    s.set_defaults(fn=cmd_prepare)

    s = sub.add_parser("train", help="train a model", description=TRAIN_HELP.format(presets=", ".join(list_presets())),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--config", default=None, help="YAML file or preset name")
    s.add_argument("overrides", nargs="*", metavar="section.key=value")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    s.add_argument("--checkpoint", required=True, metavar="RUN_OR_CKPT")
    s.add_argument("--data", default=None, help="data folder (default: the one the run trained on)")
    s.add_argument("--split", default="val", choices=["val", "train"])
    s.add_argument("--batches", type=int, default=50, help="micro-batches to average over")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(fn=cmd_eval)
    __import__("distlm.tasks.classify.cli", fromlist=["x"]).add_predict_parser(sub)

    s = sub.add_parser("generate", help="sample text from a checkpoint (KV cache)")
    s.add_argument("--checkpoint", required=True, metavar="RUN_OR_CKPT")
    s.add_argument("--prompt", default=None)
    s.add_argument("--max-new-tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=200, help="0 = off")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--prompts-file", default=None, help="one prompt per line; writes --out F.jsonl")
    s.add_argument("--out", default=None)
    s.add_argument("--interactive", action="store_true", help="a prompt loop")
    s.add_argument("--no-stream", action="store_true", help="print samples when complete")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("plot", help="draw loss curves of runs into one PNG")
    s.add_argument("runs", nargs="+", metavar="RUN")
    s.add_argument("--out", default="loss.png")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("bench", help="measure tokens/s, MFU, step-time split and memory (and scaling)",
                       description="W warm-up steps, then M timed steps of the real training step. "
                       "MFU = tokens/s per GPU x (6N + 12*L*d*T) / peak dense bf16 FLOP/s. "
                       "data.source=synthetic isolates model throughput from I/O.")
    s.add_argument("--config", default=None, help="YAML file or preset name")
    s.add_argument("overrides", nargs="*", metavar="section.key=value")
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--json", default=None, help="write the result as JSON here")
    s.add_argument("--results", default="bench-results.md", help="Markdown file a row is appended to")
    s.add_argument("--no-results", action="store_true", help="append no Markdown row")
    s.add_argument("--no-comm-probe", action="store_true", help="skip the no-gradient-sync window")
    s.add_argument("--scaling", default=None, metavar="1,2,4", help="run at each world size (torchrun) and report")
    s.add_argument("--axis", default="dp_replicate", choices=["dp_replicate", "dp_shard"],
                   help="--scaling: DDP (dp_replicate) or FSDP2 (dp_shard)")
    s.add_argument("--mode", default="weak", choices=["weak", "strong"], help="--scaling: keep per-GPU or global batch")
    s.add_argument("--out-dir", default="bench-scaling", help="--scaling/--pp-sweep: where the table and plots go")
    s.add_argument("--pp-sweep", default=None, metavar="1,2,4,8",
                   help="under torchrun with parallel.pp>=2: step time and bubble of naive, GPipe and 1F1B "
                   "against these microbatch counts")
    s.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile a few steps (torch profiler): device time by category, top kernels, "
                   "Chrome trace, in DIR")
    s.add_argument("--memory-cap-gib", type=float, default=0.0, metavar="GIB",
                   help="cap each process's GPU memory (e.g. 79 to check that a run fits an 80 GB card)")
    s.add_argument("--ceilings", action="store_true",
                   help="measure this device's matmul rate and memory bandwidth, then exit")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="--ceilings: which device")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("plan", help="memory and communication per GPU for every layout of N GPUs, ranked",
                       description="Estimate, for each (dp_replicate, dp_shard, tp, pp) layout with and without "
                       "activation checkpointing: parameters, gradients, AdamW state, FSDP buffers and activations "
                       "per GPU, and bytes communicated per step; then recommend one.")
    s.add_argument("--config", default=None, help="YAML file or preset name")
    s.add_argument("overrides", nargs="*", metavar="section.key=value")
    s.add_argument("--gpus", type=int, required=True)
    s.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GiB per GPU (an 80 GB H100 has 79.6)")
    s.add_argument("--seq", type=int, default=None, help="sequence length (default: model.block_size)")
    s.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the config's)")
    s.add_argument("--micro-batch", type=int, default=None, help="sequences per forward (default: the config's)")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="activation dtype (fp32 on CPU)")
    s.add_argument("--peak-tflops", type=float, default=989.0, help="for the time estimate (H100/H200 bf16 dense)")
    s.add_argument("--link-gbs", type=float, default=150.0, help="GB/s per GPU of the interconnect, for the estimate")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("demo", help="offline end-to-end demo on the vendored Gutenberg corpus (make run)")
    s.add_argument("--root", default="runs", help="where the run folder goes")
    s.add_argument("--data-root", default="data", help="where prepared data is cached")
    s.add_argument("--max-steps", type=int, default=None, help="override the demo's step count")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("env", help="versions, GPUs, backend, world size; under torchrun also one all-reduce")
    s.add_argument("--json", action="store_true", help="print JSON (all ranks' reports under torchrun)")
    s.set_defaults(fn=cmd_env)
    __import__("distlm.interop.hf", fromlist=["add_export_parser"]).add_export_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from distlm.data import DataError
    from distlm.train.checkpoint import CheckpointError
    from distlm.train.trainer import TrainingStopped
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `section.key=value` overrides may come on both sides of a flag (`--config X a=1 --steps 5 b=2`):
    # argparse binds only the first run of positionals, so the rest arrive here.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        _shutdown()
        return 2
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        _shutdown()
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
