"""Bad inputs of the reliability suite: damaged data shards, and checkpoints crafted to run
code when loaded. Split from test_faults.py, whose helpers (tests/fault_harness.py) it uses."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import fault_harness as fh
from fault_harness import make_trainer


# ---- 5. data faults ------------------------------------------------------------------
def train_main(capsys, data: Path, root: Path, *extra: str) -> tuple[int, list[str]]:
    from distlm.cli import main
    capsys.readouterr()
    rc = main(["train", "model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64",
               "model.block_size=16", f"data.dir={data}", "train.max_steps=2", "log.progress=false",
               "log.tensorboard=false", f"log.root={root}", "log.name=d", *extra])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def data_copy(tiny_data, tmp_path) -> Path:
    out = tmp_path / "data"
    shutil.copytree(tiny_data, out)
    return out


def test_flipped_byte_in_shard_exits_2_naming_it(data_copy, tmp_path, capsys):
    shard = data_copy / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    rc, err = train_main(capsys, data_copy, tmp_path / "runs")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and str(shard) in err[0] and "sha256" in err[0]


def test_truncated_shard_exits_2_naming_it(data_copy, tmp_path, capsys):
    shard = data_copy / "train_000000.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 6)
    rc, err = train_main(capsys, data_copy, tmp_path / "runs")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and str(shard) in err[0] and "tokens long" in err[0]


def test_manifest_vocab_larger_than_model_exits_2_naming_field(data_copy, tmp_path, capsys):
    m = json.loads((data_copy / "manifest.json").read_text())
    m["tokenizer"]["vocab_size"] = 60000
    (data_copy / "manifest.json").write_text(json.dumps(m))
    rc, err = train_main(capsys, data_copy, tmp_path / "runs", "model.vocab_size=50304")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: model.vocab_size=50304") and "60000" in err[0] and "manifest.json" in err[0]


def test_token_outside_vocabulary_exits_2_naming_the_shard(data_copy, tmp_path, capsys):
    import hashlib
    import numpy as np
    m = json.loads((data_copy / "manifest.json").read_text())
    shard = m["splits"]["train"]["shards"][0]
    ids = np.fromfile(data_copy / shard["file"], dtype=m["dtype"])
    ids[::7] = 65535
    ids.tofile(data_copy / shard["file"])
    shard["sha256"] = hashlib.sha256((data_copy / shard["file"]).read_bytes()).hexdigest()
    (data_copy / "manifest.json").write_text(json.dumps(m))
    rc, err = train_main(capsys, data_copy, tmp_path / "runs")
    assert rc == 2 and len(err) == 1 and shard["file"] in err[0], err


# ---- 6. safe loading -----------------------------------------------------------------
class _Evil:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safe")
    make_trainer(root, "s", "train.max_steps=2", "train.checkpoint_every=2").train()
    return root / "s" / "checkpoints" / "step_0000002"


def _reseal(ckpt: Path) -> None:
    """Rewrite the marker's checksums over the crafted files, as an attacker who edits the
    marker too would: the checksums catch damage, the unpickler must stop the code."""
    import hashlib
    import json
    from distlm.checkpoint import MARKER
    meta = json.loads((ckpt / MARKER).read_text())
    files = {}
    for p in sorted(ckpt.rglob("*")):
        rel = p.relative_to(ckpt).as_posix()
        if p.is_file() and rel != MARKER:
            files[rel] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    meta["files"] = files
    from distlm.checkpoint.verify import marker_text
    (ckpt / MARKER).write_text(marker_text(meta))


def test_rng_file_that_runs_code_is_refused(one_checkpoint, tmp_path):
    bad = tmp_path / "ck"
    shutil.copytree(one_checkpoint, bad)
    pwned = tmp_path / "pwned"
    torch.save({"cpu": _Evil(pwned)}, bad / "rng" / "rank_00000.pt")
    _reseal(bad)
    with pytest.raises(Exception, match="refused to load: it names the global"):
        fh.load_into_fresh(bad)
    assert not pwned.exists()


def test_metadata_file_that_runs_code_is_refused(one_checkpoint, tmp_path):
    bad = tmp_path / "ck"
    shutil.copytree(one_checkpoint, bad)
    pwned = tmp_path / "pwned"
    import pickle
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil(pwned)))
    _reseal(bad)
    from distlm.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="refused to load: it names the global"):
        fh.load_into_fresh(bad)
    assert not pwned.exists(), "loading the checkpoint ran code from its .metadata"


def test_byte_entry_that_runs_code_is_refused(one_checkpoint, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    bad = tmp_path / "ck"
    shutil.copytree(one_checkpoint, bad)
    pwned = tmp_path / "pwned"
    model, opt = fh.fresh_model_and_optimizer(fh.CLI_TINY)
    fh.load_into_fresh(bad)
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = _Evil(pwned)
    for p in [*bad.glob("*.distcp"), bad / ".metadata"]:
        p.unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(bad))
    _reseal(bad)
    from distlm.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="refused to load: it names the global"):
        fh.load_into_fresh(bad)
    assert not pwned.exists(), "loading the checkpoint ran code from an optimizer entry"


