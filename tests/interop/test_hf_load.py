"""A Hugging Face folder from someone else (2026-11-27): damaged or hostile safetensors
headers, pickled ``pytorch_model.bin`` files and indexes that point out of the folder are
each refused in one line naming the file, before a weight is copied, and nothing runs."""
from __future__ import annotations

import json
import math
import os
import pickle
import struct
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.checkpoints import _Reduce  # noqa: E402

from distlm.config import ModelConfig  # noqa: E402
from distlm.interop.hf import InteropError  # noqa: E402
from distlm.interop.hf_load import apply_hf_model_config, load_hf_into  # noqa: E402
from distlm.model.gpt import GPT  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    conf = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    transformers.GPT2LMHeadModel(conf).save_pretrained(out)
    return out


def header_and_data(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(f: Path, header: dict, data: bytes, claimed: int | None = None) -> None:
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text) if claimed is None else claimed) + text + data)


def copy_config(hf_dir: Path, out: Path) -> Path:
    out.mkdir()
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    return out


def import_into_model(folder: Path):
    cfg = apply_hf_model_config(ModelConfig(), folder)
    load_hf_into(GPT(cfg), folder)


def refused(folder: Path, names: Path | str, *words: str) -> str:
    with pytest.raises(InteropError) as e:
        import_into_model(folder)
    msg = str(e.value)
    assert "\n" not in msg and str(names) in msg and all(w in msg for w in words), msg
    return msg


def damaged_safetensors(hf_dir: Path, out: Path, case: str) -> Path:
    header, data = header_and_data(hf_dir / "model.safetensors")
    names = sorted(k for k in header if k != "__metadata__")
    first, second = header[names[0]], header[names[1]]
    claimed = None
    if case == "huge-header-length":
        claimed = 1 << 62
    elif case == "overlapping-offsets":
        begin = second["data_offsets"][0]
        first["data_offsets"] = [begin, begin + first["data_offsets"][1] - first["data_offsets"][0]]
    elif case == "dtype-mismatch":
        first["dtype"] = "F16"  # half the bytes its range holds
    elif case == "unknown-dtype":
        first["dtype"] = "F99"
    elif case == "lying-shape":
        first["shape"] = [d * 1000 for d in first["shape"]]
    elif case == "past-the-end":
        first["data_offsets"] = [len(data) - 4, len(data) + 4 * math.prod(first["shape"]) - 4]
    write_safetensors(out / "model.safetensors", header, data, claimed)
    return out / "model.safetensors"


SAFETENSORS_CASES = {"huge-header-length": "header claims", "overlapping-offsets": "overlap",
                     "dtype-mismatch": "lying shape or dtype", "unknown-dtype": "'F99'",
                     "lying-shape": "lying shape or dtype", "past-the-end": "data section"}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_a_damaged_safetensors_header_is_one_line(case, hf_dir, tmp_path):
    folder = copy_config(hf_dir, tmp_path / "hf")
    f = damaged_safetensors(hf_dir, folder, case)
    refused(folder, f, SAFETENSORS_CASES[case])


def bin_cases(sd: dict, sentinel: Path) -> dict:
    payload = _Reduce(os.system, (f"touch {sentinel}",))
    return {
        "malicious-zip": lambda f: torch.save({**sd, "x": payload}, f),
        "raw-pickle": lambda f: f.write_bytes(pickle.dumps({**sd, "x": payload})),
        "legacy-format": lambda f: torch.save({**sd, "x": payload}, f, _use_new_zipfile_serialization=False),
        "not-a-dict": lambda f: torch.save([1, 2], f),
        "garbage": lambda f: f.write_bytes(b"\x00" * 100),
    }


@pytest.mark.parametrize("case", ["malicious-zip", "raw-pickle", "legacy-format", "not-a-dict", "garbage"])
def test_a_hostile_pytorch_model_bin_is_one_line_and_runs_nothing(case, hf_dir, tmp_path):
    from safetensors.torch import load_file
    sd = load_file(hf_dir / "model.safetensors")
    folder = copy_config(hf_dir, tmp_path / "hf")
    sentinel = tmp_path / "PWNED"
    bin_cases(sd, sentinel)[case](folder / "pytorch_model.bin")
    refused(folder, folder / "pytorch_model.bin")
    assert not sentinel.exists()


def test_a_legacy_format_bin_of_plain_tensors_still_loads(hf_dir, tmp_path):
    from safetensors.torch import load_file
    folder = copy_config(hf_dir, tmp_path / "hf")
    torch.save(load_file(hf_dir / "model.safetensors"), folder / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    import_into_model(folder)


@pytest.mark.parametrize("target", ["/dev/zero", "../outside.safetensors", "sub/../../outside.safetensors",
                                    "link-to-dev-zero", "missing.safetensors", "a-folder"])
def test_an_index_pointing_out_of_the_folder_or_at_a_device_is_refused(target, hf_dir, tmp_path):
    folder = copy_config(hf_dir, tmp_path / "hf")
    os.link(hf_dir / "model.safetensors", tmp_path / "outside.safetensors")
    header, _ = header_and_data(hf_dir / "model.safetensors")
    if target == "link-to-dev-zero":
        os.symlink("/dev/zero", folder / "shard.safetensors")
        target = "shard.safetensors"
    if target == "a-folder":
        (folder / "a-folder").mkdir()
    weight_map = {k: target for k in header if k != "__metadata__"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(folder, target)


def test_an_index_into_a_shard_inside_the_folder_still_loads(hf_dir, tmp_path):
    """The HF cache layout: the shard a link to a blob elsewhere; it stays allowed."""
    folder = copy_config(hf_dir, tmp_path / "hf")
    os.symlink(hf_dir / "model.safetensors", folder / "model-00001-of-00001.safetensors")
    header, _ = header_and_data(hf_dir / "model.safetensors")
    weight_map = {k: "model-00001-of-00001.safetensors" for k in header if k != "__metadata__"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    import_into_model(folder)


def test_a_hostile_hf_folder_through_the_cli_exits_2_in_one_line(hf_dir, tmp_path, capsys):
    from distlm.cli import main
    folder = copy_config(hf_dir, tmp_path / "hf")
    damaged_safetensors(hf_dir, folder, "lying-shape")
    code = main(["train", f"init.from_hf={folder}", "data.source=synthetic", "train.device=cpu", "train.max_steps=1",
                 "train.global_batch_size=2", "train.micro_batch_size=2", "model.block_size=16",
                 f"log.root={tmp_path / 'runs'}", "log.progress=false", "log.tensorboard=false", "train.eval_every=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "lying shape" in err[0], err
