"""Tasks sit below the Trainer: they import nothing from distlm.train and see the run through
a RunContext (distlm/tasks/base.py), never through the Trainer itself."""
import ast
import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from distlm.config import load_config

PKG = Path(__file__).resolve().parents[2] / "distlm"
TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_batches=2", "train.max_steps=2",
        "log.progress=false", "log.samples=2", "train.seed=7"]


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """Every module a file of ``package`` names in an import, function-local ones included,
    relative ones resolved against ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def package_of(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")


def test_tasks_import_nothing_from_train():
    upward = [f"{p.relative_to(PKG.parent)}:{line} imports {name}"
              for p in sorted((PKG / "tasks").rglob("*.py"))
              for line, name in imported_modules(p.read_text(), package_of(p))
              if name == "distlm.train" or name.startswith("distlm.train.")]
    assert not upward, upward


def test_the_import_reader_sees_lazy_and_relative_imports():
    """The check above can fail: function-local and relative imports are read too."""
    lazy = "def f():\n    from distlm.train import samples\n"
    assert (2, "distlm.train.samples") in imported_modules(lazy, "distlm.tasks")
    relative = "def f():\n    from ...train import trainer\n"
    assert (2, "distlm.train.trainer") in imported_modules(relative, "distlm.tasks.classify")
    assert package_of(PKG / "tasks" / "classify" / "task.py") == "distlm.tasks.classify"
    assert package_of(PKG / "tasks" / "classify" / "__init__.py") == "distlm.tasks.classify"


def test_a_task_evaluates_and_samples_through_its_run_context(tmp_path, tiny_data, capsys):
    from distlm.tasks import RunContext
    from distlm.train.run_context import run_context
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", f"log.root={tmp_path}", "log.name=ctx"])
    trainer = Trainer(cfg)
    trainer.train_step()
    ctx = run_context(trainer)
    assert isinstance(ctx, RunContext) and ctx.step == 1 and ctx.run_dir == trainer.run_dir
    # Nothing in it leads back to the Trainer, its optimizer or its loader.
    held = [getattr(ctx, f.name) for f in dataclasses.fields(ctx)]
    assert not any(v is trainer or v is trainer.optimizer or v is trainer.loader for v in held)

    with trainer.evaluation(trainer.model):
        loss = trainer.task.evaluate(ctx)
    assert math.isfinite(loss) and loss == trainer.evaluate()  # the same blocks, the same graphs

    texts = trainer.task.samples(ctx)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    # A rank without the whole model draws none, says why once, and names the run to sample.
    sharded = dataclasses.replace(ctx, whole_model=None, no_whole_model="each rank holds a shard")
    capsys.readouterr()
    assert trainer.task.samples(sharded) == [] and trainer.task.samples(sharded) == []
    out = capsys.readouterr().out
    assert out.count("note: log.samples=2") == 1 and "each rank holds a shard" in out and str(tmp_path / "ctx") in out
    trainer.lock.release()


def test_classify_bench_fields_come_from_the_tasks_own_loader(tmp_path):
    """bench_fields takes the step time only: the task kept the loader it built."""
    from distlm.tasks.classify.task import ClassifyTask

    class OneRank:
        dp_rank, dp_size = 0, 1

    task = ClassifyTask()
    task.train_data = {"tokens": np.zeros((10, 4), np.int32), "lengths": np.full(10, 4, np.int32),
                       "labels": np.zeros(10, np.int64)}
    cfg = load_config("classify", ["train.global_batch_size=4", "train.micro_batch_size=2"])
    loader = task.build_loader(cfg, OneRank(), torch.device("cpu"))
    fields = task.bench_fields(0.5)
    assert fields["train_examples"] == loader.n == 10
    assert fields["steps_per_epoch"] == loader.steps_per_epoch
    assert fields["examples_per_s"] == loader.global_batch / 0.5
