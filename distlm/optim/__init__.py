"""The optimizers, by ``optim.name``: a registry of specs (distlm/optim/base.py).

Each spec declares the state it keeps per parameter (the planner's memory estimate and the
auto micro-batch count it), checks its settings and builds a ``torch.optim.Optimizer`` whose
state is per parameter and shaped like it, so ``get_state_dict`` / DCP save it and reshard it
across layouts as they do AdamW's.

  adamw  torch's AdamW for every parameter.
  muon   Muon for the blocks' weight matrices, AdamW for the rest (distlm/optim/muon.py); its
         whole-matrix work is dealt over the ranks by distlm/parallel/whole_matrix.py.
  lion   the sign of an interpolated momentum, one state tensor per parameter
         (distlm/optim/lion.py, which says why it was the third).

Adding an optimizer: a module here with its ``Spec``, one line in ``REGISTRY``, its name in
``OptimConfig.name``'s choices and a dataclass of its settings as ``OptimConfig.NAME``
(distlm/config.py: ``optim.NAME.*``). A setting it can only choose on the machine that runs it
(Muon's Newton-Schulz dtype) is its spec's ``resolve``.
"""
from __future__ import annotations

from distlm.config import Config, ConfigError
from distlm.optim.adamw import AdamWSpec
from distlm.optim.base import KINDS, MATRIX, OTHER, BuildContext, Spec, StateTensor
from distlm.optim.lion import LionSpec
from distlm.optim.muon import MuonSpec

REGISTRY: dict[str, Spec] = {spec.name: spec for spec in (AdamWSpec(), MuonSpec(), LionSpec())}


def spec_for(cfg: Config) -> Spec:
    """The registered optimizer ``optim.name`` names."""
    try:
        return REGISTRY[cfg.optim.name]
    except KeyError:
        raise ConfigError(f"optim.name: {cfg.optim.name!r} is not one of {', '.join(REGISTRY)}") from None


__all__ = ["BuildContext", "KINDS", "MATRIX", "OTHER", "REGISTRY", "Spec", "StateTensor", "spec_for"]
