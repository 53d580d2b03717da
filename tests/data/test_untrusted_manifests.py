"""Names that a data folder's files give for other files (a manifest's shards and tokenizer,
a classification manifest's splits, a Hugging Face save_to_disk state.json's data files)
stay in that folder, like DCP storage names and HF index names; every manifest field has
the type prepare writes; and the files distlm reads by a fixed name (manifest.json,
tokenizer.json, an HF config.json) are regular files, a FIFO, a folder or a device named
for what it is, in one line, without hanging."""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from distlm.data import DataError, load_manifest
from distlm.data.tokenizer import load_tokenizer

SECRET = "root:x:0:0:root:/root:/bin/bash\n"

ESCAPES = ["../outside.bin", "/etc/passwd", "sub/train.bin", "..", ".", "", "a\\b", "x\0y"]


def copy_data(tiny_data: Path, tmp_path: Path) -> Path:
    out = tmp_path / "data"
    shutil.copytree(tiny_data, out)
    return out


def edit_manifest(folder: Path, edit) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def refused(folder: Path, *words: str) -> str:
    with pytest.raises(DataError) as e:
        load_manifest(folder)
    msg = str(e.value)
    assert "\n" not in msg and str(folder / "manifest.json") in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("name", ESCAPES + [5, None, ["a"]])
def test_a_shard_name_out_of_the_folder_is_refused(name, tiny_data, tmp_path):
    folder = copy_data(tiny_data, tmp_path)
    (tmp_path / "outside.bin").write_text(SECRET)
    edit_manifest(folder, lambda m: m["splits"]["train"]["shards"][0].update(file=name))
    refused(folder, "file")


@pytest.mark.parametrize("name", ESCAPES)
def test_a_tokenizer_file_out_of_the_folder_is_refused(name, tiny_data, tmp_path):
    folder = copy_data(tiny_data, tmp_path)
    edit_manifest(folder, lambda m: m["tokenizer"].update(file=name))
    refused(folder, "tokenizer.file")


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(dtype="float64"), "dtype"),
    (lambda m: m.update(dtype="object"), "dtype"),
    (lambda m: m.update(dtype=["uint16"]), "dtype"),
    (lambda m: m.update(splits=[1, 2]), "splits"),
    (lambda m: m["splits"].update(train=5), "splits.train"),
    (lambda m: m["splits"]["train"].update(shards={"a": 1}), "splits.train"),
    (lambda m: m["splits"]["train"].update(tokens="many"), "splits.train.tokens"),
    (lambda m: m["splits"]["train"]["shards"].append(7), "shards[1]"),
    (lambda m: m["splits"]["train"]["shards"][0].update(tokens="10"), "tokens"),
    (lambda m: m["splits"]["train"]["shards"][0].update(tokens=-1), "tokens"),
    (lambda m: m["splits"]["train"]["shards"][0].update(tokens=10 ** 30), "tokens"),
    (lambda m: m["splits"]["train"]["shards"][0].update(sha256=5), "sha256"),
], ids=["float64", "object", "dtype-list", "splits-list", "split-int", "shards-dict", "split-tokens", "shard-int",
        "tokens-str", "tokens-negative", "tokens-huge", "sha-int"])
def test_a_manifest_field_of_the_wrong_type_is_one_line(edit, words, tiny_data, tmp_path):
    folder = copy_data(tiny_data, tmp_path)
    edit_manifest(folder, edit)
    refused(folder, words)


def test_a_prepared_folder_still_loads(tiny_data):
    assert load_manifest(tiny_data)["dtype"] in ("uint16", "uint32")


def test_a_run_cannot_train_on_a_file_outside_its_data_folder(tiny_data, tmp_path, capsys):
    from distlm.cli import main
    folder = copy_data(tiny_data, tmp_path)
    target = tmp_path / "secret.bin"
    target.write_bytes(b"\x01\x00" * 4096)
    edit_manifest(folder, lambda m: m["splits"]["train"]["shards"][0].update(file="../secret.bin", tokens=4096))
    code = main(["train", f"data.dir={folder}", "model.n_layer=1", "model.n_head=2", "model.d_model=32",
                 "model.d_ff=64", "model.block_size=16", "train.global_batch_size=2", "train.micro_batch_size=2",
                 "train.max_steps=1", "train.device=cpu", f"log.root={tmp_path / 'runs'}", "log.progress=false",
                 "log.tensorboard=false", "train.eval_every=0", "data.verify_checksums=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "../secret.bin" in err[0], err


# ---- save_to_disk state.json ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.arrow", "/etc/passwd", "sub/x.arrow", ".."])
def test_a_save_to_disk_data_file_out_of_the_folder_is_refused(name, tmp_path):
    from distlm.corpus.formats import hf_arrow_files
    ds = tmp_path / "ds"
    ds.mkdir()
    (tmp_path / "outside.arrow").write_text("x")
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
    with pytest.raises(DataError) as e:
        hf_arrow_files(ds)
    assert "\n" not in str(e.value) and "state.json" in str(e.value) and "_data_files[0]" in str(e.value)


@pytest.mark.parametrize("kind, word", [("folder", "a folder"), ("fifo", "a FIFO")])
def test_a_save_to_disk_data_file_that_is_not_a_file_is_named(kind, word, tmp_path):
    from distlm.corpus.formats import hf_arrow_files
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "x.arrow"}]}))
    (ds / "x.arrow").mkdir() if kind == "folder" else os.mkfifo(ds / "x.arrow")
    with pytest.raises(DataError) as e:
        hf_arrow_files(ds)
    assert word in str(e.value) and "missing" not in str(e.value)


@pytest.mark.parametrize("name", ["../outside.npz", "/etc/passwd", 5])
def test_a_classification_split_file_out_of_the_folder_is_refused(name, tmp_path):
    from distlm.tasks.classify.data import load_split
    folder = tmp_path / "cls"
    folder.mkdir()
    with pytest.raises(DataError) as e:
        load_split(folder, {"splits": {"train": {"file": name, "rows": 1}}}, "train")
    assert "\n" not in str(e.value) and "splits.train.file" in str(e.value)


# ---- files read by a fixed name: regular files only ----------------------------------------
def special(path: Path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    if kind == "folder":
        path.mkdir()
        return "a folder"
    os.symlink("/dev/zero", path)
    return "a character device"


def within(seconds: float, fn):
    """fn() in a thread: what it raised, or AssertionError when it hangs."""
    out = []

    def go():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert out, "hung"
    return out[0]


KINDS = ["fifo", "folder", "device"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_manifest_that_is_not_a_file_is_named_for_what_it_is(kind, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    word = special(folder / "manifest.json", kind)
    e = within(10, lambda: load_manifest(folder))
    assert isinstance(e, DataError) and word in str(e) and "not found" not in str(e), e


@pytest.mark.parametrize("kind", KINDS)
def test_a_tokenizer_json_that_is_not_a_file_is_named_for_what_it_is(kind, tmp_path):
    word = special(tmp_path / "tokenizer.json", kind)
    e = within(10, lambda: load_tokenizer("bpe:300", tmp_path))
    assert isinstance(e, DataError) and word in str(e) and "missing" not in str(e) and "\n" not in str(e), e


@pytest.mark.parametrize("kind", KINDS)
def test_an_hf_config_that_is_not_a_file_is_named_for_what_it_is(kind, tmp_path):
    from distlm.config import ModelConfig
    from distlm.interop.hf import InteropError
    from distlm.interop.hf_load import apply_hf_model_config
    word = special(tmp_path / "config.json", kind)
    e = within(10, lambda: apply_hf_model_config(ModelConfig(), tmp_path))
    assert isinstance(e, InteropError) and word in str(e) and "missing" not in str(e), e


@pytest.mark.parametrize("field, value", [("n_layer", "12"), ("n_embd", 7.5), ("n_head", True), ("n_positions", -1),
                                          ("layer_norm_epsilon", "small"), ("n_layer", 10 ** 40),
                                          ("scale_attn_weights", "yes"), ("activation_function", 3),
                                          ("n_inner", "big")])
def test_an_hf_config_field_of_the_wrong_type_is_one_line(field, value, tmp_path):
    from distlm.config import ModelConfig
    from distlm.interop.hf import InteropError
    from distlm.interop.hf_load import apply_hf_model_config
    conf = {"model_type": "gpt2", "n_layer": 1, "n_head": 4, "n_embd": 32, "n_positions": 32, "vocab_size": 100,
            field: value}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(InteropError) as e:
        apply_hf_model_config(ModelConfig(), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and field in msg and len(msg) < 300, msg


@pytest.mark.parametrize("text", ["[1, 2]", "not json", "\"a string\""])
def test_an_hf_config_that_is_not_an_object_is_one_line(text, tmp_path):
    from distlm.config import ModelConfig
    from distlm.interop.hf import InteropError
    from distlm.interop.hf_load import apply_hf_model_config
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(InteropError) as e:
        apply_hf_model_config(ModelConfig(), tmp_path)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("text", ["x" * 10_500, "ab" * 3000 + "\n" + "y" * 7000, "z" * 999 + " " + "w" * 5000])
def test_no_piece_handed_to_a_tokenizer_exceeds_the_hard_cut(text, monkeypatch):
    """A whitespace-free run longer than HARD_CUT is cut there: tiktoken aborted the process on
    a multi-GB one. The pieces still join to the text."""
    from distlm.data import tokenizer as tkz
    monkeypatch.setattr(tkz, "HARD_CUT", 1000)
    pieces = list(tkz.split_for_encoding(text, 100))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 1000
