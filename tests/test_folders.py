"""A folder of the wrong kind (distlm/folders.py): the error names the kind it is and lists the
runs and checkpoints that do exist, instead of a hint for the kind the command expected."""
import json
from pathlib import Path

import pytest

from distlm.cli import main
from distlm.data import DataError, load_manifest


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    """runs/first with two complete checkpoints and a torn one; runs/empty with none; a data folder."""
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "runs" / "first"
    for step in (100, 200):
        ckpt = first / "checkpoints" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / "distlm.json").write_text(json.dumps({"step": step}))
    (first / "checkpoints" / "step_0000300").mkdir()  # torn: no marker
    (first / "config.yaml").write_text("data:\n  dir: data/books\n")
    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "data" / "books").mkdir(parents=True)
    (tmp_path / "data" / "books" / "manifest.json").write_text("{}")
    return tmp_path / "runs"


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.mark.parametrize("given, said", [
    ("runs/firts", "runs/firts: it does not exist; runs with checkpoints under runs: first (step_0000200)"),
    ("runs/first/checkpoints/step_0000123",
     "it does not exist; checkpoints of runs/first: step_0000200, step_0000100"),
    ("runs/first/checkpoints/step_0000300",
     "step_0000300: it holds no run; checkpoints of runs/first: step_0000200, step_0000100"),
    ("data/books", "data/books: it is a prepared data folder (distlm prepare)"),
], ids=["typo", "wrong-step", "torn", "data-folder"])
def test_no_checkpoint_says_what_the_path_is_and_what_exists(runs, capsys, given, said):
    assert main(["eval", "--checkpoint", given, "--device", "cpu"]) == 2
    err = one_error(capsys)
    assert err.startswith(f"error: no complete checkpoint under {given}: ") and said in err, err


@pytest.mark.parametrize("given, said", [
    ("runs/first", "runs/first is a run folder, not prepared data; the run trained on data.dir=data/books"),
    ("runs/first/checkpoints/step_0000100", "is a checkpoint folder, not prepared data; the run trained on "
                                            "data.dir=data/books"),
    ("runs", "runs is a folder of runs, not prepared data"),
], ids=["run", "checkpoint", "runs"])
def test_a_run_folder_as_data_names_its_kind_and_the_runs_data(runs, given, said):
    with pytest.raises(DataError) as e:
        load_manifest(given)
    assert said in str(e.value) and "distlm prepare" not in str(e.value), str(e.value)
    with pytest.raises(DataError, match="create it with `distlm prepare INPUT... --out nowhere`"):
        load_manifest("nowhere")  # a folder that is not there: the prepare hint is the right one


@pytest.fixture
def hf(runs) -> Path:
    """A Hugging Face folder beside the runs (its config.json is all that names the kind)."""
    folder = runs.parent / "hf" / "gpt2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return folder


@pytest.mark.parametrize("given, said", [
    ("runs/first", "runs/first is a run folder (checkpoints: step_0000200, step_0000100): "
                   "`distlm export runs/first OUT` writes its newest as a Hugging Face folder"),
    ("runs/first/checkpoints/step_0000100", "is a checkpoint folder: `distlm export "
                                            "runs/first/checkpoints/step_0000100 OUT` writes it"),
    ("runs", "runs is a folder of runs; runs with checkpoints under runs: first (step_0000200); "
             "`distlm export RUN OUT`"),
    ("data/books", "data/books is a prepared data folder (distlm prepare), for data.dir"),
    ("runs/empty", "init.from_hf needs a local Hugging Face model folder"),
    ("nowhere", "init.from_hf needs a local Hugging Face model folder; it does not exist"),
], ids=["run", "checkpoint", "runs", "data", "empty", "missing"])
def test_a_distlm_folder_as_init_from_hf_names_its_kind_and_what_exists(runs, capsys, given, said):
    assert main(["train", "--config", "tiny", f"init.from_hf={given}", "data.source=synthetic"]) == 2
    err = one_error(capsys)
    assert err.startswith(f"error: {given}/config.json: missing; ") and said in err, err


def test_a_hugging_face_folder_elsewhere_says_init_from_hf_takes_it(runs, hf, capsys):
    assert main(["eval", "--checkpoint", "hf/gpt2", "--device", "cpu"]) == 2
    assert "hf/gpt2: it is a Hugging Face model folder, for init.from_hf; " in one_error(capsys)
    with pytest.raises(DataError) as e:
        load_manifest("hf/gpt2")
    assert "hf/gpt2 is a Hugging Face model folder, not prepared data, for init.from_hf" in str(e.value)
    assert main(["eval", "--checkpoint", "data/books", "--device", "cpu"]) == 2
    assert "data/books: it is a prepared data folder (distlm prepare), for data.dir; " in one_error(capsys)
