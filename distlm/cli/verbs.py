"""The verbs that each fit in a screen: prepare, train, eval, predict, plot, plan, export, env.

generate and bench, which have modes, live in generate.py and bench.py, demo in demo.py,
and a classifier's eval and predict in classify.py. Every verb imports the library it runs
in its body: those packages import torch, which building the parser must not (`distlm --help`
would take seconds).
"""
from __future__ import annotations

import json as jsonlib
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence

from distlm.config import ConfigError, load_config, to_yaml, updated

Device = Literal["auto", "cpu", "cuda"]


def check_device_flag(device: str) -> None:
    """--device cuda where there is no CUDA, refused in the words of the flag the user wrote
    (the Trainer's own check speaks of train.device, a config field these verbs do not have)."""
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available on this machine (use --device auto or cpu)")


def prepare(
    inputs: Annotated[Sequence[str], "files, folders or globs: .txt, .jsonl, .parquet, HF save_to_disk folders, "
                                     ".gz, .tar, or nanoGPT/llm.c train.bin+val.bin"] = (),
    /, *,
    out: Annotated[str, "output folder"],
    tokenizer: Annotated[str, "gpt2, or bpe:N to train an N-token byte-level BPE on the inputs"] = "gpt2",
    val_fraction: Annotated[float, "fraction of documents held out"] = 0.05,
    seed: Annotated[int, "seed of the per-document split"] = 0,
    workers: Annotated[Optional[int], "tokenizer processes (default: all cores)"] = None,
    separator: Annotated[Optional[str], "split files into documents on this string"] = None,
    text_field: Annotated[str, "text column of jsonl/parquet/arrow inputs"] = "text",
    quiet: Annotated[bool, "no progress bar"] = False,
    task: Annotated[Literal["lm", "classify"], "classify: labelled rows -> padded token arrays + label map"] = "lm",
    label_field: Annotated[str, "classify: the label column"] = "label",
    max_len: Annotated[int, "classify: tokens kept per text (truncate, then pad)"] = 128,
    val_input: Annotated[Optional[str], "classify: a file with the held-out rows"] = None,
    split_field: Annotated[str, "classify: a column saying train or val/test, used when the data has it"] = "split",
    shard: Annotated[Optional[str], "I/N: prepare only part I (0..N-1) of the inputs, about 1/N of their bytes "
                                    "(big files are cut), for --merge; a part that would be empty is refused"] = None,
    merge: Annotated[Sequence[str], "PART_DIR...: join the parts made with --shard I/N into --out"] = (),
) -> int:
    """Tokenize text into token shards and a manifest.

    INPUTs become uint16/uint32 shards (train_*.bin, val_*.bin) and manifest.json, split per
    document by a hash and --seed. A re-run with the same inputs and options is a no-op; a
    killed run resumes from the input files it had finished.
    --shard I/N on N machines, then --merge PART_DIR... --out DIR, gives the same folder as one run.
    --task classify reads labelled rows (csv, tsv, jsonl, parquet) instead.
    """
    from distlm.data import DataError
    if merge and (inputs or shard or task != "lm"):
        raise DataError("--merge takes only the part folders and --out: no INPUT, --shard or --task")
    if merge:
        from distlm.corpus.prepare import merge as merge_parts
        m = merge_parts(list(merge), Path(out), progress=not quiet)
        splits = m["splits"]
        print(f"merged {len(merge)} parts into {out}: train {splits['train']['tokens']:,} tokens, "
              f"val {splits['val']['tokens']:,} tokens")
        return 0
    if task == "classify" and shard:
        raise DataError("--shard applies to --task lm")
    if task == "classify":
        from distlm.tasks.classify.data import prepare_classify
        prepare_classify(list(inputs), Path(out), text_field=text_field, label_field=label_field, max_len=max_len,
                         val_input=val_input, split_field=split_field or None, val_fraction=val_fraction, seed=seed,
                         tokenizer=tokenizer)
        return 0
    from distlm.corpus.prepare import prepare as prepare_tokens
    m = prepare_tokens(list(inputs), Path(out), tokenizer=tokenizer, val_fraction=val_fraction, seed=seed,
                       workers=workers, separator=separator, text_field=text_field, progress=not quiet, shard=shard)
    splits = m["splits"]
    part = f" (part {shard}; join the parts with --merge)" if shard else ""
    print(f"prepared {out}{part}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} tokens, "
          f"tokenizer {m['tokenizer']['name']} (vocab {m['tokenizer']['vocab_size']})")
    return 0


def train(
    overrides: Sequence[str] = (), /, *,
    config: Optional[str] = None,
    print_config: Annotated[bool, "print the resolved config as YAML and exit without training"] = False,
    nproc_per_node: Annotated[int, "processes on this machine, started by torchrun's own entry point (one per "
                                   "GPU): the same as torchrun --standalone --nproc_per_node N -m distlm train"] = 1,
) -> int:
    """Train a model (a language model, or a classifier with task=classify).

    Settings come from the defaults, then --config (a YAML file or a preset name), then
    dotted overrides such as model=gpt2-124m data.dir=DIR train.max_steps=200. Settings
    are config fields, not flags: train.max_steps=5, optim.adamw.lr=3e-4, train.seed=1.

    Metrics: tokens/s is global; MFU = tokens/s per device x FLOPs/token / peak, with
    FLOPs/token = 6N + 12*L*d*T (N non-embedding params incl. the head, L layers, d width,
    T context) and the peak dense bf16 TFLOP/s looked up by device name (H100 SXM 989,
    H100 PCIe 756, H200 989, A100 312, ...); a device the table does not name -> n/a.
    """
    notes: list[str] = []  # what a preset's data_parallel table set for this run's degree
    cfg = load_config(config, list(overrides), notes=notes)
    if notes and nproc_per_node == 1 and os.environ.get("RANK", "0") == "0" and not print_config:
        print("\n".join(notes), flush=True)
    if print_config:
        if os.environ.get("RANK", "0") == "0":
            print(to_yaml(cfg), end="")
        return 0
    if cfg.init.from_hf and cfg.task.name == "lm":
        from distlm.interop.hf_load import from_hf_settings
        said = from_hf_settings(cfg.model, cfg.init.from_hf, _model_fields_given(config, overrides),
                                resume=cfg.train.resume != "never")
        if nproc_per_node == 1 and os.environ.get("RANK", "0") == "0":
            print(said, flush=True)
    if nproc_per_node != 1:
        return _launch_train(cfg, nproc_per_node, config, overrides)
    from distlm.train.trainer import Trainer
    trainer = Trainer(cfg)
    summary = trainer.train()
    if trainer.dims.is_main and summary["stopped"]:
        print(f"stopped: {summary['stopped']}; checkpoint {summary['checkpoint']}; "
              f"continue with: distlm train ... log.name={trainer.run_dir.name} train.resume=auto")
    elif trainer.dims.is_main:
        val, on = summary["val_loss"], summary.get("val_on")
        # A run with no validation split (synthetic tokens) has no loss to report, not a NaN one;
        # a NaN from a validation that ran (a diverged model) is printed as it is.
        scored = f"val loss {val:.4f}" + (f" on {on}" if on else "") if on or (val is not None and val == val) \
            else "no validation (no val split to score)"
        print(f"done: step {summary['step']}, {scored}, checkpoint {summary['checkpoint']}")
    if summary.get("signal"):
        # Saved and stopped, but not finished: the shell's status for a process the signal
        # ended, so that a script or CI tells an interrupted run from a finished one.
        import signal
        return 128 + int(signal.Signals[summary["signal"]])
    return 0


def _model_fields_given(config: Optional[str], overrides: Sequence[str]) -> set[str]:
    """The model.* fields the --config file (or preset) and the overrides set: a user's
    settings, as opposed to the defaults."""
    from distlm.config import _preset_path, _read_yaml
    given: set[str] = set()

    def take(model) -> None:
        if isinstance(model, str):  # model: PRESET, a preset's architecture
            model = _read_yaml(_preset_path(model)).get("model") or {}
        if isinstance(model, dict):
            given.update(model)

    if config:
        take(_read_yaml(_preset_path(config)).get("model"))
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model":
            take(value)
        elif key.startswith("model."):
            given.add(key[len("model."):])
    return given


def _launch_train(cfg, nproc: int, config: Optional[str], overrides: Sequence[str]) -> int:
    """`distlm train --nproc-per-node N`: the same command, without the flag, in N ranks that
    torchrun's entry point starts from this process (distlm/launch/local.py says why). What
    the ranks would refuse without a GPU (the layout, the batch on N processes) is refused
    here, before any is started."""
    from distlm.launch.local import check_before_launch, launch, under_launcher
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc}: expected a number of processes, 1 or more")
    if under_launcher():
        raise ConfigError("--nproc-per-node: this process is already one rank of a launch (LOCAL_RANK is "
                          "set); give the process count to the launcher, not to each rank")
    check_before_launch(cfg, nproc)
    status, said = launch(nproc, ["train", *(["--config", config] if config else []), *overrides])
    if said:
        print(said, file=sys.stderr)
    return status


def evaluate(
    *,
    checkpoint: str,
    data: Annotated[Optional[str], "data folder (default: the one the run trained on)"] = None,
    split: Literal["val", "train"] = "val",
    batches: Annotated[int, "language model: micro-batches to average over, spread across the split; "
                            "0 = every block of the split"] = 0,
    device: Device = "auto",
    json: Annotated[bool, "print one JSON object"] = False,
) -> int:
    """Loss and perplexity of a checkpoint (a classifier's: accuracy, macro-F1, confusion).

    The blocks are spread evenly over the split; the line says how many and how many tokens.
    """
    check_device_flag(device)
    from distlm.model.load import checkpoint_task
    if checkpoint_task(checkpoint) == "classify":
        from distlm.cli.classify import evaluate_classifier
        return evaluate_classifier(checkpoint, data=data, split=split, device=device, as_json=json)
    import torch
    from tqdm import tqdm

    from distlm.data import load_manifest
    from distlm.data.loader import TokenBlocks, val_micro_batches
    from distlm.model.load import load_trained
    from distlm.model.loss import lm_loss
    from distlm.device import resolve_device
    dev = resolve_device(device)
    loaded = load_trained(checkpoint, dev, task="lm")
    cfg = loaded.cfg
    data_dir = Path(data or cfg.data.dir or "")
    manifest = load_manifest(data_dir)
    # Token ids mean nothing under another tokenizer, even one of the same size: compare the
    # fingerprint the run saved with the data's.
    from distlm.data import same_tokenizer
    from distlm.model.load import run_tokenizer_record
    trained_on = run_tokenizer_record(loaded.folder)
    if trained_on and not same_tokenizer(trained_on, manifest["tokenizer"]):
        raise ConfigError(f"{data_dir}: prepared with tokenizer {manifest['tokenizer']['name']} "
                          f"(fingerprint {str(manifest['tokenizer'].get('fingerprint'))[:12]}), but {loaded.folder} "
                          f"was trained with {trained_on['name']} (fingerprint {str(trained_on.get('fingerprint'))[:12]})")
    if int(manifest["tokenizer"]["vocab_size"]) > cfg.model.vocab_size:
        raise ConfigError(f"{data_dir}: vocabulary {manifest['tokenizer']['vocab_size']} does not fit the model's "
                          f"{cfg.model.vocab_size} (data and checkpoint use different tokenizers)")
    blocks = TokenBlocks(data_dir, split, cfg.model.block_size, manifest)
    # keep_tail: the last, partial micro-batch too, so 0 means every block (eval runs eagerly:
    # a smaller last batch costs no compilation).
    val = val_micro_batches(blocks, batches, cfg.train.micro_batch_size, keep_tail=True)
    total = rows = 0.0
    # tqdm's disable=None: a bar on a terminal; in a pipe or a log file, where a bar would be
    # thousands of redraws, a line at each tenth instead, so a long evaluation is seen to move
    # (from 10 batches: a shorter one is done before a line would help)
    tenths = set() if sys.stderr.isatty() or len(val) < 10 else {math.ceil(len(val) * k / 10) for k in range(1, 10)}
    with torch.no_grad():
        for i, (x, y, weight) in enumerate(tqdm(val.weighted(), total=len(val), desc="eval", unit="batch",
                                                leave=False, disable=None), 1):
            # The shards are not re-hashed here: an id past the model's vocabulary would be an
            # IndexError in the embedding (a device assert on CUDA), so each batch is checked.
            top, low = int(torch.maximum(x.max(), y.max())), int(torch.minimum(x.min(), y.min()))
            if top >= cfg.model.vocab_size or low < 0:
                from distlm.data import DataError
                raise DataError(f"{data_dir}: the '{split}' split holds token id {low if low < 0 else top}, outside the model's "
                                f"vocabulary of {cfg.model.vocab_size} (damaged or edited shards)")
            total += float(lm_loss(loaded.model(x.to(dev)), y.to(dev))) * weight
            rows += weight
            if i in tenths:
                print(f"eval: {i}/{len(val)} batches", file=sys.stderr, flush=True)
    if not rows:
        from distlm.data import DataError
        raise DataError(f"{data_dir}: the '{split}' split holds no block of {cfg.model.block_size} tokens")
    loss = total / rows
    result = {"checkpoint": str(loaded.folder), "data": str(data_dir), "split": split, "loss": loss,
              "perplexity": math.exp(loss), "tokens": val.n_tokens, "blocks": val.n_blocks}
    print(jsonlib.dumps(result) if json else
          f"{loaded.folder}: {split} loss {loss:.4f}, perplexity {math.exp(loss):.2f} over {val.describe()}")
    return 0


def predict(
    *,
    checkpoint: str,
    input: Annotated[str, "texts to label: .txt (one per line), or a column of .csv/.tsv/.jsonl/.parquet "
                          "(optionally .gz/.xz)"],
    text_field: Annotated[str, "the text column of csv/jsonl/parquet inputs"] = "text",
    out: Annotated[Optional[str], "F.csv (index,label,prob_<label>...) or F.jsonl ({index, label, probs}); "
                                  "default: RUN/INPUT.predictions.csv, in the checkpoint's run folder"] = None,
    batch_size: Annotated[int, "texts per forward"] = 64,
    device: Device = "auto",
) -> int:
    """Label texts with a classifier; writes each text's label and class probabilities."""
    check_device_flag(device)
    from distlm.cli.classify import predict_texts
    return predict_texts(checkpoint, input, text_field=text_field, out=out, batch_size=batch_size, device=device)


def plot(
    runs: Annotated[Sequence[str], "run folders, each with its metrics.csv"], /, *,
    out: Annotated[Optional[str], "the PNG to write; default: RUN/loss.png for one run, FIRST_RUN/compare.png "
                                  "for several"] = None,
) -> int:
    """Draw the loss curves of runs into one PNG (in the run folder unless --out says otherwise)."""
    from distlm.report.plot import plot_runs
    # Never the working directory: a plot belongs with the run it shows, and a second
    # `distlm plot` elsewhere would silently replace the first one's ./loss.png.
    dest = Path(out) if out else Path(runs[0]) / ("loss.png" if len(runs) == 1 else "compare.png")
    print(f"wrote {plot_runs([Path(r) for r in runs], dest)}")
    return 0


def plan(
    overrides: Sequence[str] = (), /, *,
    gpus: Annotated[int, "how many GPUs"],
    config: Optional[str] = None,
    gpu_mem_gb: Annotated[float, "GiB per GPU (an 80 GB H100 has 79.6)"] = 80.0,
    seq: Annotated[Optional[int], "sequence length (default: model.block_size)"] = None,
    global_batch: Annotated[Optional[int], "sequences per step (default: the config's)"] = None,
    micro_batch: Annotated[Optional[int], "sequences per forward (default: the config's; if auto, per layout "
                                          "what `distlm train` would pick on --gpu-mem-gb)"] = None,
    dtype: Annotated[Literal["bf16", "fp32"], "activation dtype (fp32 on CPU)"] = "bf16",
    peak_tflops: Annotated[float, "for the time estimate (H100/H200 dense bf16)"] = 989.0,
    link_gbs: Annotated[float, "GB/s per GPU inside a node (NVLink bus bandwidth), for the time estimate"] = 150.0,
    gpus_per_node: Annotated[Optional[int], "GPUs per node (default: all --gpus in one node)"] = None,
    inter_node_gbs: Annotated[float, "GB/s per GPU between nodes (25 for a 200 Gb/s NIC per GPU)"] = 25.0,
) -> int:
    """Memory and communication per GPU for every layout of N GPUs, ranked.

    For each (dp_replicate, dp_shard, tp, pp) layout, with and without activation
    checkpointing: parameters, gradients, optimizer state (as optim.name declares it), FSDP
    buffers and activations per GPU, and bytes communicated per step; then a recommendation. Exit 1 when nothing fits.
    With --gpus-per-node, the mesh's inner axes (tp, then dp_shard, dp_replicate, pp) stay
    inside a node and the collectives of an axis that spans nodes run at --inter-node-gbs;
    the table's inter-node column names those axes, and HSDP (dp_shard inside a node,
    dp_replicate across) is among the layouts. The settings `distlm train` makes on the
    device (an auto micro-batch, model.loss_chunk) are made per layout by the same rule
    (distlm/train/fast_defaults.py), as for a GPU with --gpu-mem-gb free; the table's
    micro-batch column says which each layout got. Float8 (train.fp8) is not modelled: with it
    set, the estimates are bf16's, and the output says so.
    """
    from distlm.optim import spec_for
    from distlm.parallel.dims import ParallelDims
    from distlm.planner import explain, format_table, plan as plan_layouts, skipped_layouts
    from distlm.train.fast_defaults import GPU_MICRO_CAP, HEADROOM, Device, choose
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be at least 1")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: must divide --gpus {gpus} (whole nodes)")
    for flag, value in (("--link-gbs", link_gbs), ("--inter-node-gbs", inter_node_gbs),
                        ("--peak-tflops", peak_tflops)):
        if not value > 0:
            raise ConfigError(f"{flag} {value:g}: must be positive")
    cfg = load_config(config, [*overrides, *([f"model.block_size={seq}"] if seq else [])])
    if cfg.model.vocab_size is None:
        cfg = updated(cfg, model={"vocab_size": 50257})  # GPT-2 BPE, what a preset trains on unless told otherwise
    gb = global_batch or cfg.train.global_batch_size
    mb = micro_batch or cfg.train.micro_batch_size  # None: auto, chosen per layout below
    cfg = updated(cfg, train={"global_batch_size": gb, "micro_batch_size": mb, "dtype": dtype})
    device = Device("cuda", gpu_mem_gb)

    def resolve(lay):
        # what the Trainer's fast_defaults would make of each auto with this layout on this GPU
        dims = ParallelDims(**lay.degrees(), world_size=gpus)
        run = choose(updated(cfg, parallel={"activation_checkpoint": lay.ac, "pp_schedule": lay.schedule}),
                     device, dims).cfg
        return run.model, run.train.micro_batch_size
    ests = plan_layouts(cfg.model, gpus, gpu_mem_gb, gb, mb, resolve=resolve, peak_tflops=peak_tflops,
                        intra_gbs=link_gbs, inter_gbs=inter_node_gbs, gpus_per_node=gpus_per_node,
                        compute_bytes=2 if dtype == "bf16" else 4, sequence_parallel=cfg.parallel.sequence_parallel,
                        loss_parallel=cfg.parallel.loss_parallel, optimizer=spec_for(cfg),
                        fused_loss=cfg.train.compile is not False)  # auto compiles on a GPU
    if not ests:
        raise ConfigError(f"no layout of {gpus} GPUs divides global batch {gb}"
                          + (f" into micro-batches of {mb}" if mb else " into whole local batches"))
    nodes = f", {gpus // gpus_per_node} nodes of {gpus_per_node} ({link_gbs:g} GB/s inside, {inter_node_gbs:g} " \
            f"GB/s between, per GPU)" if gpus_per_node and gpus_per_node < gpus else ""
    print(f"{config or 'config'}: {cfg.model.n_layer} layers x {cfg.model.d_model}, T={cfg.model.block_size}, "
          f"global batch {gb}, micro-batch {mb or 'auto'}, {gpus} GPUs x {gpu_mem_gb:g} GiB{nodes}")
    if mb is None:
        print(f"micro-batch auto: per layout (column micro-batch), the largest divisor of its local batch up to "
              f"{GPU_MICRO_CAP} whose estimate is at most {HEADROOM:.0%} of {gpu_mem_gb:g} GiB, as `distlm train` "
              f"picks on the GPU")
    print(format_table(ests))
    for note in skipped_layouts(gpus, cfg.model):
        print(note)
    if cfg.train.fp8 != "off":
        # Float8 changes what the blocks keep and how fast their matmuls run, by amounts that
        # depend on the model's width, activation checkpointing and the card (measured: from
        # 0.89x to 1.53x the bf16 tok/s, and 27% less to 17% more memory), and the planner
        # models neither: it says so rather than print float8 figures it cannot stand behind.
        print(f"train.fp8={cfg.train.fp8}: these are bf16 estimates; float8's effect on memory and time is not "
              f"modelled (measured figures: docs/results/float8.md)")
    fits = [e for e in ests if e.fits]
    if not fits:
        print(f"no layout fits in {gpu_mem_gb:g} GiB: lower train.micro_batch_size, or add GPUs")
        return 1
    print(explain(fits[0], ests, gpu_mem_gb))
    return 0


def export(
    checkpoint: str, out: Annotated[str, "the folder to write"], /, *,
    format: Annotated[Literal["hf"], "hf: a Hugging Face transformers folder"] = "hf",
    dtype: Annotated[Literal["fp32", "bf16", "fp16"], "weight dtype"] = "fp32",
    force: Annotated[bool, "replace OUT if it exists"] = False,
) -> int:
    """Write a checkpoint as a Hugging Face transformers folder, weights in one file.

    Checkpoints are DCP folders (a file per rank); this is the way to one file:
    OUT/model.safetensors (safetensors.torch.load_file gives the state dict, no distlm
    needed), with config.json and the tokenizer, so transformers' from_pretrained loads OUT.
    GPT2LMHeadModel for learned/sinusoidal positions + layernorm + gelu; for rope + rmsnorm,
    LlamaForCausalLM (swiglu), Qwen3ForCausalLM (swiglu, qk_norm), ArceeForCausalLM (relu2)
    or ApertusForCausalLM (relu2, qk_norm). Other combinations are refused, never exported
    approximately.
    """
    from distlm.interop.hf import export_hf
    s = export_hf(checkpoint, out, dtype=dtype, overwrite=force)
    print(f"exported {s['checkpoint']} as {s['architecture']} ({s['dtype']}, tokenizer {s['tokenizer']}) "
          f"to {s['out']}")
    return 0


def env(*, json: Annotated[bool, "print JSON (every rank's report under torchrun)"] = False) -> int:
    """Versions, GPUs, backend and world size; under torchrun also one all-reduce per rank."""
    from distlm.launch.env import check_collectives, env_report
    report = env_report()
    reports = check_collectives(report) if report["world_size"] > 1 else [report]
    if report["rank"] != 0:
        return 0 if all(r.get("all_reduce", {"ok": True})["ok"] for r in reports) else 1
    if json:
        print(jsonlib.dumps(reports if len(reports) > 1 else report, indent=1))
    else:
        r = report
        print(f"torch {r['torch']} | python {r['python']} | CUDA {r['cuda']} | cuDNN {r['cudnn']} | NCCL {r['nccl']}")
        print(f"backend {r['backend']} | world size {r['world_size']} | master {r['master']} | "
              f"available: {', '.join(k for k, v in r['available'].items() if v)}")
        print(f"bytecode of the imports: {r['bytecode']}")
        for q in reports:
            devs = ", ".join(f"{g['index']}:{g['name']} {g['memory_gb']}GB" for g in q["gpus"]) or "no GPU"
            ar = q.get("all_reduce")
            ar_txt = f" | all_reduce {'ok' if ar['ok'] else 'WRONG'} {ar['seconds'] * 1e3:.1f} ms" if ar else ""
            print(f"rank {q['rank']:>3} local {q['local_rank']} on {q['host']}: {devs}{ar_txt}")
        for k, v in r["env"].items():
            print(f"  {k}={v}")
    return 0 if all(q.get("all_reduce", {"ok": True})["ok"] for q in reports) else 1
