"""What an optimizer of the registry (distlm/optim/__init__.py) declares and provides.

An optimizer is a ``Spec``: its name (``optim.name``), the state it keeps per parameter, how
to check its settings, how to resolve those that depend on the device, the peak rate the
learning-rate schedule scales, and how to build the ``torch.optim.Optimizer`` that runs it.

The state declaration says, for each kind of parameter, which tensors ``optimizer.state[p]``
holds: their key, whether each has the parameter's shape (and so its layout: a DTensor shard
under FSDP2 / TP, resharded by DCP like the parameter) or is a scalar, and their dtype. The
planner (distlm/planner.py) counts the bytes from it, and so does the auto micro-batch that
uses the planner's estimate; tests/optim/test_registry.py checks each declaration against
the state a real step leaves.

A step the Trainer must not take (a NaN/Inf loss or gradient, train.on_nan=skip) is decided on
the device where the optimizer can: the Trainer sets ``optimizer.found_inf``, a 0-d float32
tensor that is 1.0 when the step must be left out, as torch's GradScaler does for the optimizers
that declare ``_step_supports_amp_scaling``, and the step leaves the parameters and the state as
they were without reading the flag on the host. ``Spec.skips_on_device`` says whether a built
optimizer honours it; one that does not gets the Trainer's host check instead.
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
    (fused kernels on CUDA) and the DDP process group whose ranks hold replicated parameters
    (None without DDP; a matrix optimizer shares its whole-matrix work over it)."""
    device_type: str
    process_group: Optional[object] = None


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

    def skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` (this spec's build) honours ``optimizer.found_inf`` (see the
        module docstring). False: the Trainer reads the loss and the gradient norm on the host
        before each step instead, one device sync per step."""
        return False

    def state_bytes(self, kind: str) -> int:
        """Bytes of state per element of a parameter of this kind."""
        return sum(t.bytes_per_element() for t in self.state[kind])

    def check(self, cfg: Config) -> None:
        """A ConfigError, naming the field and value, for settings this optimizer cannot use."""

    def peak_lr(self, cfg: Config) -> float:
        """The peak rate of the optimizer's first group, ``param_groups[0]["lr"]``: the Trainer sets
        every group's ``lr`` to the schedule's value from this peak (what the log's lr column
        shows); a group with another peak scales it by its own ``lr_scale``."""
        raise NotImplementedError

    def resolve(self, cfg: Config, device: torch.device, comm=None, probe=None) -> tuple[Config, Optional[str]]:
        """The config with this optimizer's device-dependent settings made values, before it is
        built, so that config.yaml records what ran; with ``comm`` (collective) every rank makes
        the same choice. ``probe``: what measures the device (distlm/optim/matmul_dtype.py), for
        a test to give its own. Returns the config and a line saying what was measured, or None."""
        return cfg, None

    def build(self, model: nn.Module, cfg: Config, ctx: BuildContext) -> torch.optim.Optimizer:
        raise NotImplementedError


def skip_flag(optimizer: torch.optim.Optimizer, device: torch.device,
              cache: Optional[dict] = None) -> Optional[torch.Tensor]:
    """``optimizer.found_inf`` as a 0-d bool tensor on ``device`` (True: leave this step out), or
    None when no flag is set. No host read on the device's own path; FSDP2 CPU offload keeps
    the parameters in host memory, and the flag's copy there waits for the device. ``cache`` keeps one copy per device."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    if cache is not None and device in cache:
        return cache[device]
    # A copy into host memory must complete before the host-side kernels read it.
    flag = found_inf.to(device, non_blocking=device.type != "cpu") != 0
    if cache is not None:
        cache[device] = flag
    return flag
