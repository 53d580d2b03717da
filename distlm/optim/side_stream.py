"""Work run beside the caller's CUDA stream, joined before the caller goes on.

An optimizer that updates two disjoint sets of parameters with independent kernels (Muon's
Newton-Schulz matmuls for the blocks' matrices, AdamW's fused element-wise kernel for the
embeddings, head, norms and scalars) can give one set a second stream: the memory-bound
AdamW kernel then fills the gaps between Muon's launches instead of waiting its turn.

Ordering, which is all the correctness there is:
  - the side stream first waits for everything already queued on the caller's stream (the
    backward that wrote the gradients, a clip that scaled them), so no gradient or parameter
    is read before it is ready;
  - the caller's stream then waits for the side stream before ``run`` returns, so the next
    forward (and anything else queued after the step) reads the updated parameters.
Every tensor the side work touches (parameters, gradients, optimizer state) was allocated on
the caller's stream and is freed, if ever, only after that join, by host code whose later
kernels are queued behind it: no allocation is reused while the side stream may still use
it, so no ``record_stream`` is needed. The side work must allocate nothing that outlives it
(optimizer state is made before ``run``, on the caller's stream).

On a CPU (or any device without streams) ``Inline`` runs both parts in order, as before.
"""
from __future__ import annotations

from typing import Callable

import torch

Work = Callable[[], None]


class Inline:
    """Both parts one after the other on the current stream: the side part first, as a
    single-stream optimizer would run them."""

    def run(self, side: Work, main: Work) -> None:
        side()
        main()


class SideStream:
    """``side`` on a stream of its own, ``main`` on the caller's, joined before returning."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, side: Work, main: Work) -> None:
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            side()
        main()
        caller.wait_stream(self.stream)


def overlap_for(device: torch.device):
    """The way to run two independent parts of a step on ``device``: a side stream on CUDA,
    in order elsewhere."""
    return SideStream(device) if device.type == "cuda" else Inline()
