"""task=classify: data, padding, training, DDP/FSDP2 = one process, eval/predict, bad input, bench.

A toy 4-topic set (tests/helpers/classify_data.py: topic words in shared filler) keeps the training tests to seconds;
the vendored 20 Newsgroups set is only read by the preset test. Multi-process launches:
one 2-rank torchrun for the DDP/FSDP2/resume jobs, and `bench --scaling 1,2` (two more).
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distlm.cli import main
from distlm.config import ConfigError, load_config
from distlm.tasks.classify.data import label_order, load_manifest, load_split, prepare_classify
from distlm.model.classifier import Classifier, TextBatch
from distlm.train.trainer import Trainer
from helpers.classify_data import TINY, toy_rows, write_csv

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "classify_worker.py"


def one_thread(fn):
    """A single intra-op thread: on the shared 2-core box two threads spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("classify")


@pytest.fixture(scope="module")
def toy(root) -> Path:
    rows = [dict(r, split="train") for r in toy_rows(480, 0)] + [dict(r, split="test") for r in toy_rows(120, 1)]
    src = write_csv(root / "toy.csv", rows)
    out = root / "toy-data"
    prepare_classify([str(src)], out, label_field="topic", max_len=16, quiet=True)
    return out


@pytest.fixture(scope="module")
def trained(root, toy) -> Trainer:
    args = TINY + [f"data.dir={toy}", f"log.root={root}", "log.name=toy", "train.max_steps=60",
                   "train.global_batch_size=16", "train.micro_batch_size=16", "train.eval_every=30", "log.every=10"]
    trainer = one_thread(lambda: Trainer(load_config(None, args)))
    one_thread(trainer.train)
    return trainer


# ---- data ------------------------------------------------------------------------
def test_label_map_split_and_padding(toy):
    m = load_manifest(toy)
    assert m["labels"] == ["health", "space", "sport", "tech"] and m["split_from"] == "split column 'split'"
    assert json.loads((toy / "labels.json").read_text())["labels"] == m["labels"]
    assert m["splits"]["train"]["rows"] == 480 and m["splits"]["val"]["rows"] == 120
    assert m["splits"]["train"]["class_counts"] == [120] * 4
    train = load_split(toy, m, "train")
    from distlm.data.tokenizer import gpt2
    tok = gpt2()
    text = toy_rows(480, 0)[7]["text"]
    ids = tok.encode(text)[:16]
    assert train["lengths"][7] == len(ids) and train["tokens"][7, :len(ids)].tolist() == ids
    pad = train["tokens"] == m["pad_id"]
    assert (pad == (np.arange(16)[None, :] >= train["lengths"][:, None])).all()  # pads exactly past each length
    assert m["labels"][train["labels"][7]] == toy_rows(480, 0)[7]["topic"]
    assert label_order({"10", "2", "1"}) == ["1", "2", "10"]


def test_hash_holdout_is_deterministic(root):
    src = write_csv(root / "nosplit.csv", toy_rows(200, 3))
    a = prepare_classify([str(src)], root / "h1", label_field="topic", val_fraction=0.2, seed=5, quiet=True)
    b = prepare_classify([str(src)], root / "h2", label_field="topic", val_fraction=0.2, seed=5, quiet=True)
    assert a["splits"] == b["splits"] and 20 <= a["splits"]["val"]["rows"] <= 60
    assert a["split_from"].startswith("hash hold-out")
    assert np.array_equal(load_split(root / "h1", a, "val")["tokens"], load_split(root / "h2", b, "val")["tokens"])


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
@pytest.mark.parametrize("pooling", ["mean", "first", "last"])
def test_padding_never_changes_the_prediction(attention, pooling):
    cfg = load_config(None, ["model.vocab_size=300", "model.n_layer=2", "model.d_model=32", "model.n_head=4",
                             "model.d_ff=64", "model.block_size=16"]).model
    torch.manual_seed(0)
    model = Classifier(cfg, 3, pooling, attention).eval()
    short = torch.randint(0, 256, (1, 5))
    alone = model(TextBatch(short, torch.tensor([5]), False))
    ids = torch.full((2, 12), 299)
    ids[0, :5], ids[1] = short[0], torch.randint(0, 256, (12,))
    batched = model(TextBatch(ids, torch.tensor([5, 12]), True))
    torch.testing.assert_close(batched[0], alone[0], rtol=1e-5, atol=1e-5)
    ids[0, 5:] = torch.randint(0, 256, (7,))  # garbage in the padded slots changes nothing either
    torch.testing.assert_close(model(TextBatch(ids, torch.tensor([5, 12]), True))[0], alone[0], rtol=1e-5, atol=1e-5)


# ---- training, eval, predict -------------------------------------------------------
def test_short_training_beats_the_majority_class(trained, root):
    last = trained.task.last
    assert last["examples"] == 120 and last["step"] == 60
    assert last["accuracy"] > last["majority_baseline"] + 0.3, last
    assert 0 < last["macro_f1"] <= 1
    run = root / "toy"
    assert json.loads((run / "eval-val.json").read_text())["confusion"] == last["confusion"]
    with open(run / "classify_metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [30, 60]
    import matplotlib.image
    img = matplotlib.image.imread(run / "confusion-val.png")
    assert img.ndim == 3 and img.shape[0] > 100
    assert json.loads((run / "labels.json").read_text())["labels"] == ["health", "space", "sport", "tech"]


def test_the_loss_plot_of_a_classifier_is_per_text(trained, root, monkeypatch):
    from distlm.report import plot as plot_module
    labels = []
    real = plot_module.save_figure
    monkeypatch.setattr(plot_module, "save_figure",
                        lambda fig, out, **kw: labels.append(fig.axes[0].get_ylabel()) or real(fig, out, **kw))
    plot_module.plot_runs([root / "toy"], root / "toy-loss.png")
    assert labels == ["cross-entropy loss (nats/text)"]


def test_eval_cli_reports_accuracy_and_confusion_png(trained, root, capsys):
    assert main(["eval", "--checkpoint", str(root / "toy"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["accuracy"] == pytest.approx(trained.task.last["accuracy"]) and r["examples"] == 120
    import matplotlib.image
    assert matplotlib.image.imread(r["confusion_png"]).ndim == 3
    # the training's own evaluation wrote the same two files: one of each, not two names
    assert r["confusion_png"] == str(root / "toy" / "confusion-val.png")
    assert sorted(p.name for p in (root / "toy").glob("*.png") if "confusion" in p.name) == ["confusion-val.png"]
    assert sorted(p.name for p in (root / "toy").glob("eval*.json")) == ["eval-val.json"]


def test_a_classifiers_eval_through_a_pipe_says_how_far_it_is(trained, capsys):
    """No bar in a pipe: a line at each tenth of the batches, on stderr, as they are done (as a
    language model's `distlm eval` does), instead of nothing until the end."""
    from distlm.tasks.classify.predict import predict_probs
    rows = trained.task.val_data
    probs = predict_probs(trained.module, rows["tokens"], rows["lengths"], torch.device("cpu"), batch_size=10, desc="eval")
    assert probs.shape == (120, 4)
    assert capsys.readouterr().err.splitlines() == [f"eval: {n}/12 batches" for n in (2, 3, 4, 5, 6, 8, 9, 10, 11)]


def test_predict_writes_labels_and_probabilities(trained, root, capsys):
    texts = ["the rocket and the moon orbit", "a doctor at the hospital", "the team and the coach win the match"]
    src = root / "texts.txt"
    src.write_text("\n".join(texts) + "\n")
    assert main(["predict", "--checkpoint", str(root / "toy"), "--input", str(src), "--out", str(root / "p.csv")]) == 0
    assert main(["predict", "--checkpoint", str(root / "toy"), "--input", str(src), "--out", str(root / "p.jsonl")]) == 0
    with open(root / "p.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    labels = ["health", "space", "sport", "tech"]
    assert list(rows[0]) == ["index", "label"] + [f"prob_{n}" for n in labels]
    js = [json.loads(line) for line in (root / "p.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == [j["label"] for j in js] == ["space", "health", "sport"]
    for r, j in zip(rows, js):
        probs = [float(r[f"prob_{n}"]) for n in labels]
        assert math.isclose(sum(probs), 1.0, abs_tol=1e-4) and labels[int(np.argmax(probs))] == r["label"]
        assert math.isclose(j["probs"][j["label"]], max(j["probs"].values()))


# ---- bad input: one line, the file/field/value named, exit 2, nothing written ---------
def _prepare_fails(tmp_path, capsys, rows, *args) -> str:
    src = write_csv(tmp_path / "bad.csv", rows)
    out = tmp_path / "out"
    assert main(["prepare", "--task", "classify", str(src), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and str(src) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv"]  # no out/, no temporary folder
    return err


def test_unknown_label_column(tmp_path, capsys):
    err = _prepare_fails(tmp_path, capsys, toy_rows(8, 0), "--label-field", "category")
    assert "no column 'category'" in err and "text, topic" in err


def test_empty_text(tmp_path, capsys):
    rows = toy_rows(8, 0)
    rows[5]["text"] = "   "
    err = _prepare_fails(tmp_path, capsys, rows, "--label-field", "topic")
    assert "row 7: empty text in field 'text'" in err  # row 1 is the header


def test_label_seen_only_in_test(tmp_path, capsys):
    rows = [dict(r, split="train") for r in toy_rows(8, 0)] + [{"text": "a new thing", "topic": "weather",
                                                               "split": "test"}]
    err = _prepare_fails(tmp_path, capsys, rows, "--label-field", "topic")
    assert "row 10: label 'weather' (field 'topic') appears only in the held-out split" in err


def test_predict_refuses_an_empty_text(trained, root, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("fine text\n\nmore\n")
    assert main(["predict", "--checkpoint", str(root / "toy"), "--input", str(src),
                 "--out", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {src}: row 2: empty text in field 'text'" and not (tmp_path / "o.csv").exists()


@pytest.mark.parametrize("key", ["parallel.tp=2", "parallel.pp=2"])
def test_tensor_and_pipeline_parallel_are_refused(key, capsys):
    with pytest.raises(ConfigError, match=f"task.name=classify does not support {key}"):
        load_config(None, ["task=classify", key])
    assert main(["train", "task=classify", key]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_trunk_starts_from_an_lm_checkpoint(root, toy):
    lm_args = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=24",
               "model.vocab_size=50257", "model.position=learned", "data.source=synthetic", "train.max_steps=2",
               "train.global_batch_size=4", "train.micro_batch_size=4", "log.progress=false",
               "log.tensorboard=false", f"log.root={root}", "log.name=lm", "train.eval_every=0"]
    lm = one_thread(lambda: Trainer(load_config(None, lm_args)))
    one_thread(lm.train)
    # The preset says 2 layers x 64; init_from replaces the trunk's shape with the LM's.
    cls = Trainer(load_config(None, TINY + ["model.n_layer=2", "model.d_model=64", f"data.dir={toy}",
                                            f"task.init_from={root / 'lm'}", f"log.root={root}", "log.name=ft",
                                            "train.max_steps=1"]))
    assert cls.cfg.model.n_layer == 1 and cls.cfg.model.d_model == 32
    lm_params = dict(lm.module.named_parameters())
    for name, p in cls.module.named_parameters():
        if not name.startswith("cls_head."):
            assert torch.equal(p, lm_params[name]), name


# ---- data parallel = one process -----------------------------------------------------
STEPS = 6
DIST = TINY + ["train.max_steps=6", "train.global_batch_size=16", "train.grad_clip=0.3", "train.eval_every=3",
               "train.checkpoint_every=3", "train.keep_last=5", "log.every=1", "parallel.timeout_s=60"]


def trace(run_dir: Path) -> dict[int, tuple[float, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): (float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(f) if r["loss"]}


@pytest.fixture(scope="module")
def parallel_runs(root, toy) -> dict:
    ref = DIST + [f"data.dir={toy}", f"log.root={root}", "log.name=ref", "train.micro_batch_size=16"]
    one_thread(lambda: Trainer(load_config(None, ref)).train())

    def job(name, *extra):
        return {"name": name, "overrides": DIST + [f"data.dir={toy}", f"log.root={root}", f"log.name={name}",
                                                   "train.micro_batch_size=8", *extra]}
    jobs = [job("ddp2", "parallel.dp_replicate=2"),
            job("ddp2_accum", "parallel.dp_replicate=2", "train.micro_batch_size=4"),
            job("fsdp2", "parallel.dp_shard=2"),
            job("ddp2_to_fsdp2", "parallel.dp_shard=2",
                f"train.resume={root / 'ddp2' / 'checkpoints' / 'step_0000003'}")]
    plan, out = root / "plan.json", root / "results.json"
    plan.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    env = dict(os.environ, OMP_NUM_THREADS="1")  # keeps PYTHONPATH: the children import this tree
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(WORKER), str(plan)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.dist
@pytest.mark.parametrize("name", ["ddp2", "ddp2_accum", "fsdp2", "ddp2_to_fsdp2"])
def test_two_ranks_match_one_process(root, parallel_runs, name):
    ref, got = trace(root / "ref"), trace(root / name)
    steps = range(4 if name == "ddp2_to_fsdp2" else 1, STEPS + 1)
    assert sorted(got) == list(steps)
    for s in steps:
        for what, a, b in zip(("loss", "grad_norm"), got[s], ref[s]):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5), f"{name} step {s} {what}: {a} vs {b}"
    ranks = parallel_runs[name]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["model_type"] == ("DistributedDataParallel" if name.startswith("ddp2") and "fsdp" not in name
                                      else "FSDPClassifier")
    ref_eval = json.loads((root / "ref" / "eval-val.json").read_text())
    assert ranks[0]["last_eval"]["confusion"] == ref_eval["confusion"]  # every val row counted once
    assert math.isclose(ranks[0]["last_eval"]["val_loss"], ref_eval["val_loss"], rel_tol=1e-5)
    if name == "ddp2_to_fsdp2":
        assert {r["start_step"] for r in ranks} == {3}


# ---- bench ---------------------------------------------------------------------------
@pytest.mark.dist
def test_bench_reports_time_per_epoch_at_one_and_two_ranks(root, toy, monkeypatch):
    from distlm.bench import scaling
    monkeypatch.chdir(root)
    overrides = TINY + [f"data.dir={toy}", "train.global_batch_size=16", "train.micro_batch_size=8",
                        "log.root=bench-runs"]
    text = scaling.run_scaling([1, 2], None, overrides, "dp_replicate", "weak", 1, 3, root / "scaling")
    assert "| examples/s | epoch s |" in text
    rows = json.loads((root / "scaling" / "scaling-weak.json").read_text())["rows"]
    assert [r["gpus"] for r in rows] == [1, 2] and [r["global_batch"] for r in rows] == [16, 32]
    raw = json.loads((root / "scaling" / "scaling-weak.json").read_text())["raw"]
    for r in raw:
        assert r["task"] == "classify" and r["train_examples"] == 480
        assert r["steps_per_epoch"] == math.ceil(480 / r["global_batch_size"])
        assert r["epoch_s"] == pytest.approx(r["step_s"] * r["steps_per_epoch"])
    assert raw[1]["exposed_comm_s"] is not None


# ---- CUDA (on a CUDA machine: python3 -m pytest -q -m gpu tests/tasks/test_classify.py) ----
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masked_bf16_attention_on_cuda_under_the_trainers_kernel_order():
    """Padding changes nothing (to bf16 rounding) and backward runs, inside the Trainer's
    SDPA priority (cuDNN first), where the classifier routes masked batches elsewhere."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = load_config(None, ["model.vocab_size=300", "model.n_layer=2", "model.d_model=128", "model.n_head=4",
                             "model.d_ff=256", "model.block_size=64"]).model
    torch.manual_seed(0)
    model = Classifier(cfg, 4).cuda()
    short = torch.randint(0, 256, (1, 20), device="cuda")
    ids = torch.full((3, 64), 299, device="cuda")
    ids[0, :20], ids[1:] = short[0], torch.randint(0, 256, (2, 64), device="cuda")
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(order, set_priority=True):
        alone = model(TextBatch(short, torch.tensor([20], device="cuda"), False)).float()
        batched = model(TextBatch(ids, torch.tensor([20, 64, 64], device="cuda"), True)).float()
        batched.sum().backward()
    assert (batched[0] - alone[0]).abs().max() < 3e-2 * alone.abs().max() + 1e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
