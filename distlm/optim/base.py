"""What an optimizer of the registry (distlm/optim/__init__.py) declares and provides.

An optimizer is a ``Spec``: its name (``optim.name``), the state it keeps per parameter, how
to check its settings and how to build the ``torch.optim.Optimizer`` that runs it.

The state declaration says, for each kind of parameter, which tensors ``optimizer.state[p]``
holds: their key, whether each has the parameter's shape (and so its layout: a DTensor shard
under FSDP2 / TP, resharded by DCP like the parameter) or is a scalar, and their dtype. The
planner (distlm/planner.py) counts the bytes from it, and so does the auto micro-batch that
uses the planner's estimate; tests/test_optim_registry.py checks each declaration against
the state a real step leaves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from distlm.config import Config

# The kinds of parameter an optimizer may treat differently. MATRIX: the 2-D weights inside
# the transformer blocks (distlm/optim/groups.py: matrix_params), the hidden linear maps a
# matrix optimizer takes; OTHER: every other parameter (embeddings, head, norms, biases).
MATRIX, OTHER = "matrix", "other"
KINDS = (MATRIX, OTHER)


@dataclass(frozen=True)
class StateTensor:
    """One tensor ``optimizer.state[p]`` holds for a parameter ``p``. ``like_param``: the
    parameter's shape and layout (else a 0-d scalar, e.g. AdamW's step count)."""
    key: str
    like_param: bool = True
    dtype: torch.dtype = torch.float32

    def bytes_per_element(self) -> int:
        """Bytes per element of the parameter; a scalar counts as none (a few bytes per tensor)."""
        return torch.empty((), dtype=self.dtype).element_size() if self.like_param else 0


@dataclass(frozen=True)
class BuildContext:
    """What building an optimizer needs besides the model and the config: the device type
    (fused kernels on CUDA), the DDP process group whose ranks hold replicated parameters
    (None without DDP; a matrix optimizer shares its whole-matrix work over it) and, for Muon,
    the Newton-Schulz dtype the caller resolved (the same on every rank)."""
    device_type: str
    process_group: Optional[object] = None
    ns_dtype: Optional[torch.dtype] = None


class Spec:
    """One optimizer of the registry. Subclasses set ``name``, ``state`` and ``step_temporaries``
    and implement ``build``; ``check`` refuses settings it cannot run with."""
    name: str = ""
    # The tensors kept per parameter, by kind of parameter.
    state: dict[str, tuple[StateTensor, ...]] = {}
    # fp32 copies of a parameter's size the step allocates at once beyond its state (e.g.
    # Muon's Nesterov momenta), by kind: they exist during the step only, when the
    # activations are gone, so the planner counts the larger of the two.
    step_temporaries: dict[str, float] = {}
    # Its step orthogonalises matrices by Newton-Schulz, in the dtype optim.muon_ns_dtype
    # names (auto: the Trainer measures this device once, the same on every rank).
    orthogonalises: bool = False

    def state_bytes(self, kind: str) -> int:
        """Bytes of state per element of a parameter of this kind."""
        return sum(t.bytes_per_element() for t in self.state[kind])

    def check(self, cfg: Config) -> None:
        """A ConfigError, naming the field and value, for settings this optimizer cannot use."""

    def build(self, model: nn.Module, cfg: Config, ctx: BuildContext) -> torch.optim.Optimizer:
        raise NotImplementedError
