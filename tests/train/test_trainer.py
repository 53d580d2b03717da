"""The Trainer, single process: bit-exact resume, outputs read back the way users read them."""
import csv
import re
import shutil

import pytest

from distlm.config import ConfigError, load_config
from distlm.train.run_context import run_context
from distlm.train.trainer import Trainer

TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=4", "train.eval_batches=2",
        "train.warmup_steps=2", "log.every=1", "log.progress=false", "train.seed=7"]


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["loss"]]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.max_steps=8", "train.checkpoint_every=4",
                                      "train.keep_last=5", f"log.root={root}", "log.name=full"])
    summary = Trainer(cfg).train()
    return root, summary


def test_resume_is_bit_exact(full_run, tiny_data):
    root, _ = full_run
    # Simulate a crash after the step-4 checkpoint: drop everything later, then resume=auto.
    shutil.copytree(root / "full", root / "crashed")
    shutil.rmtree(root / "crashed" / "checkpoints" / "step_0000008")
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.max_steps=8", "train.checkpoint_every=4",
                                      f"log.root={root}", "log.name=crashed", "train.resume=auto"])
    trainer = Trainer(cfg)
    assert trainer.step == 4 and trainer.loader.step == 4
    trainer.train()
    a, b = rows(root / "full"), rows(root / "crashed")
    assert [r["step"] for r in b] == [str(s) for s in range(1, 9)]  # the crashed attempt's rows are replaced
    for ra, rb in zip(a, b):
        assert (ra["loss"], ra["grad_norm"], ra["lr"]) == (rb["loss"], rb["grad_norm"], rb["lr"]), ra["step"]
    assert [r["val_loss"] for r in rows(root / "full") if r["val_loss"]] == \
           [r["val_loss"] for r in rows(root / "crashed") if r["val_loss"]]


def test_outputs_read_back(full_run):
    root, summary = full_run
    run = root / "full"
    losses = [float(r["loss"]) for r in rows(run)]
    assert len(losses) == 8 and losses[-1] < losses[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    events = ea.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 9))
    assert [round(e.value, 4) for e in events] == [round(v, 4) for v in losses]
    assert "val/val_loss" in ea.Tags()["scalars"]
    import matplotlib.image
    img = matplotlib.image.imread(run / "loss.png")
    assert img.ndim == 3 and img.shape[0] > 100
    assert (run / "config.yaml").is_file() and (run / "tokenizer" / "tokenizer.meta.json").is_file()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_0000004", "step_0000008"]


def test_existing_run_dir_without_resume_is_refused(full_run, tiny_data):
    root, _ = full_run
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", f"log.root={root}", "log.name=full"])
    with pytest.raises(ConfigError, match="already exists; pass train.resume=auto"):
        Trainer(cfg)


def test_a_start_that_stops_in_set_up_leaves_no_folder_behind(tmp_path, tiny_data):
    """A config error found once the run folder is locked (here the model plan's) used to leave
    the folder holding its lock file, and the corrected command under the same name was refused
    as "already exists". Now the folder goes with the failed start, named or timestamped, and a
    folder holding only a lock (a start that was killed) counts as empty."""
    base = TINY + [f"data.dir={tiny_data}", "train.max_steps=1", f"log.root={tmp_path}", "log.tensorboard=false"]
    bad = ["model.value_embeds=2"]  # two tables need four blocks; the model plan refuses it
    with pytest.raises(ConfigError, match="value_embeds=2"):
        Trainer(load_config("tiny", base + bad + ["log.name=r"]))
    with pytest.raises(ConfigError, match="value_embeds=2"):
        Trainer(load_config("tiny", base + bad))
    assert list(tmp_path.iterdir()) == []
    Trainer(load_config("tiny", base + ["log.name=r"])).train()
    assert (tmp_path / "r" / "metrics.csv").is_file()

    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / ".lock").write_text("12345\n")
    Trainer(load_config("tiny", base + ["log.name=killed"])).train()
    assert (tmp_path / "killed" / "metrics.csv").is_file()
    # a failed start in a folder that holds a run leaves the run as it was
    with pytest.raises(ConfigError, match="value_embeds=2"):
        Trainer(load_config("tiny", base + bad + ["log.name=r", "train.resume=auto"]))
    assert (tmp_path / "r" / "metrics.csv").is_file() and (tmp_path / "r" / "config.yaml").is_file()


def test_keep_last_keeps_best_and_newest(tmp_path, tiny_data):
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.max_steps=6", "train.checkpoint_every=1",
                                      "train.eval_every=1", "train.keep_last=2", f"log.root={tmp_path}",
                                      "log.name=k", "log.tensorboard=false"])
    t = Trainer(cfg)
    t.train()
    kept = sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir())
    assert kept[-2:] == ["step_0000005", "step_0000006"]
    assert t.best_ckpt in kept and len(kept) <= 3


@pytest.mark.parametrize("eval_every,dropout,new_graph", [(1, 0.1, True), (1, 0.0, False), (0, 0.1, False)])
def test_evaluation_of_a_compiled_model(monkeypatch, tmp_path, tiny_data, eval_every, dropout, new_graph):
    """With dropout, the first evaluation of a compiled model that evaluates often (here 6
    times, at least EVAL_COMPILE_FROM) compiles its no-grad graph. Without dropout, it runs the
    training graphs: nothing compiles, the gradients stay untouched, and the next step compiles
    nothing either. A run with fewer evaluations (eval_every=0: one, at the end) evaluates
    eagerly. Every way gives the eager no-grad loss."""
    from distlm.train.evaluation import EVAL_COMPILE_FROM, evaluations
    import torch
    from torch._dynamo.testing import CompileCounter
    counter, orig = CompileCounter(), torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: orig(self, backend=counter, **kw))
    torch._dynamo.reset()
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.compile=true", "train.compile_scope=model",
                                      "train.max_steps=6", f"train.eval_every={eval_every}", f"log.root={tmp_path}",
                                      f"model.dropout={dropout}", "log.name=e", "log.tensorboard=false"])
    assert (evaluations(cfg.train) >= EVAL_COMPILE_FROM) == bool(eval_every)
    t = Trainer(cfg)
    t.train_step()
    trained = counter.frame_count
    assert trained >= 1
    t.evaluate()
    assert (counter.frame_count > trained) == new_graph
    assert all(p.grad is None for p in t.model.parameters())
    assert t.model.training
    after_eval = counter.frame_count
    t.train_step()
    assert counter.frame_count == after_eval  # training's graphs are still the ones that run
    t.model.eval()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        eager = t.task.evaluate(run_context(t))
    t.model.train()
    assert t.evaluate() == pytest.approx(eager, rel=1e-6)
    torch._dynamo.reset()


def test_the_end_of_a_run_is_one_line_of_its_phases(tmp_path, capsys):
    """After the last step: the final checkpoint (its state, write, checksums, marker), the
    evaluation, the logs and the plot, timed in one line; the checkpoint in several files."""
    from fault_harness import make_trainer
    t = make_trainer(tmp_path, "end", "train.max_steps=2", "train.checkpoint_every=0", "log.samples=0")
    summary = t.train()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("end of run "))
    phases = re.findall(r"([a-z][a-z ]+?) ([0-9]+\.[0-9])(?=[,)])", line[line.index("(") + 1:])
    assert [p for p, _ in phases] == ["checkpoint state", "checkpoint write", "checkpoint checksums",
                                      "checkpoint marker", "checkpoint pruning", "final evaluation", "samples",
                                      "logs closed", "plot"], line
    total = float(re.match(r"end of run ([0-9.]+) s", line).group(1))
    assert abs(sum(float(s) for _, s in phases) - total) < 0.05 * len(phases) + 0.05, line
    assert summary["checkpoint"].endswith("step_0000002") and (tmp_path / "end" / "loss.png").is_file()
