"""Global batches as a pure function of (seed, step, global batch size).

A split's shards are cut into fixed blocks of block_size+1 tokens (no padding, no
block crosses a shard). Sample g of the whole run (g = step * global_batch + j) is
block ``perm(seed, epoch)[g % n_blocks]`` with ``epoch = g // n_blocks``. A
data-parallel rank takes a contiguous slice of each global batch, so 1, 2 or 4 ranks
train on the same tokens per step, and resuming needs nothing but the step: the
loader's checkpointed state is ``{"step": ...}`` plus what it was built from, checked
on load.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from distlm.data import DataError


class TokenBlocks:
    """Random access to the fixed-length blocks of one split, over memmapped shards."""

    def __init__(self, data_dir: str | Path, split: str, block_size: int, manifest: dict):
        self.block_size = block_size
        info = manifest["splits"].get(split)
        if info is None:
            raise DataError(f"{data_dir}/manifest.json: no '{split}' split")
        dtype = np.dtype(manifest["dtype"])
        self.shards, counts = [], []
        for shard in info["shards"]:
            path = Path(data_dir) / shard["file"]
            if not path.is_file():
                raise DataError(f"missing shard {path} (listed in {data_dir}/manifest.json)")
            arr = np.memmap(path, dtype=dtype, mode="r")
            if arr.shape[0] != shard["tokens"]:
                raise DataError(f"shard {path} has {arr.shape[0]} tokens, manifest says {shard['tokens']}")
            self.shards.append(arr)
            counts.append(max(0, (shard["tokens"] - 1) // block_size))
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_blocks = int(self.starts[-1])
        if self.n_blocks == 0:
            raise DataError(
                f"model.block_size={block_size} is longer than the data: the '{split}' split of {data_dir} "
                f"has {info['tokens']} tokens (lower model.block_size or add data)")

    def __len__(self) -> int:
        return self.n_blocks

    def block(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        off = (i - int(self.starts[s])) * self.block_size
        return np.asarray(self.shards[s][off:off + self.block_size + 1], dtype=np.int64)


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    # PCG64 seeded by (seed, epoch): the same permutation on every machine and numpy>=1.17.
    return np.random.default_rng([seed, epoch]).permutation(n)


def global_sample_ids(seed: int, step: int, global_batch: int, n_blocks: int) -> np.ndarray:
    """Block ids of the global batch at ``step``: the heart of reproducibility."""
    g = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    out = np.empty_like(g)
    for epoch in np.unique(g // n_blocks):
        sel = g // n_blocks == epoch
        out[sel] = _epoch_order(seed, int(epoch), n_blocks)[g[sel] % n_blocks]
    return out


class BatchLoader:
    """This rank's micro-batches of each global batch.

    Rank r of dp takes samples [r*B/dp, (r+1)*B/dp) of the global batch B, cut into
    micro-batches of ``micro_batch`` sequences (so accumulation = B / (dp * micro_batch)).
    """

    def __init__(self, blocks: TokenBlocks | None, *, seed: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, synthetic_vocab: int = 0, block_size: int = 0,
                 pin_memory: bool = False):
        if global_batch % (micro_batch * dp_size):
            raise DataError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} "
                            f"x data-parallel size {dp_size}")
        self.blocks, self.seed = blocks, seed
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.synthetic_vocab = synthetic_vocab
        self.block_size = blocks.block_size if blocks is not None else block_size
        self.pin_memory = pin_memory
        self.step = 0  # the next step to serve: the loader's whole resumable state

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _rank_rows(self, step: int) -> np.ndarray:
        per_rank = self.global_batch // self.dp_size
        lo = self.dp_rank * per_rank
        if self.blocks is None:  # synthetic: random tokens, still a pure function of (seed, step)
            rng = np.random.default_rng([self.seed, step])
            rows = rng.integers(0, self.synthetic_vocab, (self.global_batch, self.block_size + 1))
            return rows[lo:lo + per_rank]
        ids = global_sample_ids(self.seed, step, self.global_batch, len(self.blocks))[lo:lo + per_rank]
        return np.stack([self.blocks.block(int(i)) for i in ids])

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = torch.from_numpy(self._rank_rows(step))
        if self.pin_memory:  # page-locked, so the copy to the GPU is asynchronous
            rows = rows.pin_memory()
        out = []
        for m in range(self.accum_steps):
            chunk = rows[m * self.micro_batch:(m + 1) * self.micro_batch]
            out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return out

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.micro_batches(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        # dp_rank/dp_size are deliberately absent: the state is layout-free, so a run
        # saved on 4 ranks resumes on 2 on the very same global batches.
        n = len(self.blocks) if self.blocks is not None else 0
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "n_blocks": n}

    def load_state_dict(self, state: dict) -> None:
        self.step = resume_step(self.state_dict(), state)


def resume_step(mine: dict, state: dict) -> int:
    """The step to resume a loader at, after checking the checkpoint's loader drew its batches
    the same way (seed, global batch, data size): else the run would not see the same data."""
    for key in ("seed", "global_batch", "n_blocks"):
        if int(state[key]) != mine[key]:
            raise DataError(f"checkpoint's loader {key}={state[key]} differs from this run's {mine[key]}: "
                            f"the resumed run would not see the same batches")
    return int(state["step"])


def val_micro_batches(blocks: TokenBlocks, n_batches: int, micro_batch: int, dp_rank: int = 0,
                      dp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: the first blocks of the val split, in order, dealt to ranks."""
    total = min(len(blocks), n_batches * micro_batch * dp_size)
    per_rank = total // dp_size
    if per_rank == 0:
        per_rank, dp_rank = total, 0  # tiny val split: every rank evaluates the same blocks
    ids = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    rows = torch.from_numpy(np.stack([blocks.block(i) for i in ids]))
    return [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in rows.split(micro_batch)]
