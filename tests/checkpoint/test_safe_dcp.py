"""A crafted checkpoint never runs code.

Each case writes a hostile ``.metadata`` (or RNG file, or pickled DCP entry) into a copy
of a real checkpoint, re-computes the marker's checksums (an attacker controls the whole
folder, marker included, so the checksums are no defence here), loads it, and checks that
the load is refused with a one-line CheckpointError naming the file and the global, and
that the payload's side effect (a file) did not happen."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlm.checkpoint import store as ckpt
from distlm.checkpoint.errors import CheckpointError, CorruptCheckpoint
from helpers.checkpoints import (TINY, _Reduce, _s, build_on_global, call_global, fresh_model, marker_meta,  # noqa: F401
                                 rehash, save, tiny_model)

ROOT = Path(__file__).resolve().parents[2]
def assert_refused(err: BaseException, where: Path, names: str) -> None:
    msg = str(err)
    assert isinstance(err, CheckpointError), repr(err)
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert str(where) in msg, msg
    assert names in msg, msg


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("safety") / "checkpoints", 2)


@pytest.fixture
def victim(base, tmp_path) -> Path:
    folder = tmp_path / "checkpoints" / base.name
    shutil.copytree(base, folder)
    return folder


# ---- .metadata ---------------------------------------------------------------------------
def payloads(sentinel: Path) -> list[tuple[str, bytes, str]]:
    """(case, .metadata bytes, the global the refusal must name). Each would create ``sentinel``."""
    touch = f"touch {sentinel}"
    py = f"open({str(sentinel)!r}, 'w').close()"
    md = "torch.distributed.checkpoint.metadata"
    return [
        # dotted names under allowed modules: each of these modules imports os
        ("dotted-metadata-os.system", call_global(md, "os.system", touch), f"{md}.os.system"),
        ("dotted-serialization-os.system", call_global("torch.serialization", "os.system", touch),
         "torch.serialization.os.system"),
        ("dotted-pathlib-os.system", call_global("pathlib", "os.system", touch), "pathlib.os.system"),
        ("dotted-torch-os.system", call_global("torch", "os.system", touch), "torch.os.system"),
        # a getattr chain spelled as a dotted name from an allowed global
        ("dotted-class-chain", call_global(md, "Metadata.__init__.__globals__", "os"),
         f"{md}.Metadata.__init__.__globals__"),
        # __reduce__ payloads, as pickle.dumps writes them
        ("reduce-os.system", pickle.dumps(_Reduce(os.system, (touch,)), protocol=4), "system"),
        ("reduce-subprocess", pickle.dumps(_Reduce(subprocess.check_call, (["touch", str(sentinel)],)), protocol=4),
         "subprocess.check_call"),
        ("reduce-eval", pickle.dumps(_Reduce(eval, (py,)), protocol=4), "builtins.eval"),
        ("reduce-exec", pickle.dumps(_Reduce(exec, (py,)), protocol=4), "builtins.exec"),
        ("protocol-0-os.system", f"cos\nsystem\n(V{touch}\ntR.".encode(), "os.system"),
        # builtins
        ("builtins.eval", call_global("builtins", "eval", py), "builtins.eval"),
        ("builtins.exec", call_global("builtins", "exec", py), "builtins.exec"),
        ("builtins.getattr", call_global("builtins", "getattr", "os", "system"), "builtins.getattr"),
        ("builtins.__import__", call_global("builtins", "__import__", "os"), "builtins.__import__"),
        # globals of the allowed modules that DCP metadata never holds
        ("metadata.os", call_global(md, "os"), f"{md}.os"),
        ("metadata.Enum", call_global(md, "Enum", "x"), f"{md}.Enum"),
        ("filesystem.pickle", call_global("torch.distributed.checkpoint.filesystem", "pickle"),
         "torch.distributed.checkpoint.filesystem.pickle"),
        ("filesystem.FileSystemReader", call_global("torch.distributed.checkpoint.filesystem", "FileSystemReader",
                                                    str(sentinel)), "FileSystemReader"),
        ("serialization.load", call_global("torch.serialization", "load", str(sentinel)), "torch.serialization.load"),
        ("torch.load", call_global("torch", "load", str(sentinel)), "torch.load"),
        ("pathlib.Path", call_global("pathlib", "Path", str(sentinel)), "pathlib.Path"),
        ("torch.float alias", call_global("torch", "float"), "torch.float"),  # dtypes by canonical name only
        # BUILD onto an allowed class or function: would re-wire it for every later load
        ("build-on-class", build_on_global(md, "StorageMeta", "pwned", "yes", slots=True), "StorageMeta"),
        ("build-on-function", build_on_global("torch.serialization", "_get_layout", "cache", "x", slots=False),
         "_get_layout"),
    ]


CASES = [c[0] for c in payloads(Path("/x"))]


@pytest.mark.parametrize("case", CASES)
def test_crafted_metadata_is_refused_and_runs_nothing(case, victim, tmp_path):
    sentinel = tmp_path / "PWNED"
    data, names = next((d, n) for c, d, n in payloads(sentinel) if c == case)
    (victim / ".metadata").write_bytes(data)
    rehash(victim)
    model, opt = fresh_model()
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(victim, model)  # what eval / generate / export call
    assert_refused(e.value, victim / ".metadata", names)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(victim, model, opt)  # train.resume=PATH
    assert_refused(e.value, victim / ".metadata", names)
    with pytest.raises(CheckpointError) as e:
        ckpt.verify_checkpoint(victim)
    assert_refused(e.value, victim / ".metadata", names)
    assert not sentinel.exists(), f"{case}: the payload ran"
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.serialization import _get_layout
    assert not hasattr(StorageMeta, "pwned") and isinstance(_get_layout.cache, dict)


def test_crafted_newest_checkpoint_is_skipped_by_resume_auto(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base, run / "checkpoints" / base.name)
    newest = run / "checkpoints" / "step_0000004"
    shutil.copytree(base, newest)
    sentinel = tmp_path / "PWNED"
    (newest / ".metadata").write_bytes(call_global("torch.distributed.checkpoint.metadata", "os.system",
                                                   f"touch {sentinel}"))
    rehash(newest)
    said = []
    assert ckpt.resume_target("auto", run, say=said.append) == run / "checkpoints" / base.name
    assert any("skipping corrupt checkpoint" in s and "os.system" in s for s in said), said
    assert not sentinel.exists()


def test_legacy_checkpoint_without_checksums_is_still_guarded(victim, tmp_path):
    sentinel = tmp_path / "PWNED"
    (victim / ".metadata").write_bytes(call_global("torch.distributed.checkpoint.metadata", "os.system",
                                                   f"touch {sentinel}"))
    meta = json.loads((victim / ckpt.MARKER).read_text())
    del meta["files"]
    (victim / ckpt.MARKER).write_text(ckpt.marker_text(meta))
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(victim, fresh_model()[0])
    assert_refused(e.value, victim / ".metadata", "os.system")
    assert not sentinel.exists()


def test_real_checkpoint_still_loads_exactly(base):
    model, opt = tiny_model()
    fresh, fresh_opt = fresh_model()
    meta = ckpt.load_checkpoint(base, fresh, fresh_opt)
    assert meta["step"] == 2 and fresh_opt.state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_allowed_globals_are_exact_pairs_without_dots():
    from distlm.checkpoint.safe_dcp import ALLOWED_GLOBALS
    assert all("." not in name for _, name in ALLOWED_GLOBALS)
    assert ("torch", "float32") in ALLOWED_GLOBALS and ("torch", "float") not in ALLOWED_GLOBALS
    assert not any(m == "builtins" for m, _ in ALLOWED_GLOBALS)


# ---- RNG files and pickled DCP entries ---------------------------------------------------
def test_crafted_rng_file_is_refused_in_one_line(victim, tmp_path):
    sentinel = tmp_path / "PWNED"
    rng = victim / "rng" / "rank_00000.pt"
    torch.save({"cpu": _Reduce(os.system, (f"touch {sentinel}",))}, rng)
    rehash(victim)
    model, opt = fresh_model()
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.load_checkpoint(victim, model, opt)
    assert_refused(e.value, rng, "system")
    assert "refused to load" in str(e.value)
    assert not sentinel.exists()


def test_rng_file_that_is_not_an_rng_state_is_refused(victim):
    rng = victim / "rng" / "rank_00000.pt"
    torch.save({"cpu": [1, 2, 3]}, rng)
    rehash(victim)
    with pytest.raises(CorruptCheckpoint, match="not an RNG state"):
        ckpt.load_checkpoint(victim, *fresh_model())


def test_crafted_pickled_entry_in_distcp_is_refused(victim, tmp_path):
    """DCP stores non-tensor values (AdamW's lr, betas) as pickled bytes in the .distcp files:
    a hostile one is refused by torch.load(weights_only=True) and named by its key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    sentinel = tmp_path / "PWNED"
    model, opt = tiny_model()
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = _Reduce(os.system, (f"touch {sentinel}",))
    for p in list(victim.iterdir()):
        if p.name != ckpt.MARKER and p.is_file():
            p.unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(victim))
    rehash(victim)
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.load_checkpoint(victim, *fresh_model())
    assert_refused(e.value, victim, "system")
    assert "optim.param_groups.0.lr" in str(e.value)
    assert not sentinel.exists()


# ---- the CLI -----------------------------------------------------------------------------
def test_cli_eval_of_crafted_checkpoint_exits_2_with_one_line(victim, tmp_path):
    sentinel = tmp_path / "PWNED"
    (victim / ".metadata").write_bytes(call_global("torch.distributed.checkpoint.metadata", "os.system",
                                                   f"touch {sentinel}"))
    rehash(victim)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    p = subprocess.run([sys.executable, "-m", "distlm", "eval", "--checkpoint", str(victim)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert "os.system" in err[0] and str(victim / ".metadata") in err[0], err[0]
    assert not sentinel.exists()
