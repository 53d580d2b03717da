"""Next-token cross-entropy, kept outside the model so parallel plans can swap it
(a vocabulary-parallel head computes it under ``loss_parallel``; a pipeline runs it on
the last stage only)."""
import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 softmax: under bf16 autocast the log-sum-exp over 50k logits loses digits.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
