"""A trained classifier applied to token arrays: class probabilities batch by batch, and
where a checkpoint's run folder is (the files `distlm eval` and `distlm predict` write go there;
their command lines are in distlm/cli/classify.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


@torch.no_grad()
def predict_probs(model, tokens: np.ndarray, lengths: np.ndarray, device, batch_size: int = 64) -> np.ndarray:
    """Probabilities (N, C), batch by batch, each batch trimmed to its longest row."""
    from tqdm import tqdm

    from distlm.tasks.classify.loader import make_batch
    out = []
    # tqdm's disable=None: a bar on a terminal, nothing in a pipe or a log file
    for s in tqdm(range(0, len(lengths), batch_size), unit="batch", leave=False, disable=None):
        batch = make_batch(tokens[s:s + batch_size], lengths[s:s + batch_size]).to(device)
        out.append(torch.softmax(model(batch).float(), -1).cpu().numpy())
    return np.concatenate(out)


def run_folder(checkpoint_folder: Path) -> Path:
    """RUN for RUN/checkpoints/step_N; for a checkpoint folder elsewhere, the folder holding
    it (files written into a checkpoint would fail its file list)."""
    return checkpoint_folder.parent.parent if checkpoint_folder.parent.name == "checkpoints" \
        else checkpoint_folder.parent
