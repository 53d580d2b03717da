"""The parallel layout: one type for the degrees, and the registry of the axes they belong to.

``Layout`` holds one degree per registered axis and answers the questions the rest of
distlm asks about it, by name, instead of comparing degrees: does it shard parameters,
split the forward, split the sequence; which mesh dimensions feed data, average the
gradients, take the loss's mean; what a row length must divide by; does it split nothing.
``distlm.parallel.dims.ParallelDims`` is a Layout plus this process's place in it (rank,
device mesh); the planner's ``Candidate`` is a Layout plus activation checkpointing and a
pipeline schedule. Each axis (distlm/layout/axis.py) owns its rules and its costs:
``check_layout`` runs every axis's ``check_model`` and ``supports`` inside config
validation, so a refusal is one line naming the field, before anything is built; the
planner (distlm/planner.py) sums what each axis reports of a step's memory, traffic and
time, and weighs only the layouts the axes accept (``check_split``).

Everything that lists the axes is derived from ``AXES``: the fields of ``Layout`` (in the
registry's order, so that ``Layout(2, 1, 2)`` reads dp_replicate, dp_shard, tp), the
degree fields of the config's parallel section (``with_degrees``: ``parallel.<name>``, its
help line the axis's, ahead of the section's own fields), ``MESH_ORDER`` (by each axis's
``mesh_rank``), the layouts' names and overrides, the planner's table of collectives.

Adding an axis (a sequence axis ``cp``, say):

1. ``distlm/layout/<room>.py``: a subclass of ``Axis`` with ``name = "cp"``, its ``label``
   (``"cp"``), ``help`` (the config field's line), ``mesh_rank`` (its place in the mesh,
   between the ranks of the axes it sits between: tp stays innermost, on the fastest links),
   the class attributes that say what its ranks share (a sequence axis:
   ``splits_sequence = True``, ``averages_loss = True``, ``gradients = "shard"`` to average
   the gradients over it with the data shards), the engines, model kinds and task needs it
   runs with (``engines``, ``model_kinds``, ``plans_for_lm_head``; a task's needs are
   distlm/layout/needs.py), its rules (``supports``: what else it refuses, one line each;
   ``sequence_divisor``, e.g. ``2 * degree``; ``check_model``) and its costs for the planner
   (``divides("rows", ...)``, ``saved_per_layer``, ``bytes_sent``, ``critical_path``, ...).
2. Here: the axis in ``AXES``, after the others (the order of the config's fields, of
   ``Layout``'s positional degrees and of layout names). Positivity, the mesh
   (``ParallelDims.build_mesh``), the flattened meshes the roles name (data, loss, gradient
   averaging: distlm/parallel/dims.py and fsdp.py), the world-size check, the planner's
   candidates and estimate, and the layout names follow from the registry.
3. Its runtime: ``distlm/parallel/<room>.py`` with ``apply_<room>(model, dims, cfg)``,
   called in ``distlm/parallel/parallelize.py`` in its place in the order. Where every
   micro-batch must change (a sequence axis: this rank's part of each row, and the
   positions of those tokens), ``apply_`` returns a per-batch hook, a callable
   ``Batch -> Batch`` (distlm/parallel/applied.py), which parallelize adds to the plan's
   ``batch_hooks``: the step runs every micro-batch through them before the forward, and
   passes ``Batch.forward`` (e.g. ``{"shard": ...}``) to the model as keyword arguments.

The train/ and tasks/ packages never compare degrees (tests/test_layout.py fails on
any such condition): they ask the layout or the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from distlm.errors import ConfigError
from distlm.layout.axis import PARTS, Axis, SplitRefusal, Work, model_kind, token_id_extras
from distlm.layout.context import Context
from distlm.layout.data import DataReplicate, DataShard
from distlm.layout.expert import Expert
from distlm.layout.needs import TASKS, TaskNeeds, needs_of
from distlm.layout.pipeline import Pipeline
from distlm.layout.tensor import Tensor

# The registry: every axis, in the order of the config's fields and of layout names (ddp2xtp2).
AXES: tuple[Axis, ...] = (DataReplicate(), DataShard(), Tensor(), Pipeline(), Context(), Expert())
# The device mesh's dimensions, outermost first (each axis's mesh_rank says why it sits where it does).
MESH_ORDER: tuple[str, ...] = tuple(a.name for a in sorted(AXES, key=lambda a: a.mesh_rank))


def axis_named(name: str) -> Axis:
    return next(a for a in AXES if a.name == name)


def with_degrees(make_field: Callable[[Axis], Any] = lambda a: field(default=1), **dataclass_options):
    """A class decorator: the class as a dataclass (``dataclass_options``) whose first fields
    are the degrees, an ``int`` per axis of ``AXES`` in its order, each made by ``make_field``
    (default 1), then the class's own. ``Layout`` and the config's parallel section are made
    so: an axis is a field of both by its registration alone."""
    def make(cls):
        own = cls.__dict__.get("__annotations__", {})
        taken = [a.name for a in AXES if a.name in own]
        if taken:
            raise TypeError(f"{cls.__name__} declares {', '.join(taken)}, the degree of a registered axis")
        cls.__annotations__ = {**{a.name: "int" for a in AXES}, **own}
        for a in AXES:
            setattr(cls, a.name, make_field(a))
        return dataclass(**dataclass_options)(cls)
    return make


@with_degrees()
class Layout:
    """The degrees, one per axis of ``AXES``; 1 = not split along it."""

    @classmethod
    def of(cls, p) -> "Layout":
        """The layout a parallel config section (or anything with the degrees) asks for."""
        return cls(**{a.name: getattr(p, a.name) for a in AXES})

    def degree(self, axis: Axis) -> int:
        return getattr(self, axis.name)

    def degrees(self) -> dict[str, int]:
        return {a.name: self.degree(a) for a in AXES}

    def active(self, in_mesh_order: bool = False) -> list[Axis]:
        """The axes whose degree is above 1."""
        axes = [axis_named(n) for n in MESH_ORDER] if in_mesh_order else AXES
        return [a for a in axes if self.degree(a) > 1]

    @property
    def size(self) -> int:
        """Ranks the layout needs."""
        return math.prod(self.degrees().values())

    def _product(self, names: tuple[str, ...]) -> int:
        return math.prod(getattr(self, n) for n in names)

    def _roles(self, keep) -> tuple[str, ...]:
        return tuple(n for n in MESH_ORDER if keep(axis_named(n)))

    # -- which mesh dimensions do what (names in mesh order, whatever the degrees) ------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The dimensions whose ranks read different rows: flattened, the data mesh."""
        return self._roles(lambda a: a.feeds_data)

    @property
    def loss_axes(self) -> tuple[str, ...]:
        """The dimensions the step's mean loss is averaged over."""
        return self._roles(lambda a: a.averages_loss)

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        """The dimensions gradients are all-reduced over (DDP's, HSDP's outer one)."""
        return self._roles(lambda a: a.gradient_role(self) == "replicate")

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The dimensions gradients are reduce-scattered over into parameter shards (FSDP2's)."""
        return self._roles(lambda a: a.gradient_role(self) == "shard")

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: how many different local batches a step reads."""
        return self._product(self.data_axes)

    @property
    def loss_size(self) -> int:
        return self._product(self.loss_axes)

    @property
    def replicate_degree(self) -> int:
        return self._product(self.replicate_axes)

    @property
    def shard_degree(self) -> int:
        return self._product(self.shard_axes)

    # -- what is split --------------------------------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        """Each rank holds a slice of every parameter, gradient and optimizer state (FSDP2)."""
        return self.shard_degree > 1

    @property
    def splits_forward(self) -> bool:
        """A forward runs in pieces that need other ranks between blocks or stages, so the
        model is no single graph (FSDP2, TP, PP)."""
        return any(a.splits_forward for a in self.active())

    @property
    def splits_sequence(self) -> bool:
        """Each rank holds a part of every row."""
        return any(a.splits_sequence for a in self.active())

    @property
    def distributes_logits(self) -> bool:
        """The logits come out as DTensors (TP's vocabulary shards): the loss must take them so."""
        return any(a.distributes_logits for a in self.active())

    @property
    def model_computes_loss(self) -> bool:
        """The model's forward can compute the loss itself (GPT.head_loss: compiled with the
        blocks, chunkable by model.loss_chunk)."""
        return not any(a.loss_outside_model for a in self.active())

    @property
    def schedules_microbatches(self) -> bool:
        """A schedule runs a step's micro-batches through the ranks (a pipeline's)."""
        return any(a.schedules_microbatches for a in self.active())

    @property
    def why_not_whole_model(self) -> Optional[str]:
        """Why a rank does not hold the whole model (None: it does), outermost axis first."""
        return next((a.partial_model for a in self.active(in_mesh_order=True) if a.partial_model), None)

    @property
    def holds_whole_model(self) -> bool:
        return self.why_not_whole_model is None

    def sequence_divisor(self, cfg) -> int:
        """What every row length must be a multiple of (each splitting axis cuts it further)."""
        return math.prod(a.sequence_divisor(cfg, self.degree(a)) for a in AXES)

    def micro_batch_sizes(self, sizes: list[int], local: int, cfg) -> list[int]:
        """Of the divisors ``sizes`` of the ``local`` batch (largest first), those the axes can
        run, best first."""
        for a in AXES:
            sizes = a.micro_batch_sizes(sizes, local, cfg, self.degree(a))
        return sizes

    # -- names --------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "x".join(f"{a.label}{self.degree(a)}" for a in self.active()) or "single"

    def overrides(self) -> str:
        return " ".join(f"parallel.{a.name}={self.degree(a)}" for a in self.active())


def check_model_split(m, p) -> None:
    """Each axis's refusals of the model it would split (``m``: the model section, ``p``: the
    parallel one), a ``SplitRefusal``; again once the data has fixed the vocabulary."""
    layout = Layout.of(p)
    kind = model_kind(m)
    for a in AXES:
        degree = layout.degree(a)
        if degree > 1 and kind not in a.model_kinds:
            raise SplitRefusal(a.refuse_kind(m, degree), "model.moe.experts", m.moe.experts)
        a.check_model(m, p, degree)


def check_split(cfg) -> None:
    """Every axis's rules for the layout ``cfg.parallel`` asks for: the model it splits, the
    engine and the task it runs under (asked of every axis alike), the rest of the config
    (``supports``), and a whole-model compile's. Not the batch: the planner asks this of each
    layout it weighs, for a batch of its own. Raises ConfigError."""
    t, p = cfg.train, cfg.parallel
    layout = Layout.of(p)
    check_model_split(cfg.model, p)
    needs = needs_of(cfg)
    for a in AXES:
        degree = layout.degree(a)
        if degree > 1:
            _check_engine_and_task(a, degree, cfg, needs)
        a.supports(cfg, layout)
    # compile=auto is on wherever a GPU is: an explicit scope=model is refused with it too.
    if t.compile is not False and t.compile_scope == "model" and layout.splits_forward:
        raise ConfigError("train.compile_scope=model compiles the whole forward, which FSDP2, TP and PP split "
                          "into per-block or per-stage pieces; use train.compile_scope=block with them")


def _check_engine_and_task(a: Axis, degree: int, cfg, needs: TaskNeeds) -> None:
    p, task = cfg.parallel, cfg.task.name
    if p.engine not in a.engines:
        runs = ", ".join(f"parallel.{x.name}" for x in AXES if p.engine in x.engines)
        raise ConfigError(f"parallel.engine={p.engine} does data parallelism only ({runs}); "
                          f"parallel.{a.name}={degree} needs parallel.engine={' or '.join(a.engines)}")
    if needs.whole_rows and a.splits_sequence:
        raise ConfigError(f"task.name={task} does not support parallel.{a.name}={degree}: its head reads whole rows, "
                          f"which parallel.{a.name} cuts over ranks; use data parallelism (parallel.dp_replicate or "
                          f"parallel.dp_shard)")
    if not needs.lm_head and a.plans_for_lm_head:
        raise ConfigError(f"task.name={task} does not support parallel.{a.name}={degree}: its plans are written for "
                          f"the language model's blocks and head; use data parallelism (parallel.dp_replicate or "
                          f"parallel.dp_shard)")


def check_layout(cfg) -> None:
    """Every axis's rules for the whole config (``check_split``), then how the batch splits:
    each axis's ``check_batch`` and the batch over the data ranks. Raises ConfigError."""
    t = cfg.train
    check_split(cfg)
    layout = Layout.of(cfg.parallel)
    for a in AXES:
        a.check_batch(cfg, layout)
    dp = layout.dp_size
    micro = 1 if t.micro_batch_size is None else t.micro_batch_size
    if t.micro_batch_size is None and t.global_batch_size % dp:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a multiple of the data-parallel "
                          f"degree {dp}, so that every rank gets a whole local batch; use "
                          f"train.global_batch_size={-(-t.global_batch_size // dp) * dp}")
    if t.global_batch_size % (micro * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel degree {dp}{_batch_hint(t, dp)}")


def _batch_hint(t, dp: int) -> str:
    """What would work: the largest micro-batch that splits the local batch, or the global
    batch rounded up to a whole number of micro-batches on every rank."""
    fixes = []
    if t.global_batch_size % dp == 0:
        local = t.global_batch_size // dp
        fixes.append(f"train.micro_batch_size={max(m for m in range(1, min(local, t.micro_batch_size) + 1) if local % m == 0)}")
    step = t.micro_batch_size * dp
    fixes.append(f"train.global_batch_size={-(-t.global_batch_size // step) * step}")
    return "; use " + " or ".join(fixes)


__all__ = ["AXES", "MESH_ORDER", "PARTS", "TASKS", "Axis", "Layout", "SplitRefusal", "TaskNeeds", "Work",
           "axis_named", "check_layout", "check_model_split", "check_split", "model_kind", "needs_of",
           "token_id_extras", "with_degrees"]
