"""A trained classifier applied to token arrays: class probabilities batch by batch, and
where a checkpoint's run folder is (the files `distlm eval` and `distlm predict` write go there;
their command lines are in distlm/cli/classify.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


@torch.no_grad()
def predict_probs(model, tokens: np.ndarray, lengths: np.ndarray, device, batch_size: int = 64,
                  desc: str = "predict") -> np.ndarray:
    """Probabilities (N, C), batch by batch, each batch trimmed to its longest row."""
    import math
    import sys

    from tqdm import tqdm

    from distlm.tasks.classify.loader import make_batch
    starts = range(0, len(lengths), batch_size)
    out = []
    # As a language model's `distlm eval`: a bar on a terminal (tqdm's disable=None); in a pipe or
    # a log file, where a bar would be thousands of redraws, a line on stderr at each tenth, so a
    # long pass is seen to move (from 10 batches: a shorter one is done before a line would help).
    n = len(starts)
    tenths = set() if sys.stderr.isatty() or n < 10 else {math.ceil(n * k / 10) for k in range(1, 10)}
    for i, s in enumerate(tqdm(starts, desc=desc, unit="batch", leave=False, disable=None), 1):
        batch = make_batch(tokens[s:s + batch_size], lengths[s:s + batch_size]).to(device)
        out.append(torch.softmax(model(batch).float(), -1).cpu().numpy())
        if i in tenths:
            print(f"{desc}: {i}/{n} batches", file=sys.stderr, flush=True)
    return np.concatenate(out)


def run_folder(checkpoint_folder: Path) -> Path:
    """RUN for RUN/checkpoints/step_N; for a checkpoint folder elsewhere, the folder holding
    it (files written into a checkpoint would fail its file list)."""
    return checkpoint_folder.parent.parent if checkpoint_folder.parent.name == "checkpoints" \
        else checkpoint_folder.parent
