"""A checkpoint from someone else can neither change the process that loads it nor reach
outside its folder (2026-11-27).

Shared state: a ``.metadata`` that is the real one plus opcodes aimed at an object that
outlives the load (an enum member every later save pickles, a dtype, a layout, a class).
Each is loaded in a fresh process (``python tests/checkpoint/test_untrusted_checkpoints.py CASE ...``,
so a poisoned interpreter never reaches the test runner); that process then saves a fresh
checkpoint, which must load back there and here, and the shared objects must be as they were.

Paths: storage entries naming files outside the folder, links and FIFOs among a checkpoint's
files; the marker's config covered by the checksums."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.checkpoints import _s, fresh_model, rehash, save, tiny_model  # noqa: E402

from distlm.checkpoint import store as ckpt  # noqa: E402
from distlm.checkpoint.errors import CheckpointError, CorruptCheckpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MD = "torch.distributed.checkpoint.metadata"


# ---- crafting ----------------------------------------------------------------------------
def with_tail(real: bytes, ops: bytes) -> bytes:
    """The real metadata pickle with ``ops`` run after it (their result popped): the file
    still unpickles to the real Metadata. Protocol 4 frames the body; the frame grows."""
    assert real.endswith(b".")
    data = real[:-1] + ops + b"0."
    if data[2] == 0x95:  # FRAME <8-byte length> right after PROTO
        data = data[:3] + struct.pack("<Q", len(data) - 11) + data[11:]
    return data


MEMBER = _s(MD) + _s("_MEM_FORMAT_ENCODING") + b"\x93K\x00\x85R"         # _MEM_FORMAT_ENCODING(0)
MEMBER_NEW = _s(MD) + _s("_MEM_FORMAT_ENCODING") + b"\x93K\x00\x85\x81"  # cls.__new__(cls, 0): the member too
DTYPE = _s("torch") + _s("float32") + b"\x93"
LAYOUT = _s("torch.serialization") + _s("_get_layout") + b"\x93" + _s("torch.strided") + b"\x85R"
CLASS = _s(MD) + _s("TensorProperties") + b"\x93"


def build_dict(attr: str, value: int) -> bytes:     # BUILD {attr: value}: __dict__.update
    return b"}" + _s(attr) + b"K" + bytes([value]) + b"sb"


def build_slots(attr: str, value: int) -> bytes:    # BUILD (None, {attr: value}): setattr
    return b"N}" + _s(attr) + b"K" + bytes([value]) + b"s\x86b"


POISON = {
    # the case of 2026-11-27: every later save of the process records memory format 99
    "enum-member-value": MEMBER + build_dict("_value_", 99),
    "enum-member-value-setattr": MEMBER + build_slots("_value_", 99),
    "enum-member-value-via-newobj": MEMBER_NEW + build_dict("_value_", 99),
    "enum-member-rename": MEMBER + b"}" + _s("_name_") + _s("TORCH_CHANNELS_LAST") + b"sb",
    "enum-member-setitems": MEMBER + b"(K\x01K\x02u",
    "dtype-setattr": DTYPE + build_slots("itemsize", 1),
    "layout-setattr": LAYOUT + build_slots("x", 1),
    "class-build": CLASS + build_dict("__getstate__", 1),
    "class-appends": CLASS + b"(K\x01e",
}


def shared_state() -> dict:
    """What a load must leave as it was: the memory-format members, the allowed classes'
    attributes, the dtypes and layouts, and the bytes a fresh TensorProperties pickles to."""
    import pickle

    import torch.distributed.checkpoint.metadata as md
    from torch.serialization import _get_layout
    from distlm.checkpoint.safe_dcp import ALLOWED_GLOBALS
    out = {f"member {m.name}": [m._name_, m._value_, sorted(vars(m))] for m in md._MEM_FORMAT_ENCODING}
    for (module, name), obj in ALLOWED_GLOBALS.items():
        if isinstance(obj, type):
            out[f"{module}.{name}"] = sorted(vars(obj))
        elif isinstance(obj, torch.dtype):
            out[f"{module}.{name}"] = [str(obj), obj.itemsize, obj.is_floating_point]
    _get_layout("torch.strided")  # fills its cache on first use: not a change a load made
    out["layouts"] = sorted(f"{k}={v}" for k, v in _get_layout.cache.items())
    out["TensorProperties pickle"] = pickle.dumps(md.TensorProperties()).hex()
    return out


def child(work: Path) -> dict:
    """In a fresh process, for each case in turn: load its crafted checkpoint, then save a
    fresh one and load that back. Each case's changes are measured across its own load."""
    results = {}
    for case_dir in sorted(p for p in work.iterdir() if p.is_dir()):
        before = shared_state()
        try:
            ckpt.load_checkpoint(case_dir / "checkpoints" / "step_0000002", *fresh_model())
            refused = None
        except CheckpointError as e:
            refused = str(e)
        after = shared_state()
        model, opt = tiny_model(seed=3)
        reload = "ok"
        try:
            fresh = save(case_dir / "fresh", 3, model, opt)
            back, back_opt = fresh_model()
            ckpt.load_checkpoint(fresh, back, back_opt)
            ckpt.verify_checkpoint(fresh)
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
        except Exception as e:
            reload = f"{e.__class__.__name__}: {e}"
        results[case_dir.name] = {"refused": refused, "reload": reload,
                                  "changed": sorted(k for k in before if before[k] != after.get(k))}
    return results


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("untrusted") / "checkpoints", 2)


def crafted_copy(base: Path, where: Path, metadata: bytes) -> Path:
    folder = where / "checkpoints" / base.name
    shutil.copytree(base, folder)
    (folder / ".metadata").write_bytes(metadata)
    rehash(folder)
    return folder


@pytest.fixture(scope="module")
def poisoned(base, tmp_path_factory) -> tuple[Path, dict]:
    """Every POISON case loaded in one fresh process (one start-up for all)."""
    work = tmp_path_factory.mktemp("poison")
    for case, ops in POISON.items():
        crafted_copy(base, work / case, with_tail((base / ".metadata").read_bytes(), ops))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, __file__, str(work)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return work, json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(POISON))
def test_a_crafted_metadata_cannot_change_the_process_that_loads_it(case, poisoned):
    work, results = poisoned
    got = results[case]
    assert got["changed"] == [], f"{case}: the load changed {got['changed']}"
    assert got["reload"] == "ok", f"{case}: a fresh save in that process does not load back: {got['reload']}"
    # refused in one line naming the file: a file that tries this is not a checkpoint distlm wrote
    folder = work / case / "checkpoints" / "step_0000002"
    assert got["refused"] and "\n" not in got["refused"], got
    assert str(folder / ".metadata") in got["refused"] and "refused to load" in got["refused"], got["refused"]
    # and the fresh save loads in this (clean) process too: what `distlm eval` would do
    model, _ = fresh_model()
    ckpt.load_checkpoint(work / case / "fresh" / "step_0000003", model)


def test_the_unpickler_hands_out_no_real_global(base):
    """The real metadata rebuilt: fresh objects of DCP's classes, none taken from the pickle."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    from distlm.checkpoint.safe_dcp import _Global, _Made, _MetadataUnpickler, read_dcp_metadata
    with open(base / ".metadata", "rb") as fh:
        tree = _MetadataUnpickler(fh, "x").load()
    assert isinstance(tree, _Made) and isinstance(tree.cls, _Global)
    md = read_dcp_metadata(base / ".metadata")
    assert type(md) is Metadata
    entry = md.state_dict_metadata["model.tok_emb.weight"]
    assert type(entry) is TensorStorageMetadata and entry.properties.memory_format is torch.contiguous_format
    assert entry.properties.dtype is torch.float32 and entry.size == torch.Size([64, 32])


def test_resume_past_a_poisoning_checkpoint_keeps_later_checkpoints_usable(tmp_path):
    """The scenario of 2026-11-27 end to end: a run's newest checkpoint carries the enum
    BUILD; `distlm train train.resume=auto` must skip it (named as corrupt), resume from the
    one before, and every checkpoint it writes must then load (`distlm eval` would)."""
    from fault_harness import CLI_TINY, child_env, train_cmd
    from distlm.cli import main
    root = tmp_path / "runs"
    assert main(["train", *CLI_TINY, "train.max_steps=4", "train.keep_last=5", f"log.root={root}",
                 "log.name=r"]) == 0
    newest = root / "r" / "checkpoints" / "step_0000004"
    (newest / ".metadata").write_bytes(with_tail((newest / ".metadata").read_bytes(),
                                                 POISON["enum-member-value"]))
    rehash(newest)
    p = subprocess.run(train_cmd(root, "r", "train.max_steps=8", "train.resume=auto", "train.keep_last=5"),
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"skipping corrupt checkpoint {newest}" in p.stdout and "resumed from" in p.stdout, p.stdout
    for step in (6, 8):
        folder = root / "r" / "checkpoints" / f"step_{step:07d}"
        ckpt.verify_checkpoint(folder)
        overrides = [o for o in CLI_TINY]
        from fault_harness import fresh_model_and_optimizer
        model, opt = fresh_model_and_optimizer(overrides)
        ckpt.load_checkpoint(folder, model, opt)


# ---- storage paths and special files ----------------------------------------------------------
def retarget(metadata: bytes, old: str, new: str) -> bytes:
    """The metadata with one storage file name replaced (SHORT_BINUNICODE, frame fixed)."""
    data = metadata.replace(_s(old), _s(new))
    assert data != metadata
    if data[2] == 0x95:
        data = data[:3] + struct.pack("<Q", len(data) - 11) + data[11:]
    return data


def test_a_storage_path_outside_the_checkpoint_is_refused(base, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(base / "__0_0.distcp", elsewhere / "x.distcp")
    for target in (str(elsewhere / "x.distcp"), "../elsewhere/x.distcp", "sub/../../x.distcp"):
        case = tmp_path / target.replace("/", "_")
        folder = crafted_copy(base, case, retarget((base / ".metadata").read_bytes(), "__0_0.distcp", target))
        for load in (lambda: ckpt.load_checkpoint(folder, *fresh_model()), lambda: ckpt.verify_checkpoint(folder)):
            with pytest.raises(CorruptCheckpoint) as e:
                load()
            msg = str(e.value)
            assert "\n" not in msg and str(folder / ".metadata") in msg and target in msg, msg
            assert "not a .distcp file in the checkpoint folder" in msg, msg


@pytest.mark.parametrize("kind", ["fifo", "symlink-out", "symlink-in"])
def test_a_data_file_that_is_not_a_regular_file_is_refused(kind, base, tmp_path):
    folder = tmp_path / "checkpoints" / base.name
    shutil.copytree(base, folder)
    data = folder / "__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    shutil.copy(data, outside)
    data.unlink()
    if kind == "fifo":
        os.mkfifo(data)
    elif kind == "symlink-out":
        os.symlink(outside, data)
    else:
        shutil.copy(outside, folder / "copy.distcp")
        os.symlink("copy.distcp", data)
    if kind != "fifo":
        rehash(folder)  # the attacker controls the marker too: the link's target hashes right
    # with and without checksums in the marker: an old marker must not hang on a FIFO either
    for strip_files in (False, True):
        if strip_files:
            meta = json.loads((folder / ckpt.MARKER).read_text())
            meta.pop("files", None)
            (folder / ckpt.MARKER).write_text(ckpt.marker_text(meta))
        with pytest.raises(CorruptCheckpoint) as e:
            ckpt.load_checkpoint(folder, *fresh_model())
        msg = str(e.value)
        assert "\n" not in msg and "__0_0.distcp" in msg and "not a regular file" in msg, msg
        assert ("a FIFO" if kind == "fifo" else "a symbolic link") in msg, msg


@pytest.mark.parametrize("name", [ckpt.MARKER, ".metadata", "rng/rank_00000.pt"])
def test_a_checkpoint_file_as_a_fifo_or_link_is_refused_without_hanging(name, base, tmp_path):
    for kind in ("fifo", "symlink"):
        folder = tmp_path / kind / "checkpoints" / base.name
        shutil.copytree(base, folder)
        target = folder / name
        if kind == "fifo":
            target.unlink()
            os.mkfifo(target)
        else:
            moved = tmp_path / kind / "moved"
            shutil.move(target, moved)
            os.symlink(moved, target)
        with pytest.raises(CheckpointError) as e:
            ckpt.load_checkpoint(folder, *fresh_model())
        msg = str(e.value)
        assert "\n" not in msg and str(target) in msg, msg
        assert ("a FIFO" if kind == "fifo" else "a symbolic link") in msg, msg


if __name__ == "__main__":
    print(json.dumps(child(Path(sys.argv[1]))))


# ---- the marker's config ------------------------------------------------------------------
EDITS = [("n_head", '"n_head": 2', '"n_head": 4'), ("norm_eps", '"norm_eps": 1e-05', '"norm_eps": 1e-04'),
         ("logit_softcap", '"logit_softcap": 0.0', '"logit_softcap": 1.0'),
         ("block_size", '"block_size": 16', '"block_size": 18'), ("norm_eps", '"norm_eps": 1e-05', '"norm_eps": NaN')]


@pytest.mark.parametrize("field,old,new", EDITS, ids=[e[2].replace('"', "").replace(" ", "") for e in EDITS])
def test_an_edit_of_the_markers_config_is_refused_naming_the_field(field, old, new, base, tmp_path, capsys):
    from distlm.cli import main
    from distlm.model.load import load_model
    folder = tmp_path / "checkpoints" / base.name
    shutil.copytree(base, folder)
    marker = folder / ckpt.MARKER
    text = marker.read_text()
    assert text.count(old) == 1, old
    marker.write_text(text.replace(old, new))
    with pytest.raises(CorruptCheckpoint) as e:
        load_model(folder)  # what eval, generate and export build the model with
    msg = str(e.value)
    assert "\n" not in msg and str(marker) in msg and f"model.{field}" in msg, msg
    assert main(["eval", "--checkpoint", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"model.{field}" in err[0], err


def test_a_marker_without_the_covered_config_still_loads_with_a_note(base, tmp_path, capsys):
    """Checkpoints saved before 2026-11-27 have checksums but no run-config.json: they load as
    before, and say once that an edit of their config would go unnoticed."""
    folder = tmp_path / "checkpoints" / base.name
    shutil.copytree(base, folder)
    (folder / "run-config.json").unlink()
    meta = json.loads((folder / ckpt.MARKER).read_text())
    del meta["files"]["run-config.json"]
    (folder / ckpt.MARKER).write_text(ckpt.marker_text(meta))
    memo = ckpt.VerifiedFiles()
    ckpt.load_checkpoint(folder, *fresh_model(), memo=memo)
    ckpt.load_checkpoint(folder, *fresh_model(), memo=memo)
    err = capsys.readouterr().err
    assert err.count("config is not covered by its checksums") == 1, err


def test_the_saved_config_is_covered_by_the_checksums(base, tmp_path):
    folder = tmp_path / "checkpoints" / base.name
    shutil.copytree(base, folder)
    meta = json.loads((folder / ckpt.MARKER).read_text())
    assert "run-config.json" in meta["files"]
    assert json.loads((folder / "run-config.json").read_text()) == meta["config"]
    saved = json.loads((folder / "run-config.json").read_text())
    saved["model"]["n_head"] = 4
    (folder / "run-config.json").write_text(json.dumps(saved, indent=1))
    with pytest.raises(CorruptCheckpoint, match="run-config.json does not match its sha256 checksum"):
        ckpt.load_checkpoint(folder, *fresh_model())


# ---- RNG files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["short", "invalid-mt19937", "cuda-2d"])
def test_an_rng_file_of_the_wrong_size_or_content_is_one_line(state, base, tmp_path):
    folder = tmp_path / "checkpoints" / base.name
    shutil.copytree(base, folder)
    rng = folder / "rng" / "rank_00000.pt"
    cpu = torch.get_rng_state()
    value = {"short": {"cpu": cpu[:10]}, "invalid-mt19937": {"cpu": torch.full_like(cpu, 255)},
             "cuda-2d": {"cpu": cpu, "cuda": torch.zeros(2, 8, dtype=torch.uint8)}}[state]
    torch.save(value, rng)
    rehash(folder)
    before = torch.get_rng_state()
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.load_checkpoint(folder, *fresh_model())
    msg = str(e.value)
    assert "\n" not in msg and str(rng) in msg and "RNG state" in msg, msg
    assert torch.equal(torch.get_rng_state(), before)


def test_a_linked_checkpoint_folder_is_never_picked_from_a_run(base, tmp_path):
    """`distlm eval RUN` takes the newest complete checkpoint: one that is a link to a folder
    elsewhere is not read (it counts as torn), the newest real one is."""
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(base, root / base.name)
    elsewhere = tmp_path / "elsewhere" / "step_0000009"
    shutil.copytree(base, elsewhere)
    os.symlink(elsewhere, root / "step_0000009")
    assert ckpt.resolve_checkpoint(tmp_path / "run") == root / base.name
    assert ckpt.list_checkpoints(root) == ([root / base.name], [root / "step_0000009"])
