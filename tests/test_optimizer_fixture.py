"""Runs saved before optimizers had their own config section still resume, bit for bit.

tests/fixtures/optim-62988e0 holds two 3-step runs written by commit 62988e0 (AdamW, and Muon
with its own embedding rate), in that commit's flat spelling (train.optimizer, train.muon_*,
train.embed_lr), and expected.json: what that commit's code logged and saved when it resumed
them to step 5 (scripts/build_optimizer_fixtures.py). Today's code resumes them with the same
overrides; every tensor of its step-5 checkpoint (weights, optimizer state, RNG) and both
logged losses must be the same bits. The bits of CPU arithmetic depend on the kernels: on a
torch version or CPU capability other than the recording's, the values are held to 1e-5."""
import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from fixture_digest import checkpoint_digest, checkpoint_tensors, cpu_key

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "optim-62988e0"


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_run_saved_before_the_optim_section_resumes_bit_exactly(name, tmp_path, capsys):
    from distlm.cli import main
    expected = json.loads((FIXTURES / name / "expected.json").read_text())
    run = tmp_path / "runs" / name
    shutil.copytree(FIXTURES / name, run, ignore=shutil.ignore_patterns("expected.json"))
    args = ["train", *expected["overrides"], f"train.max_steps={expected['resumed_to']}", "train.resume=auto",
            f"log.root={tmp_path / 'runs'}", f"log.name={name}"]
    assert main(args) == 0
    assert f"step {expected['saved_step']}" in capsys.readouterr().out
    with open(run / "metrics.csv") as f:
        losses = {r["step"]: r["loss"] for r in csv.DictReader(f) if r.get("loss")}
    final = run / "checkpoints" / f"step_{expected['resumed_to']:07d}"
    if cpu_key() == expected["computed_on"]:
        assert {s: losses[s] for s in expected["losses"]} == expected["losses"]
        assert checkpoint_digest(final) == expected["digest"]
    else:
        assert all(float(losses[s]) == pytest.approx(float(v), rel=1e-5) for s, v in expected["losses"].items())
        assert sorted(checkpoint_tensors(final)) == sorted(expected["digest"])


def test_the_fixture_is_the_old_spelling():
    # What makes it a fixture of the old format: the flat train.* keys in every saved config.
    for name, key in (("adamw", "optimizer"), ("muon", "muon_lr")):
        saved = json.loads((FIXTURES / name / "checkpoints" / "step_0000003" / "run-config.json").read_text())
        assert key in saved["train"] and "optim" not in saved, name
        assert torch.__version__  # the digests name the version they were computed with
