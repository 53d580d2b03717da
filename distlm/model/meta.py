"""Building a model on the meta device without paying for its initialisation.

A module's constructor initialises its parameters (``reset_parameters``: ``nn.init.normal_``,
``kaiming_uniform_``, ...) whatever the device. On the meta device there is nothing to
initialise, yet torch still runs the meta forms of the random fills, which are Python
decompositions, and the first of them imports torch's compiler (dynamo): 1.5-2.5 s on the
2-core CPU box (2026-12-01), paid by every process that builds a model on meta without compiling
(a CPU run, `distlm eval`, `generate`, `plan`, an eager GPU run). ``on_meta()`` is
``torch.device("meta")`` with those fills skipped on meta tensors: the same parameters, shapes
and names, no work. distlm initialises the weights itself once they are allocated
(``GPT.init_weights``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

# What a constructor fills a new parameter with: every public initialiser of torch.nn.init, and
# the tensor methods they (or a module itself) call.
_FILLS = frozenset(getattr(nn.init, name) for name in dir(nn.init)
                   if name.endswith("_") and not name.startswith("_") and callable(getattr(nn.init, name))) | {
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_, torch.Tensor.random_,
    torch.Tensor.bernoulli_, torch.Tensor.exponential_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
    torch.Tensor.geometric_}


class _SkipMetaFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS:
            # torch.nn.init's functions pass their tensor by keyword, the methods as self
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """``torch.device("meta")``, with parameter fills on meta tensors left out."""
    with torch.device("meta"), _SkipMetaFills():
        yield
