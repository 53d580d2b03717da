"""The topology object: the layout (degrees, distlm/layout/), one DeviceMesh with named axes, this rank's place.

Passed explicitly to whatever needs it; never held as a global.
Launch: ``torchrun --nproc_per_node 4 -m distlm train parallel.dp_shard=4``.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from distlm.config import ConfigError, ParallelConfig
from distlm.layout import MESH_ORDER, Layout


@dataclass(kw_only=True)
class ParallelDims(Layout):
    """The layout this process runs (the degrees and every named question: distlm/layout/)
    and its place in it. The degrees stay positional, ``ParallelDims(2, 1, 1, 1, world_size=2)``;
    the rest is by keyword."""
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    mesh: Optional[object] = field(default=None, repr=False)
    dp_mesh: Optional[object] = field(default=None, repr=False)    # the data axes flattened ("dp")
    loss_mesh: Optional[object] = field(default=None, repr=False)  # the loss axes flattened (the data mesh when the same)

    def __post_init__(self):
        product = self.size
        if product != self.world_size:
            degrees = " x ".join(f"{name}={k}" for name, k in self.degrees().items())
            raise ConfigError(
                f"parallel degrees {degrees} = {product}, but the world size is {self.world_size}"
                + (f"; add parallel.dp_replicate={self.world_size} (DDP) or parallel.dp_shard={self.world_size} "
                   f"(FSDP2)" if product == 1 else ""))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        if self.dp_mesh is None or self.dp_size == 1:
            return 0
        return self.dp_mesh.get_local_rank()

    def build_mesh(self, device_type: str, timeout_s: Optional[float] = None):
        """One mesh, a dimension per axis in MESH_ORDER (pp, dp_replicate, dp_shard, tp); size-1
        axes are kept so every layout addresses the same names. 'dp' is the data axes
        (Layout.data_axes) as one dimension, and the loss mesh the axes the loss is averaged over.

        A set of axes of which only one spans more than one rank is that axis: its ranks are the
        same as the set's, so it is used as it is rather than flattened. On GPUs every flattened
        dimension is one more NCCL communicator, split off the world's at start-up with a
        collective and holding buffers for the whole run; under plain DDP or FSDP2 three of them
        (the data, loss and shard-role dimensions) were copies of the one axis in use.

        The mesh's sub-groups do not inherit the world group's timeout: without an
        explicit one they wait 30 min (gloo) or 10 min (NCCL) on a hang, and every
        FSDP/DDP collective runs on a sub-group. So each axis gets the timeout too.

        An axis that spans every rank could reuse the world group instead (no options given),
        which on GPUs saves an NCCL communicator split at start-up. It is not done: DCP's
        async save (train.async_checkpoint) runs its collectives on the world group from a
        background thread, and DDP's and FSDP2's collectives must not interleave with them.
        """
        from torch.distributed.device_mesh import init_device_mesh
        names = MESH_ORDER
        shape = tuple(getattr(self, n) for n in names)
        opts = _group_options(device_type, timeout_s)
        override = {n: opts for n, k in zip(names, shape) if k > 1} if opts is not None else {}
        self.mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)
        self.dp_mesh = self._flatten(self.data_axes, "dp", self.dp_size, opts)
        self.loss_mesh = (self.dp_mesh if self.spanning(self.loss_axes) == self.spanning(self.data_axes)
                          else self._flatten(self.loss_axes, "loss", self.loss_size, opts))
        # A gradient role held by several axes (the data shards and a sequence axis, say) is
        # one dimension to DDP and FSDP2: flattened here, addressed by role_dim.
        for axes, size in ((self.replicate_axes, self.replicate_degree), (self.shard_axes, self.shard_degree)):
            if len(self.spanning(axes)) > 1:
                self._flatten(axes, self.role_dim(axes), size, opts)
        return self.mesh

    def spanning(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``axes`` that span more than one rank."""
        return tuple(a for a in axes if getattr(self, a) > 1)

    def role_dim(self, axes: tuple[str, ...]) -> str:
        """The mesh dimension a role's axes form: the one axis among them that spans more than
        one rank (the first axis when none does), else all of them flattened."""
        live = self.spanning(axes)
        if len(live) > 1:
            return "_".join(axes)
        return live[0] if live else axes[0]

    def _flatten(self, axes: tuple[str, ...], name: str, size: int, opts):
        """The mesh dimensions ``axes`` as one: the axis itself when at most one spans more than
        one rank, else all of them flattened, the size-1 ones between included so the flattened
        dimensions are contiguous (a collective on every rank: flattened in the same order
        everywhere, by build_mesh)."""
        if len(self.spanning(axes)) <= 1:
            return self.mesh[self.role_dim(axes)]
        flat = {"backend_override": opts} if opts is not None and size > 1 else {}
        return self.mesh[axes]._flatten(name, **flat)


def _group_options(device_type: str, timeout_s: Optional[float]):
    if not timeout_s:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return opts
    from torch._C._distributed_c10d import Backend  # the C++ Backend; its Options has no public alias
    return Backend.Options("gloo", timeout)


def _attempt_store(world: int, timeout: datetime.timedelta):
    """torchrun --max_restarts: the agent's store outlives a failed attempt, and the
    restarted workers read the dead attempt's keys when they build the mesh's sub-groups
    (gloo then times out in connectFullMesh). A key prefix per attempt keeps them apart.
    None (plain env:// init) when torchelastic does not host the store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"distlm_attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(cfg: ParallelConfig, device_type: str,
                     lap: Optional[Callable[[str], None]] = None) -> ParallelDims:
    """Read torchrun's environment; start the process group with a short timeout, then build
    the mesh. ``lap(name)``, where given, is called between the two, so a set-up clock can
    tell the world group's start from the mesh's groups."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = ParallelDims(**Layout.of(cfg).degrees(), world_size=world, rank=rank, local_rank=local_rank)
    if world > 1:
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            timeout = datetime.timedelta(seconds=cfg.timeout_s)
            store = _attempt_store(world, timeout)
            dist.init_process_group(backend, timeout=timeout, store=store, rank=rank if store else -1,
                                    world_size=world if store else -1,
                                    device_id=torch.device("cuda", local_rank) if device_type == "cuda" else None)
    if lap is not None:
        lap("device and process group")
    if world > 1:
        dims.build_mesh(device_type, cfg.timeout_s)
    return dims
