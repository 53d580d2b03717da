"""The data path of the default step: the next batch is made while the device runs the
current one, the tensors copied to the GPU are the page-locked ones, and the batches served
are the same as without either (so resume and the data order do not move)."""
import numpy as np
import pytest
import torch

from distlm.config import load_config
from distlm.data.loader import BatchLoader, split_micro_batches
from test_order import blocks_of, numbered, write_folder


@pytest.fixture
def pinned_log(monkeypatch):
    """Pinning on a CPU-only torch: pinned allocations become plain ones whose storages are
    logged, so a test can ask whether a tensor lives in memory that was asked to be pinned."""
    storages = set()
    empty, pin = torch.empty, torch.Tensor.pin_memory

    def fake_empty(*args, pin_memory=False, **kwargs):
        t = empty(*args, **kwargs)
        if pin_memory:
            storages.add(t.untyped_storage().data_ptr())
        return t

    def fake_pin(self, *args, **kwargs):
        t = self.clone()
        storages.add(t.untyped_storage().data_ptr())
        return t

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    return storages


def test_tensors_copied_to_the_gpu_are_the_pinned_ones(pinned_log):
    loader = BatchLoader(None, seed=3, global_batch=8, micro_batch=2, synthetic_vocab=100, block_size=16,
                         pin_memory=True)
    for _ in range(3):
        batch = loader.next()
        assert len(batch) == 4
        for x, y in batch:
            assert x.is_contiguous() and y.is_contiguous()
            # A contiguous copy cut out of a pinned tensor is pageable: its GPU copy is staged
            # through the host and is not asynchronous.
            assert x.untyped_storage().data_ptr() in pinned_log
            assert y.untyped_storage().data_ptr() in pinned_log


def test_split_keeps_the_tokens():
    rows = np.random.default_rng(0).integers(0, 50257, (6, 17))
    pairs = split_micro_batches(rows, 2)
    assert [tuple(x.shape) for x, _ in pairs] == [(2, 16)] * 3
    assert torch.equal(torch.cat([x for x, _ in pairs]), torch.from_numpy(rows[:, :-1]))
    assert torch.equal(torch.cat([y for _, y in pairs]), torch.from_numpy(rows[:, 1:]))
    assert pairs[0][0].dtype == torch.int64


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("kind", ["synthetic", "data"])
def test_prefetch_serves_the_same_batches_and_never_a_stale_one(tmp_path, kind):
    blocks = blocks_of(write_folder(tmp_path / "d", numbered(50, 8)), block_size=8) if kind == "data" else None

    def make():
        return BatchLoader(blocks, seed=5, global_batch=8, micro_batch=4, dp_rank=1, dp_size=2,
                           synthetic_vocab=1000, block_size=8)

    plain, ahead = make(), make()
    for _ in range(4):
        ahead.prefetch()
        assert _same(ahead.next(), plain.next())
    state = plain.state_dict()                  # step 4
    later = [plain.next() for _ in range(2)]    # steps 4, 5
    ahead.prefetch()
    ahead.prefetch()                            # twice: still step 4's batch, made once
    assert _same(ahead.next(), later[0])
    ahead.prefetch()                            # step 5 made ahead, then a resume to step 4
    ahead.load_state_dict(state)
    assert ahead.step == 4 and _same(ahead.next(), later[0])
    assert _same(ahead.next(), later[1])


def test_next_batch_is_made_before_the_step_reads_its_loss():
    """The step reads its loss and gradient norm on the host (NaN skip), which waits for the
    device; the next batch must be made before that read, not after it."""
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", ["data.source=synthetic", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
                               "model.d_ff=64", "model.block_size=16", "train.global_batch_size=4",
                               "train.micro_batch_size=2", "train.max_steps=10", "log.progress=false",
                               "log.tensorboard=false", "train.device=cpu"])
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, run_dir=tmp)
        events = []
        rows, clip = trainer.loader._rank_rows, trainer.stepper.clip
        trainer.loader._rank_rows = lambda step: events.append(("rows", step)) or rows(step)
        trainer.stepper.clip = lambda max_norm: events.append(("read", trainer.step)) or clip(max_norm)
        for _ in range(3):
            trainer.train_step()
        for k in range(3):
            assert events.index(("rows", k + 1)) < events.index(("read", k)), events
        assert [e for e in events if e[0] == "rows"] == [("rows", k) for k in range(4)]  # each batch made once
        if trainer.lock is not None:
            trainer.lock.release()


def _tool():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "default_path.py"
    spec = importlib.util.spec_from_file_location("default_path_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("cpu", [False, True])
def test_default_path_script_plans_commands_that_distlm_accepts(cpu, capsys):
    """benchmarks/tools/default_path.py: every bench it would run loads as distlm loads it, with
    flags `distlm bench` has; the README's command is the first, unchanged."""
    import inspect
    from distlm.cli.bench import bench
    tool = _tool()
    args = tool.main.__globals__["argparse"].Namespace(cpu=cpu, before="old", warmup=5, steps=20)
    plans = tool.variants(args)
    assert [name for name, _, _ in plans] == ["default", "default-before", "default-nan-off", "default-nan-off-before",
                                              "best"]
    assert plans[0][2][:4] == ["bench", "--config", "gpt2-124m-1024", "data.source=synthetic"]
    params = inspect.signature(bench).parameters
    for name, _, words in plans:
        flags = [w[2:].replace("-", "_") for w in words if w.startswith("--")]
        assert set(flags) <= set(params), (name, flags)
        cfg = load_config(words[2], [w for w in words[3:] if "=" in w and not w.startswith("--")])
        if name == "best":
            assert cfg.train.on_nan == "off" and cfg.train.global_batch_size == 2 * cfg.train.micro_batch_size
    assert tool.main(["--dry-run", "--nanogpt", "nano", "--nanogpt-batch", "12,32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["probe-new", "default", "default-nan-off", "best",
                                                      "nanogpt-b12", "nanogpt-b32"]


def test_default_path_script_reads_its_results():
    tool = _tool()
    row = tool.nanogpt_row("19/20 loss: 10.9\ntime per iteration: 131.0720ms, MFU: 38.50%\n", 16)
    assert row["tokens_per_s"] == pytest.approx(16 * 1024 / 0.131072) and row["nanogpt_mfu"] == pytest.approx(0.385)
    rows = [{"name": "default", "tokens_per_s": 400.0, "step_s": 0.2, "phases_s": {"data": 0.001}, "mfu": 0.4,
             "global_batch_size": 64, "micro_batch_size": 64}, {"name": "best", "tokens_per_s": 500.0, "step_s": 0.3},
            {"name": "default-before", "rc": 1, "log": "x.log"}]
    text = tool.table(rows)
    assert "| default | 400 | 0.800 | 200.0 | 1.0 |" in text and "failed (rc 1" in text
    # the host probe runs on a CPU too (the numbers mean nothing there)
    res = tool.probe(steps=4)
    assert set(res["host_ms_median"]) == {"made at the step", "made ahead"}
    assert set(res["host_ms_median"]["made at the step"]) == {"total", "rows", "split and pin", "queue copies"}
