"""`make run`: prepare the vendored Gutenberg books, train, evaluate, sample, plot. Offline.

On CPU it trains the `demo` preset (the `tiny` shape with Muon, RoPE, RMSNorm, QK-norm,
ReLU^2 and a WSD schedule; docs/results/time-to-loss.md) on a 4,096-token BPE trained on the
corpus (GPT-2's 50k vocabulary would make the output layer most of a small model's cost);
on CUDA a larger model on GPT-2's tokenizer.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

from distlm.config import load_config

# The demo preset holds the CPU's time budget (configs/demo.yaml). Its
# micro-batch is auto, so that the preset runs on 2 or 4 processes too; auto on one CPU process
# would take 8 in two passes, and the demo's figures (docs/results/time-to-loss-cpu.md) are of
# the whole batch of 16 in one.
CPU_OVERRIDES = ["train.micro_batch_size=16"]
# train.time_budget_s: a GPU slower than the one these were set on still decays to the end
# within the budget.
CUDA_OVERRIDES = ["model.n_layer=6", "model.n_head=6", "model.d_model=384", "model.d_ff=1536",
                  "model.block_size=256", "train.global_batch_size=64", "train.micro_batch_size=64",
                  "train.max_steps=750", "optim.adamw.lr=1e-3", "train.eval_every=250", "train.checkpoint_every=250",
                  "log.every=50", "train.time_budget_s=200"]


def demo(
    *,
    root: Annotated[str, "where the run folder goes"] = "runs",
    data_root: Annotated[str, "where the prepared corpus is cached"] = "data",
    max_steps: Annotated[Optional[int], "train this many steps instead of the demo's"] = None,
) -> int:
    """Offline end to end on the vendored Gutenberg corpus: prepare, train, eval, sample, plot.

    What `make run` runs. On CPU: the `demo` preset on a 4,096-token BPE, about 3 minutes.
    """
    import torch  # here, not at the top: the CLI's parser imports this module

    from distlm.corpus.prepare import prepare
    from distlm.corpus.sources import DEFAULT_CORPUS
    from distlm.data.tokenizer import load_tokenizer
    from distlm.model.generate import SamplingConfig, generate_text
    from distlm.report.samples import append_samples
    from distlm.train.trainer import Trainer

    cuda = torch.cuda.is_available()
    tokenizer = "gpt2" if cuda else "bpe:4096"
    data_dir = Path(data_root) / f"gutenberg-{tokenizer.replace(':', '')}"
    print(f"[1/5] preparing the vendored Gutenberg corpus ({tokenizer}) -> {data_dir}")
    prepare([str(DEFAULT_CORPUS)], data_dir, tokenizer=tokenizer, val_fraction=0.05, seed=0)

    # log.samples=0: step 4 below prints samples of three prompts itself.
    overrides = [f"data.dir={data_dir}", f"log.root={root}", "log.samples=0"]
    overrides += CUDA_OVERRIDES if cuda else CPU_OVERRIDES
    if max_steps:
        overrides.append(f"train.max_steps={max_steps}")
    cfg = load_config("tiny" if cuda else "demo", overrides)
    print(f"[2/5] training on {'CUDA' if cuda else 'CPU'}: {cfg.train.max_steps} steps at most, "
          f"{cfg.train.time_budget_s:g} s at most (a slower machine trains fewer steps; the learning-rate "
          f"schedule still runs to its end)")
    trainer = Trainer(cfg, name_prefix="demo")  # a new ROOT/demo-TIMESTAMP, -2 if that second is taken
    summary = trainer.train()

    val = summary["val_loss"]
    if summary["stopped"]:  # a signal: the trainer saved and ran no final evaluation
        last = f"; the newest, from an earlier step: {val:.4f}" if val is not None and math.isfinite(val) else ""
        print(f"[3/5] {summary['stopped']} at step {summary['step']}: no final validation{last}")
    else:
        print(f"[3/5] validation loss {val:.4f}, perplexity {math.exp(val):.1f} after {summary['step']} steps")
    print("[4/5] samples (temperature 0.8, top-k 50):")
    tok = load_tokenizer(trainer.manifest["tokenizer"]["name"], data_dir)
    prompts, texts = ("It was a dark and stormy night", "The king said", "Call me Ishmael."), []
    for i, prompt in enumerate(prompts):
        sc = SamplingConfig(max_new_tokens=60, temperature=0.8, top_k=50, seed=i)
        texts.append(generate_text(trainer.module, tok, prompt, sc)[0])
        print(f"  >> {prompt}{texts[-1]}".replace("\n", " "))
    run_dir = Path(summary["run_dir"])
    append_samples(run_dir / "samples.txt", trainer.step, "60 new tokens, temperature 0.8, top-k 50, sample i "
                   "with seed i", list(prompts), texts)
    print(f"[5/5] loss curve: {run_dir / 'loss.png'}")
    print(f"\nrun folder: {run_dir}  (config.yaml, metrics.csv, samples.txt, tensorboard/, checkpoints/, loss.png)")
    print("next:")
    print(f"  distlm generate --checkpoint {run_dir} --prompt 'Once upon a time' --num-samples 3")
    print(f"  distlm eval --checkpoint {run_dir}")
    print(f"  tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"  distlm train --config gpt2-124m data.dir={data_dir}   # bigger model (GPU)")
    return 0
