"""speedrun-124m on any GPU count without working out a micro-batch: the preset leaves it to
auto, which takes the whole local batch in one forward where it fits."""
import pytest

from distlm.config import load_config
from distlm.parallel.dims import ParallelDims
from distlm.train.fast_defaults import Device, choose

H100 = Device("cuda", 79.0)


@pytest.mark.parametrize("gpus, extra, micro", [
    (1, [], 32),
    (2, [], 16),
    (4, [], 16),  # the preset's data_parallel table: 64 sequences a step, 300 steps
    (4, ["train.global_batch_size=64", "train.max_steps=300"], 16),  # the same, written out
    (4, ["train.global_batch_size=32"], 8),  # a command line that gives part of the row leaves it out
    (8, [], 16),  # the row for 8: 128 x 150 (not measured)
    (8, ["train.global_batch_size=64"], 8),
])
def test_the_preset_runs_on_any_gpu_count_without_a_micro_batch(gpus, extra, micro):
    overrides = [f"parallel.dp_replicate={gpus}"] if gpus > 1 else []
    cfg = load_config("speedrun-124m", [*overrides, *extra])  # validation passes: nothing to work out
    assert cfg.train.micro_batch_size is None
    dims = ParallelDims(dp_replicate=gpus, world_size=gpus)
    chosen = choose(cfg, H100, dims).cfg.train
    if gpus == 4 and not extra:
        assert (chosen.global_batch_size, chosen.max_steps) == (64, 300)  # 16 a GPU, the same 19.7M tokens
    assert chosen.micro_batch_size == micro
    assert chosen.global_batch_size % (chosen.micro_batch_size * gpus) == 0
