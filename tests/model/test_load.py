"""Checkpoints written before the package was reshaped (commit 13d7eec and before) still load and resume.

tests/fixtures/run-13d7eec is a run saved by commit 13d7eec (the last one before the move), its config
since spelled in the keys of today (optim.adamw.*, train.min_lr_ratio: no old key is read):
1 layer, d=32, synthetic tokens over 256, 3 steps; expected.json holds the logits that code
gave for fixed ids. It has no checksums in its marker and no sample-order version in its
loader state: both must still be accepted."""
import json
import shutil
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-13d7eec"


def test_an_old_checkpoint_loads_with_the_same_logits():
    from distlm.model.load import load_model
    expected = json.loads((FIXTURE / "expected.json").read_text())
    model, cfg, folder = load_model(FIXTURE)
    with torch.no_grad():
        out = model(torch.tensor(expected["ids"]))
    assert abs(float(out.double().sum()) - expected["logits_sum"]) < 1e-4
    assert torch.allclose(out[0, 0, :8], torch.tensor(expected["logits_first"]), atol=1e-6)


def test_an_old_run_resumes(tmp_path, capsys):
    from distlm.cli import main
    run = tmp_path / "runs" / "old"
    shutil.copytree(FIXTURE, run)
    args = ["train", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
            "model.vocab_size=256", "data.source=synthetic", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.max_steps=5", "train.eval_every=0", "train.device=cpu", "log.progress=false",
            "log.tensorboard=false", f"log.root={tmp_path / 'runs'}", "log.name=old", "train.resume=auto"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step 3" in out
    assert (run / "checkpoints" / "step_0000005" / "distlm.json").is_file()
