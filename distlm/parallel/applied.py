"""What ``parallelize()`` returns: the model to train, the step that drives it, and all the
step needs to know of the layout: the parallel plan as applied to this model on this rank
(``ParallelPlan``, with its per-batch hooks). Named for that, apart from distlm/planner.py,
which estimates layouts before anything is built (`distlm plan`).

The Trainer and the tasks ask the plan, never the degrees (tests/test_layout.py fails on a
condition in distlm/train/ or distlm/tasks/ that names one):

    compute()                       the context every forward and backward runs under:
                                    autocast, the attention backend order, TP's loss_parallel
    shard_batch(x, y)               the per-batch hook: a micro-batch as this rank runs it
    model_computes_loss             the loss choice: the model's own (GPT.head_loss), or the
    distributes_logits              task's on logits that are DTensors (TP) or on a stage (PP)
    evaluates_through_training_graph  whether evaluation may reuse the training graphs
    why_no_samples                  why this rank cannot draw samples (None: it can)

What must be known before the model is built (the auto compile scope, loss chunking and
micro-batch, distlm/train/fast_defaults.py) is asked of the layout the plan is made for,
``ParallelDims`` (a ``Layout``: ``splits_forward``, ``model_computes_loss``,
``micro_batch_sizes``), which the plan answers from in turn.

The per-batch hook. Every micro-batch, in training and in evaluation, goes through the
plan's ``batch_hooks`` in order before the forward: each is a callable ``Batch -> Batch``
returned by an axis's ``apply_*`` in ``parallelize`` (none today, so the batch passes as it
is). A sequence axis returns one that keeps this rank's part of every row in ``inputs`` and
``targets`` and puts what the model needs to place those tokens in ``forward``, e.g.
``{"shard": SequenceShard(...)}`` with their positions (a position offset, or position ids)
and the attention across ranks; the step passes ``forward`` to the model, through the
task's loss, as keyword arguments: ``loss(model, inputs, targets, **forward)``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

from distlm.parallel.dims import ParallelDims


class Batch(NamedTuple):
    """One micro-batch as this rank runs it."""
    inputs: torch.Tensor
    targets: torch.Tensor
    forward: Mapping[str, Any] = {}  # keyword arguments for the model's forward (never mutated)


BatchHook = Callable[[Batch], Batch]


def compute_context(device: torch.device, amp_dtype: Optional[torch.dtype], loss_parallel: bool = False,
                    compiler_settings: tuple[tuple[str, Any], ...] = ()):
    """What every forward/backward runs under: bf16 autocast (when asked), the SDPA backend
    order on CUDA, TP's ``loss_parallel`` (the logits are vocabulary-sharded DTensors), and the
    compiler settings the layout asks for (``compiler_settings``: torch._dynamo.config names and
    values, set only while the model runs, as that is when dynamo compiles)."""
    stack = contextlib.ExitStack()
    if compiler_settings:
        # Bound to its own name: a bare `import torch._dynamo` here would make `torch` a local of
        # this function, unbound on the paths that skip this branch.
        import torch._dynamo as dynamo
        stack.enter_context(dynamo.config.patch(**dict(compiler_settings)))
    if amp_dtype is not None:
        stack.enter_context(torch.autocast(device.type, dtype=amp_dtype))
    if device.type == "cuda":
        # Measured on H100 (bf16, T=1024, hd=64, fwd+bwd): cuDNN attention 0.51 ms, flash 0.69 ms,
        # memory-efficient 1.25 ms. PyTorch's default order tries flash first; put cuDNN first.
        from torch.nn.attention import SDPBackend, sdpa_kernel
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        stack.enter_context(sdpa_kernel(order, set_priority=True))
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as lp
        stack.enter_context(lp())
    return stack


class ParallelPlan(NamedTuple):
    """A tuple whose first two fields are what ``parallelize`` (the model to train) and the
    Trainer's ``build_model`` (the plain module inside) returned in those places before the
    plan existed, so code that indexes them reads the same."""
    model: nn.Module             # to train: a DDP wrapper, or the model sharded in place
    module: nn.Module            # the plain module inside it (under PP: this rank's stages)
    step: Any                    # PlainStep or PipelineStep (distlm/parallel/step.py)
    dims: ParallelDims
    device: torch.device
    amp_dtype: Optional[torch.dtype] = None
    loss_parallel: bool = False  # the vocabulary-sharded logits' cross-entropy (parallel.loss_parallel)
    batch_hooks: tuple[BatchHook, ...] = ()
    compiler_settings: tuple[tuple[str, Any], ...] = ()  # compute_context's: parallelize's choice

    def compute(self):
        return compute_context(self.device, self.amp_dtype, self.loss_parallel, self.compiler_settings)

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        batch = Batch(x, y)
        for hook in self.batch_hooks:
            batch = hook(batch)
        return batch

    @property
    def model_computes_loss(self) -> bool:
        return self.dims.model_computes_loss

    @property
    def distributes_logits(self) -> bool:
        return self.dims.distributes_logits

    @property
    def evaluates_through_training_graph(self) -> bool:
        """Whether the training graphs can evaluate too: not where the forward is split
        (FSDP2, TP and pipeline stages keep their own per-forward state for a backward)."""
        return not self.dims.splits_forward

    @property
    def why_no_samples(self) -> Optional[str]:
        """Generation needs the whole model in one process (one process, DDP, Horovod).
        Gathering it onto the main rank at every evaluation would cost the memory and
        traffic the layout was chosen to avoid: `distlm generate` samples the checkpoints."""
        return self.dims.why_not_whole_model
