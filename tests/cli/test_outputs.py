"""Where the verbs write and what they say (2026-11-27): outputs go into the run folder (or a
named --out), never the working directory or beside an input; messages speak of what the user
wrote (--device, the one input given); a setting the run changes is said; `eval` with no
--batches covers every block; the demo leaves samples.txt like any run."""
import csv
import json

import pytest
import torch

from distlm.cli import main
from distlm.config import load_config
from distlm.train.logger import COLUMNS

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "train.global_batch_size=8", "train.micro_batch_size=8", "train.warmup_steps=1", "log.progress=false",
        "log.tensorboard=false", "log.samples=0", "train.eval_batches=1"]


def fake_run(folder, losses):
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for step, loss in enumerate(losses, 1):
            w.writerow({"step": step, "tokens": step * 100, "loss": loss})
    return folder


def test_plot_writes_into_the_run_folder(tmp_path, monkeypatch, capsys):
    a, b = fake_run(tmp_path / "runs" / "a", [5.0, 4.5, 4.2]), fake_run(tmp_path / "runs" / "b", [5.1, 4.8, 4.0])
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["plot", str(a)]) == 0
    assert (a / "loss.png").is_file() and f"wrote {a / 'loss.png'}" in capsys.readouterr().out
    assert main(["plot", str(a), str(b)]) == 0
    assert (a / "compare.png").is_file() and f"wrote {a / 'compare.png'}" in capsys.readouterr().out
    assert main(["plot", str(a), "--out", "named.png"]) == 0 and (cwd / "named.png").is_file()
    assert sorted(p.name for p in cwd.iterdir()) == ["named.png"]  # nothing else in the working folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("verb", [["generate", "--prompt", "hi"], ["eval"], ["predict", "--input", "t.txt"]])
def test_device_cuda_without_cuda_speaks_of_the_flag(tmp_path, capsys, verb):
    assert main([verb[0], "--checkpoint", str(tmp_path), *verb[1:], "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --device cuda: CUDA is not available on this machine (use --device auto or cpu)"


def test_one_odd_bin_input_is_told_what_is_wrong_with_it(tmp_path, capsys):
    odd = tmp_path / "ls.bin"
    odd.write_bytes(b"\0" * 64)
    assert main(["prepare", str(odd), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {odd}: a .bin input is read as pre-tokenized tokens") and "mix" not in err
    assert "train.bin and val.bin" in err and not (tmp_path / "out").exists()
    # a real mix still says so
    for name in ("train.bin", "val.bin"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    notes = tmp_path / "notes.txt"
    notes.write_text("some text\n")
    assert main(["prepare", str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), str(notes),
                 "--out", str(tmp_path / "out")]) == 2
    assert "cannot mix with pre-tokenized .bin files" in capsys.readouterr().err


def test_short_run_says_log_every_changed_and_eval_covers_every_block(tiny_data, tmp_path, capsys):
    from distlm.data import load_manifest
    from distlm.data.loader import TokenBlocks
    from distlm.train.trainer import Trainer
    cfg = load_config(None, TINY + [f"data.dir={tiny_data}", f"log.root={tmp_path}", "log.name=short",
                                    "train.max_steps=20", "train.eval_every=0"])
    Trainer(cfg).train()
    out = capsys.readouterr().out
    assert out.count("log.every=auto: a row every step, so that this 20-step run draws about 20 points") == 1, out
    kept = load_config(None, TINY + [f"data.dir={tiny_data}", f"log.root={tmp_path}", "log.name=kept",
                                     "train.max_steps=20", "log.every=5", "train.eval_every=0"])
    Trainer(kept).train()
    assert "log.every=" not in capsys.readouterr().out  # a number given is kept, and needs no word
    assert [r["step"] for r in csv.DictReader(open(tmp_path / "kept" / "metrics.csv"))] == ["1", "5", "10", "15", "20"]

    val_blocks = len(TokenBlocks(tiny_data, "val", 16, load_manifest(tiny_data)))
    assert val_blocks % 8, "the check needs a split that is not a whole number of micro-batches"
    assert main(["eval", "--checkpoint", str(tmp_path / "short"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["blocks"] == val_blocks and result["tokens"] == val_blocks * 16
    assert main(["eval", "--checkpoint", str(tmp_path / "short")]) == 0
    assert f"over all {val_blocks:,} blocks" in capsys.readouterr().out


def test_predict_writes_into_the_run_folder(tmp_path, monkeypatch, capsys):
    from helpers.classify_data import TINY as CLASSIFY, toy_rows, write_csv

    from distlm.tasks.classify.data import prepare_classify
    from distlm.train.trainer import Trainer
    rows = [dict(r, split="train") for r in toy_rows(48, 0)] + [dict(r, split="test") for r in toy_rows(16, 1)]
    prepare_classify([str(write_csv(tmp_path / "toy.csv", rows))], tmp_path / "data", label_field="topic",
                     max_len=16, quiet=True)
    cfg = load_config(None, CLASSIFY + [f"data.dir={tmp_path / 'data'}", f"log.root={tmp_path / 'runs'}",
                                        "log.name=clf", "train.max_steps=2", "train.global_batch_size=8",
                                        "train.micro_batch_size=8", "train.eval_every=0"])
    Trainer(cfg).train()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "texts.txt").write_text("the rocket and the moon\na doctor at the hospital\n")
    monkeypatch.chdir(inputs)
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(tmp_path / "runs" / "clf"), "--input", "texts.txt"]) == 0
    dest = tmp_path / "runs" / "clf" / "texts.txt.predictions.csv"
    assert dest.is_file() and str(dest) in capsys.readouterr().out
    assert sorted(p.name for p in inputs.iterdir()) == ["texts.txt"]  # nothing beside the input


def test_demo_run_has_samples_txt(tmp_path, text_dir, monkeypatch, capsys):
    """The demo's own samples (three prompts) land in RUN/samples.txt like a run's samples.
    The vendored corpus is swapped for the small test texts: what is checked is the run folder."""
    import distlm.corpus.prepare as prep
    from distlm.cli.demo import demo
    real = prep.prepare

    def small_corpus(inputs, out, **kw):
        return real([str(text_dir)], out, **{**kw, "tokenizer": "bpe:300", "val_fraction": 0.2, "workers": 1,
                                             "progress": False})
    monkeypatch.setattr(prep, "prepare", small_corpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # what is checked is the file, not the text: a stand-in for 180 tokens of sampling
    monkeypatch.setattr("distlm.model.generate.generate_text", lambda gpt, tok, prompt, sc: [f" (seed {sc.seed})"])
    assert demo(root=str(tmp_path / "runs"), data_root=str(tmp_path / "data"), max_steps=2) == 0
    (run,) = (tmp_path / "runs").iterdir()
    text = (run / "samples.txt").read_text()
    assert text.startswith("=== step 2 === ") and text.count("--- sample ") == 3
    for i, prompt in enumerate(("It was a dark and stormy night", "The king said", "Call me Ishmael.")):
        assert f"--- sample {i} (seed {i}) ---\n{prompt} (seed {i})\n" in text
