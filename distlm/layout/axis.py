"""What one parallel axis is: the base class every axis of the registry (distlm/layout/__init__.py) derives from.

An axis is one way of spreading a step over ranks, with a degree (``parallel.<name>``), a
dimension of the device mesh of the same name, and the answers below. The class
attributes say what ranks along the axis share and what they split, and hold only where
its degree is above 1; ``Layout`` combines them into the named questions the rest of
distlm asks (``Layout.shards_parameters``, ``Layout.data_axes``, ...). The methods are the
axis's own rules (``supports`` refuses a config it cannot run, with a one-line error) and
its costs, which the planner (distlm/planner.py) sums over the axes for a ``Work``: how it
divides the tokens, the weights and the activations of a rank, what it adds to them, the
bytes its collectives send per step and whether the compute waits for them.

Nothing here imports torch, the config or the model: the rules run inside ``load_config``
(the config module imports this package), and on the command line before torch is loaded;
the planner hands the costs the model's figures in ``Work``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from distlm.errors import ConfigError

# What an axis may divide on a rank (``Axis.divides``; ``Work.divisor``): the tokens of each
# row, the weights TP splits (a block's matrices, the embedding and the head), the per-head and
# per-FF-unit activations, the residual stream between the blocks, the logits' vocabulary, the
# routed experts.
PARTS = ("rows", "matrices", "heads", "residual", "vocab", "experts")


class Axis:
    name: str = ""    # parallel.<name>, Layout.<name> and the mesh dimension
    label: str = ""   # its part of a layout's name, e.g. "fsdp" in fsdp4
    help: str = ""    # the config field's line (docs/cli.md)
    mesh_rank: int = 0
    # ^ its place in the device mesh, outermost (lowest) first; gaps leave room for an axis
    #   between two others. Inner dimensions are consecutive ranks: a node's fast links.
    collective: str = ""  # what its traffic is, for the planner's table (e.g. "token all-to-all")

    # -- what ranks along the axis do, where its degree is above 1 -------------------------
    data_parallel: bool = False
    # ^ one of the data-parallel wrappers' own axes (DDP's replicas, FSDP2's shards): the
    #   planner spreads the ranks the other axes leave over them
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
    # ^ each rank holds a part of every row (the per-batch hook cuts it, distlm/parallel/applied.py);
    #   a task whose head needs whole rows is refused (needs.py)
    distributes_logits: bool = False
    # ^ the logits come out as DTensors spread over these ranks (TP's vocabulary shards)
    loss_outside_model: bool = False
    # ^ the model cannot compute its own loss (GPT.head_loss): the logits leave it as
    #   DTensors, or the pipeline schedule computes the loss on its last stage
    schedules_microbatches: bool = False
    # ^ a schedule runs a step's micro-batches through it (the pipeline's), so FSDP2 gathers a
    #   stage's weights once a step rather than once a micro-batch
    partial_model: Optional[str] = None
    # ^ why a rank along it does not hold the whole model (it cannot sample text alone);
    #   None: it holds all of it
    plans_for_lm_head: bool = False
    # ^ its plans are written for the language model's blocks and head (TP's vocabulary-parallel
    #   head, PP's stages): a task without that head is refused (needs.py)
    engines: tuple[str, ...] = ("torch",)
    # ^ the data-parallel engines (parallel.engine) it runs under; Horovod does replicas only
    model_kinds: tuple[str, ...] = ("dense", "moe")
    # ^ the models it splits (``model_kind``): an axis for dense models only refuses a mixture
    #   of experts, whose experts are 3-D parameters its plans do not cut

    # -- the axis's rules ----------------------------------------------------------------------
    def gradient_role(self, layout) -> Optional[str]:
        """``gradients`` in ``layout``: an axis whose role depends on the other axes says so here."""
        return self.gradients

    def refuse_kind(self, m, degree: int) -> str:
        """The one line that refuses a model of a kind this axis does not split."""
        return (f"model.moe.experts={m.moe.experts} does not support parallel.{self.name}={degree}: an MoE model "
                f"runs under data and expert parallelism (parallel.dp_replicate, parallel.dp_shard, parallel.ep)")

    def check_model(self, m, p, degree: int) -> None:
        """Refuse a model this axis cannot split at ``degree`` (a ``SplitRefusal``). ``m``: the
        model section, ``p``: the parallel one. Run again once the data has fixed the
        vocabulary."""

    def supports(self, cfg, layout) -> None:
        """Refuse, with a one-line ConfigError, a config this axis cannot run at its degree
        in ``layout`` (a ``Layout``); runs inside config validation for every axis, also at
        degree 1 (an option of this axis set without the axis). The engine and the task's
        needs are asked of every axis before (``engines``, ``plans_for_lm_head``,
        ``splits_sequence``)."""

    def check_batch(self, cfg, layout) -> None:
        """Refuse a global batch this axis cannot split as the config asks (ConfigError); the
        planner, which weighs layouts for a batch it is given, asks ``supports`` alone."""

    def sequence_divisor(self, cfg, degree: int) -> int:
        """What every row length must be a multiple of for this axis to cut it."""
        return 1

    def micro_batch_sizes(self, sizes: list[int], local: int, cfg, degree: int) -> list[int]:
        """Of ``sizes`` (divisors of the ``local`` batch, largest first), those this axis can
        run, best first (the auto micro-batch takes the first that fits in memory)."""
        return sizes

    # -- the axis's costs (distlm/planner.py), asked at every degree, 1 included ----------------
    critical_path: bool = False
    # ^ its collectives sit between the matmuls that need them, so the compute waits for them;
    #   otherwise they overlap the backward pass in part (the planner's DP_EXPOSED)
    paces_host: bool = False
    # ^ ``host_s`` can be what the GPU waits for: the planner reports its share as <name>_host

    def not_weighed(self, m, degree: int) -> Optional[str]:
        """Why the planner leaves ``degree`` out for model ``m`` although this axis runs it (a
        layout that only adds waiting), one line; None: it weighs it."""
        return None

    def divides(self, part: str, degree: int, w: "Work") -> int:
        """How many ways it divides ``part`` (one of ``PARTS``) on a rank."""
        return 1

    def busiest_stage(self, w: "Work", degree: int) -> Optional[tuple[int, float]]:
        """(blocks, parameters of the embedding and head) on the busiest rank, where this axis
        takes the model apart along its depth; None: it does not."""
        return None

    def saved_per_layer(self, w: "Work", degree: int) -> float:
        """Bytes per block a rank keeps for the backward pass beyond the block's own tensors."""
        return 0.0

    def in_flight(self, w: "Work", degree: int) -> int:
        """Micro-batches whose saved activations a rank holds at once."""
        return 1

    def bubble(self, w: "Work", degree: int) -> float:
        """The part of a step a rank waits for the others (a pipeline's start and end)."""
        return 0.0

    def buffer_bytes(self, w: "Work", degree: int) -> float:
        """Bytes of the buffers its collectives hold (FSDP2's gathered weights)."""
        return 0.0

    def bytes_sent(self, w: "Work", degree: int) -> Optional[float]:
        """Bytes a rank sends per step in this axis's collectives (ring algorithms: 2(n-1)/n of
        the payload for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter); None:
        it runs none."""
        return None

    def traffic_axis(self, layout) -> str:
        """The mesh dimension whose links its collectives cross: its own, or for a role that
        several axes share, the group's outermost."""
        return self.name

    def compute_efficiency(self, degree: int) -> float:
        """What the compute keeps of its speed with the matmuls this axis narrows."""
        return 1.0

    def host_s(self, w: "Work", degree: int) -> float:
        """Seconds of host (CPU) time per step its wrapped modules cost, run beside the GPU."""
        return 0.0

    def optimizer_slowdown(self, degree: int) -> float:
        """How much slower the optimizer step runs over the parameters as this axis holds them."""
        return 1


class SplitRefusal(ConfigError):
    """An axis's refusal of the model it would split, naming the model's setting in the way
    (``field``, ``value``): `distlm plan` groups the degrees it skips by them."""

    def __init__(self, message: str, field: str, value: Any):
        super().__init__(message)
        self.field, self.value = field, value


def model_kind(m) -> str:
    """What an axis splits: "moe" (a mixture of experts in some blocks) or "dense"."""
    return "moe" if m.moe.enabled else "dense"


@dataclass
class Work:
    """One step of a layout as the planner prices it: the model's figures (counted by the
    planner from the model, which this package cannot import), then what the axes make of
    them on the busiest rank. Parameter counts are elements; sizes in bytes."""
    layout: Any                      # the planner's Candidate: the degrees, ac, schedule
    micro_batch: int                 # sequences per forward
    n_mb: int                        # micro-batches per step on a rank
    block_size: int                  # tokens per row
    d_model: int
    compute_bytes: int               # 2 for bf16 autocast, 4 for fp32
    sequence_parallel: bool
    loss_parallel: bool
    block_split: float               # one block's parameters TP splits (its matrices)
    block_whole: float               # one block's parameters every TP rank holds (norms, biases)
    emb: float                       # the embedding's parameters, the head's, the rest outside
    head: float                      # the blocks (final norm, ...), and the value-embedding
    extra: float                     # tables
    tables: float
    n_layer: int
    stage_blocks: Callable[[int], int]  # the blocks of the busiest of n pipeline stages
    moe_layers: int = 0              # MoE blocks
    top_k: int = 0                   # experts each token runs
    experts: float = 0.0             # the routed experts' parameters, whole model
    divisors: dict = field(default_factory=dict)  # part -> how many ways the axes divide it
    # what the axes make of the model on the busiest rank (set by the planner)
    rows: float = 0.0                # tokens of each row on a rank
    blocks: int = 0                  # blocks on the busiest rank
    n_local: float = 0.0             # parameters a rank holds before the shard role divides
                                     # them, the routed experts aside
    n_experts: float = 0.0           # the routed experts' parameters on a rank

    def divisor(self, part: str) -> int:
        return self.divisors.get(part, 1)


def token_id_extras(m) -> list[str]:
    """The model options that need more than the residual stream inside the blocks (the token
    ids, or earlier blocks' outputs), as "model.key=value", for the places that cannot give it:
    a pipeline stage, the classifier's trunk."""
    return [f"model.{k}={getattr(m, k)}" for k, off in (("value_embeds", 0), ("skip_connections", False),
                                                         ("attn_mask", "causal"), ("attn_window", 0))
            if getattr(m, k) != off]
