"""Write tests/fixtures/optim-62988e0: two tiny runs saved by commit 62988e0, the last one before
optimizers got their own config section (optim.*) and registry, and what that commit's code
gave when it continued them.

    PYTHONPATH=$PWD python scripts/build_optimizer_fixtures.py tests/fixtures/optim-62988e0

For each of AdamW (train.optimizer=adamw) and Muon (train.optimizer=muon, fp32 Newton-Schulz,
an untied head with its own embedding rate): a 1-layer d=16 GPT on synthetic tokens over 128,
3 steps, one checkpoint at step 3, kept with its config.yaml (the flat train.* spelling of that
commit). The script then resumes a copy to step 5 with the same code and writes expected.json:
the logged losses of steps 4 and 5 and a digest of every tensor of the step-5 checkpoint
(model, optimizer state, RNG), plus the torch version and CPU capability they were computed
with, on one thread. tests/test_optimizer_fixture.py resumes the fixture with today's code and compares.
Produced on 2026-11-27 at commit 62988e0 on a 2-core x86 box, torch 2.13 CPU (torch reports its
CPU capability as AVX512; expected.json records it). To rebuild the same fixture, run this script
on a checkout of 62988e0 (`git archive 62988e0 | tar -x -C DIR`, then this file into DIR/scripts and
tests/fixture_digest.py into DIR/tests): a later commit writes its own spelling into config.yaml.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# One intra-op thread, as the test suite runs (tests/conftest.py): a CPU matmul's bits depend
# on how its sums are split between threads.
os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# The spelling of commit 62988e0, kept so the fixture holds what a run of that day saved.
COMMON = ["model.n_layer=1", "model.n_head=2", "model.d_model=16", "model.d_ff=32", "model.block_size=16",
          "model.vocab_size=128", "data.source=synthetic", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.warmup_steps=1", "train.eval_every=0", "train.device=cpu", "log.every=1", "log.progress=false",
          "log.tensorboard=false", "log.samples=0", "train.lr=3e-3"]
RUNS = {
    "adamw": ["train.optimizer=adamw"],
    "muon": ["train.optimizer=muon", "train.muon_lr=0.02", "train.muon_ns_dtype=fp32", "train.muon_momentum=0.9",
             "train.muon_weight_decay=0.01", "train.embed_lr=0.01", "model.tie_embeddings=false"],
}
SAVED_STEPS, RESUMED_STEPS = 3, 5


def main(out: Path) -> None:
    from distlm.cli import main as cli
    from fixture_digest import checkpoint_digest, cpu_key
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            root = Path(tmp) / name
            args = ["train", *COMMON, *extra, f"log.root={root}", f"log.name={name}"]
            assert cli([*args, f"train.max_steps={SAVED_STEPS}"]) == 0
            run = root / name
            kept = out / name
            shutil.rmtree(kept, ignore_errors=True)
            kept.mkdir()
            shutil.copy(run / "config.yaml", kept / "config.yaml")
            shutil.copytree(run / "checkpoints" / f"step_{SAVED_STEPS:07d}",
                            kept / "checkpoints" / f"step_{SAVED_STEPS:07d}")
            assert cli([*args, f"train.max_steps={RESUMED_STEPS}", "train.resume=auto"]) == 0
            with open(run / "metrics.csv") as f:
                losses = {int(r["step"]): r["loss"] for r in csv.DictReader(f) if r.get("loss")}
            expected = {"overrides": [*COMMON, *extra], "saved_step": SAVED_STEPS, "resumed_to": RESUMED_STEPS,
                        "losses": {str(s): losses[s] for s in range(SAVED_STEPS + 1, RESUMED_STEPS + 1)},
                        "digest": checkpoint_digest(run / "checkpoints" / f"step_{RESUMED_STEPS:07d}"),
                        "computed_on": cpu_key()}
            (kept / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "fixtures" / "optim-62988e0")
