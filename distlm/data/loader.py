"""Global batches as a pure function of (seed, step, global batch size).

A split's shards are cut into fixed blocks of block_size+1 tokens (no padding, no
block crosses a shard). Sample g of the whole run (g = step * global_batch + j) is
block ``perm(seed, epoch)[g % n_blocks]`` with ``epoch = g // n_blocks``, the
permutation computed per sample (``distlm.data.order``: O(1) memory whatever the
data size). A data-parallel rank takes a contiguous slice of each global batch, so
1, 2 or 4 ranks train on the same tokens per step, and resuming needs nothing but the
step: the loader's checkpointed state is ``{"step": ...}`` plus what it was built
from (and the order's version), checked on load.

Validation (``val_micro_batches``) is a fixed sample spread over the whole val split,
the same blocks whatever the world size; see ``ValSet``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from distlm.data import DataError
from distlm.data.order import CURRENT_ORDER, ORDER_V1, ORDERS, sample_blocks


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


def global_sample_ids(seed: int, step: int, global_batch: int, n_blocks: int,
                      order: int = ORDER_V1) -> np.ndarray:
    """Block ids of the global batch at ``step``: the heart of reproducibility. ``order``
    defaults to 1 for the callers written before order 2 (their checkpoints carry no
    version); BatchLoader passes its own."""
    g = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return sample_blocks(seed, g, n_blocks, order)


class AheadBatches:
    """``next()`` and ``prefetch()`` over a loader's ``micro_batches(step)`` and its ``step``.

    The Trainer calls ``prefetch()`` once a step's kernels are queued and before it reads
    that step's loss (which waits for the device): the next step's batch is then made while
    the device works, not while it waits for the host. A batch is a pure function of the
    loader's state (that is what makes a run resumable), so a batch made ahead is served
    only while ``state_dict()`` is still the one it was made for: a resume or a second
    ``prefetch()`` after another ``next()`` never serves a stale batch, and the batches
    served are the same with or without ``prefetch()``."""

    step: int
    _ahead: tuple | None = None  # (state_dict() it was made for, the batch)

    def micro_batches(self, step: int) -> list:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def prefetch(self) -> None:
        """Make the batch ``next()`` will serve, now."""
        state = self.state_dict()
        if self._ahead is None or self._ahead[0] != state:
            self._ahead = (state, self.micro_batches(self.step))

    def next(self) -> list:
        ahead, self._ahead = self._ahead, None
        batch = ahead[1] if ahead is not None and ahead[0] == self.state_dict() else self.micro_batches(self.step)
        self.step += 1
        return batch


class RankBatches(AheadBatches):
    """What every loader serves the Trainer: this rank's slice of each global batch
    (``_rank_rows(step)``, given by the subclass), cut into micro-batches, one step after
    another from ``self.step``."""

    global_batch: int
    micro_batch: int
    dp_size: int
    pin_memory: bool
    step: int

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _rank_rows(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return split_micro_batches(self._rank_rows(step), self.micro_batch, self.pin_memory)


class BatchLoader(RankBatches):
    """This rank's micro-batches of each global batch.

    Rank r of dp takes samples [r*B/dp, (r+1)*B/dp) of the global batch B, cut into
    micro-batches of ``micro_batch`` sequences (so accumulation = B / (dp * micro_batch)).
    ``order``: the sample order's version (``distlm.data.order``); new runs take the
    current one, and ``load_state_dict`` switches to whatever the checkpoint used.
    """

    def __init__(self, blocks: TokenBlocks | None, *, seed: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, synthetic_vocab: int = 0, block_size: int = 0,
                 pin_memory: bool = False, order: int = CURRENT_ORDER):
        check_batch(global_batch, micro_batch, dp_size)
        self.blocks, self.seed = blocks, seed
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.synthetic_vocab = synthetic_vocab
        self.block_size = blocks.block_size if blocks is not None else block_size
        self.pin_memory = pin_memory
        self.order = check_order(order)
        self.step = 0  # the next step to serve: with the order's version, the loader's whole resumable state

    def _rank_rows(self, step: int) -> np.ndarray:
        per_rank = self.global_batch // self.dp_size
        lo = self.dp_rank * per_rank
        if self.blocks is None:  # synthetic: random tokens, still a pure function of (seed, step)
            rng = np.random.default_rng([self.seed, step])
            rows = rng.integers(0, self.synthetic_vocab, (self.global_batch, self.block_size + 1))
            return rows[lo:lo + per_rank]
        # Only this rank's samples: the order maps each sample on its own, so the slice of
        # the global batch is computed without the rest of it.
        first = step * self.global_batch + lo
        ids = sample_blocks(self.seed, np.arange(first, first + per_rank, dtype=np.int64), len(self.blocks),
                            self.order)
        return np.stack([self.blocks.block(int(i)) for i in ids])

    def epoch_events(self, step: int) -> list[str]:
        """Messages for the log when the global batch of ``step`` starts a new epoch (the data
        begins to repeat); empty for most steps."""
        if self.blocks is None:
            return []
        lo = step * self.global_batch
        return epoch_messages("data", lo, lo + self.global_batch, len(self.blocks), step)

    def state_dict(self) -> dict:
        # dp_rank/dp_size are deliberately absent: the state is layout-free, so a run
        # saved on 4 ranks resumes on 2 on the very same global batches.
        n = len(self.blocks) if self.blocks is not None else 0
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "n_blocks": n,
                "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        if "mix" in state:
            raise DataError(f"the checkpoint's run drew from the mixture data.mix={mix_string(state['mix'])}; "
                            f"set data.mix to resume it on the same batches")
        order = check_order(state.get("order", ORDER_V1))  # no version: written before order 2 existed
        self.step = resume_step(self.state_dict(), state)
        self.order = order


def check_batch(global_batch: int, micro_batch: int, dp_size: int) -> None:
    if global_batch % (micro_batch * dp_size):
        raise DataError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} "
                        f"x data-parallel size {dp_size}")


def check_order(order) -> int:
    if int(order) not in ORDERS:
        raise DataError(f"checkpoint's loader uses sample order {order!r}, which this version of distlm does not "
                        f"know (it knows {', '.join(map(str, ORDERS))})")
    return int(order)


def mix_string(entries) -> str:
    """A checkpointed mixture (list of [name, weight, n_blocks]) as data.mix would spell it."""
    try:
        return ",".join(f"{e[0]}=...:{e[1]}" for e in entries)
    except (TypeError, IndexError, KeyError):
        return repr(entries)


def split_micro_batches(rows: np.ndarray, micro_batch: int, pin_memory: bool = False
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) pairs of ``micro_batch`` rows each from rows of block_size+1 tokens.

    The inputs and the targets are two buffers, each cut into contiguous micro-batches
    (views); with ``pin_memory`` the buffers are page-locked, so the tensors the Trainer
    copies to the GPU are the page-locked ones and the copy is asynchronous. (Pinning the
    rows and then cutting contiguous copies out of them would hand over pageable copies: the driver then stages each transfer through the host.) The buffers
    come from torch's caching host allocator, which serves a block again once the copies
    that read it have run. numpy fills them, one single-threaded pass each: torch's strided
    copies of a 64-row micro-batch went to its thread pool, and on a loaded 2-core CPU took
    from 0.06 to 50 ms a batch, against 0.1-0.6 ms for these."""
    n, width = rows.shape
    x = torch.empty((n, width - 1), dtype=torch.from_numpy(rows[:0]).dtype, pin_memory=pin_memory)
    y = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin_memory)
    np.copyto(x.numpy(), rows[:, :-1])
    np.copyto(y.numpy(), rows[:, 1:])
    return list(zip(x.split(micro_batch), y.split(micro_batch)))


def epoch_starts(lo: int, hi: int, n: int) -> range:
    """The epochs after the first (0-based) whose first sample is among samples [lo, hi) of a
    stream over n blocks."""
    return range(max(1, -(-lo // n)), (hi - 1) // n + 1 if hi > lo else 0)


def epoch_messages(name: str, lo: int, hi: int, n: int, step: int) -> list[str]:
    epochs = epoch_starts(lo, hi, n)
    if not epochs:
        return []
    which = f"epoch {epochs[0] + 1}" if len(epochs) == 1 else f"epochs {epochs[0] + 1}-{epochs[-1] + 1}"
    return [f"{name} starts {which} at step {step:,}: its {n:,} blocks repeat from here"]


def resume_step(mine: dict, state: dict) -> int:
    """The step to resume a loader at, after checking the checkpoint's loader drew its batches
    the same way (seed, global batch, data size): else the run would not see the same data."""
    for key in ("seed", "global_batch", "n_blocks"):
        if int(state[key]) != mine[key]:
            raise DataError(f"checkpoint's loader {key}={state[key]} differs from this run's {mine[key]}: "
                            f"the resumed run would not see the same batches")
    return int(state["step"])


# ---- validation -------------------------------------------------------------------------

@dataclass(eq=False)
class ValSet:
    """This rank's share of a fixed validation set, and what the set is.

    The set: ``n_blocks`` blocks spread evenly over the split's ``split_blocks`` (global
    index i reads block floor(i * split_blocks / n_blocks): every k-th block when k divides
    the split), so a split joined from several sources is scored over all of them, not over
    its first document. The blocks do not depend on the world size or the step.

    Dealing: the set is cut into global micro-batches of ``micro_batch`` rows; rank r takes
    the r-th contiguous run of ceil(C / dp_size) of them. A rank left short runs micro-batch
    0 again with weight 0, so every rank makes the same number of forwards (FSDP and TP
    forwards are collective) and every micro-batch has the same shape (one compiled graph).

    Iterating gives (inputs, targets) pairs, as the plain list it replaces did; ``weights[i]``
    is the number of set rows in micro-batch i (0 for a repeat). Every row predicts
    block_size tokens, so the set's mean loss is exactly
        (sum over ranks of sum_i loss_i * weights[i]) / (sum over ranks of sum_i weights[i])
    whatever dp_size; ``weighted()`` yields (inputs, targets, weight). Tensors are read from
    the memmapped shards on access, so a whole-split set costs no memory until it is used.
    """

    blocks: TokenBlocks
    chunks: list[int]  # this rank's global micro-batch indices, in order
    weights: list[int]
    n_blocks: int
    split_blocks: int
    micro_batch: int
    name: str = ""

    @property
    def n_tokens(self) -> int:
        """Target tokens in the whole set (all ranks)."""
        return self.n_blocks * self.blocks.block_size

    @property
    def stride(self) -> float:
        """Blocks of the split per block of the set (an integer k when it is every k-th)."""
        k = self.split_blocks / self.n_blocks
        return int(k) if k.is_integer() else k

    def block_ids(self, chunk: int) -> list[int]:
        """The split's block ids in global micro-batch ``chunk`` (integer arithmetic: no overflow)."""
        lo = chunk * self.micro_batch
        hi = min(self.n_blocks, lo + self.micro_batch)
        return [i * self.split_blocks // self.n_blocks for i in range(lo, hi)]

    def _pair(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.blocks.block(i) for i in self.block_ids(chunk)])
        return split_micro_batches(rows, len(rows))[0]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._pair(c) for c in self.chunks[i]]
        return self._pair(self.chunks[i])

    def __iter__(self):
        return (self._pair(c) for c in self.chunks)

    def weighted(self):
        for c, w in zip(self.chunks, self.weights):
            yield (*self._pair(c), w)

    def describe(self) -> str:
        """e.g. '1,234 blocks (every 7th of 8,640), 157,952 tokens'."""
        n, split = self.n_blocks, self.split_blocks
        if n == split:
            what = f"all {split:,} blocks"
        elif isinstance(self.stride, int):
            what = f"{n:,} blocks (every {_ordinal(self.stride)} of {split:,})"
        else:
            what = f"{n:,} blocks (spread evenly over {split:,}, one in {self.stride:.2f})"
        return f"{self.name + ': ' if self.name else ''}{what}, {human_count(self.n_tokens)} tokens"


def val_micro_batches(blocks: TokenBlocks, n_batches: int | None, micro_batch: int, dp_rank: int = 0,
                      dp_size: int = 1, *, name: str = "", keep_tail: bool = False) -> ValSet:
    """A fixed validation set of ``n_batches`` micro-batches of ``micro_batch`` blocks in all
    (over all ranks, so the set is the same whatever dp_size), spread over the whole split;
    ``n_batches`` 0 or None: the whole split. The set is a whole number of micro-batches
    (a whole split loses its last few blocks) unless the split is smaller than one, or
    ``keep_tail`` keeps a last, partial micro-batch (`distlm eval`). See ValSet."""
    n = len(blocks)
    if n_batches is not None and (isinstance(n_batches, bool) or int(n_batches) < 0):
        raise DataError(f"validation batches {n_batches!r} must be 0 (the whole split) or more")
    want = n if not n_batches else min(n, int(n_batches) * micro_batch)
    if want >= micro_batch and not keep_tail:
        want -= want % micro_batch
    n_chunks = -(-want // micro_batch)
    per_rank = -(-n_chunks // dp_size)
    mine = list(range(dp_rank * per_rank, min(n_chunks, (dp_rank + 1) * per_rank)))
    weights = [min(micro_batch, want - c * micro_batch) for c in mine]
    pad = per_rank - len(mine)
    return ValSet(blocks, mine + [0] * pad, weights + [0] * pad, want, n, micro_batch, name)


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k:,}{suffix}"


def human_count(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n):,}"
