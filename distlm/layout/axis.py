"""What one parallel axis is: the base class every axis of the registry (distlm/layout/__init__.py) derives from.

An axis is one way of spreading a step over ranks, with a degree (``parallel.<name>``), a
dimension of the device mesh of the same name, and the answers below. The class
attributes say what ranks along the axis share and what they split, and hold only where
its degree is above 1; ``Layout`` combines them into the named questions the rest of
distlm asks (``Layout.shards_parameters``, ``Layout.data_axes``, ...). The methods are the
axis's own rules: ``supports`` refuses a config it cannot run, with a one-line error.

Nothing here imports torch or the config: the rules run inside ``load_config`` (the
config module imports this package), and on the command line before torch is loaded.
"""
from __future__ import annotations

from typing import Optional


class Axis:
    name: str = ""    # parallel.<name>, Layout.<name> and the mesh dimension
    label: str = ""   # its part of a layout's name, e.g. "fsdp" in fsdp4

    # -- what ranks along the axis do, where its degree is above 1 -------------------------
    feeds_data: bool = False
    # ^ they read different rows of the global batch: the data mesh (the loaders' dp_rank
    #   and dp_size) is the product of these axes
    gradients: Optional[str] = None
    # ^ how the data-parallel wrappers average gradients over it: "replicate" (an
    #   all-reduce: DDP, or HSDP's outer dimension) or "shard" (a reduce-scatter into
    #   parameter shards: FSDP2's dimension); None: not averaged over it
    averages_loss: bool = False
    # ^ the step's mean loss is a mean over these ranks too (each holds different tokens)
    splits_forward: bool = False
    # ^ a forward runs in pieces that need the other ranks between blocks or stages
    #   (FSDP2's per-block gathers, TP's collectives, PP's stages): no whole-model graph
    splits_sequence: bool = False
    # ^ each rank holds a part of every row (the per-batch hook cuts it, distlm/parallel/plan.py)
    distributes_logits: bool = False
    # ^ the logits come out as DTensors spread over these ranks (TP's vocabulary shards)
    loss_outside_model: bool = False
    # ^ the model cannot compute its own loss (GPT.head_loss): the logits leave it as
    #   DTensors, or the pipeline schedule computes the loss on its last stage
    partial_model: Optional[str] = None
    # ^ why a rank along it does not hold the whole model (it cannot sample text alone);
    #   None: it holds all of it

    # -- the axis's rules ----------------------------------------------------------------------
    def gradient_role(self, layout) -> Optional[str]:
        """``gradients`` in ``layout``: an axis whose role depends on the other axes says so here."""
        return self.gradients

    def check_model(self, m, p, degree: int) -> None:
        """Refuse a model this axis cannot split at ``degree`` (ConfigError). ``m``: the
        model section, ``p``: the parallel one. Run again once the data has fixed the
        vocabulary."""

    def supports(self, cfg, layout) -> None:
        """Refuse, with a one-line ConfigError, a config this axis cannot run at its degree
        in ``layout`` (a ``Layout``); runs inside config validation for every axis, also at
        degree 1 (an option of this axis set without the axis)."""

    def sequence_divisor(self, cfg, degree: int) -> int:
        """What every row length must be a multiple of for this axis to cut it."""
        return 1

    def micro_batch_sizes(self, sizes: list[int], local: int, cfg, degree: int) -> list[int]:
        """Of ``sizes`` (divisors of the ``local`` batch, largest first), those this axis can
        run, best first (the auto micro-batch takes the first that fits in memory)."""
        return sizes


def token_id_extras(m) -> list[str]:
    """The model options that need more than the residual stream inside the blocks (the token
    ids, or earlier blocks' outputs), as "model.key=value", for the places that cannot give it:
    a pipeline stage, the classifier's trunk."""
    return [f"model.{k}={getattr(m, k)}" for k, off in (("value_embeds", 0), ("skip_connections", False),
                                                         ("attn_mask", "causal"), ("attn_window", 0))
            if getattr(m, k) != off]
