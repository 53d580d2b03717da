"""Classification batches, in the LM loader's global-batch order.

Row g of the run is ``perm(seed, epoch)[g % n]`` (distlm.data.loader.global_sample_ids),
each data-parallel rank takes its contiguous slice of every global batch, and the
resumable state is the step: 1, 2 or 4 ranks see the same rows per step, and a run
resumes on any layout. Each micro-batch is trimmed to its longest row, so attention
and the MLPs never run over columns that are padding in every row.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from distlm.data import DataError
from distlm.data.loader import AheadBatches, global_sample_ids
from distlm.model.classifier import TextBatch


def make_batch(tokens: np.ndarray, lengths: np.ndarray) -> TextBatch:
    T = max(1, int(lengths.max()))
    return TextBatch(torch.from_numpy(tokens[:, :T].astype(np.int64)), torch.from_numpy(lengths.astype(np.int64)),
                     bool(lengths.min() < T))


class ClassifyLoader(AheadBatches):  # next() and prefetch() from the step
    def __init__(self, data: dict[str, np.ndarray], *, seed: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, pin_memory: bool = False):
        if global_batch % (micro_batch * dp_size):
            raise DataError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} "
                            f"x data-parallel size {dp_size}")
        self.data, self.seed = data, seed
        self.n = len(data["labels"])
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.pin_memory = pin_memory
        self.step = 0

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.global_batch)

    def micro_batches(self, step: int) -> list[tuple[TextBatch, torch.Tensor]]:
        per_rank = self.global_batch // self.dp_size
        lo = self.dp_rank * per_rank
        ids = global_sample_ids(self.seed, step, self.global_batch, self.n)[lo:lo + per_rank]
        out = []
        for m in range(self.accum_steps):
            rows = ids[m * self.micro_batch:(m + 1) * self.micro_batch]
            batch = make_batch(self.data["tokens"][rows], self.data["lengths"][rows])
            labels = torch.from_numpy(self.data["labels"][rows])
            if self.pin_memory:  # page-locked, so the copy to the GPU is asynchronous
                batch, labels = batch.pin_memory(), labels.pin_memory()
            out.append((batch, labels))
        return out

    def epoch_events(self, step: int) -> list[str]:
        """A message when the global batch of ``step`` starts another pass over the examples."""
        from distlm.data.loader import epoch_messages
        return epoch_messages("the training set", step * self.global_batch, (step + 1) * self.global_batch,
                              self.n, step)

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "n_blocks": self.n}

    def load_state_dict(self, state: dict) -> None:
        from distlm.data.loader import resume_step
        self.step = resume_step(self.state_dict(), state)


def eval_batches(data: dict[str, np.ndarray], batch_size: int, dp_rank: int = 0, dp_size: int = 1
                 ) -> list[tuple[TextBatch, torch.Tensor, torch.Tensor]]:
    """The whole split, in order, dealt to ranks in contiguous slices. Every rank gets the
    same number of batches (FSDP2 forwards are collective): the short ranks repeat row 0
    with weight 0. Returns (batch, labels, weights)."""
    n = len(data["labels"])
    per_rank = math.ceil(n / dp_size)
    idx = np.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    weight = (idx < n).astype(np.float32)
    # Rows sorted by length: trimmed batches then carry almost no padding.
    order = np.argsort(data["lengths"], kind="stable")
    idx = order[np.where(idx < n, idx, 0)] if n else idx
    out = []
    for s in range(0, per_rank, batch_size):
        rows = idx[s:s + batch_size]
        out.append((make_batch(data["tokens"][rows], data["lengths"][rows]),
                    torch.from_numpy(data["labels"][rows]), torch.from_numpy(weight[s:s + batch_size])))
    return out
