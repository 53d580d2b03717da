"""Whole matrices for an optimizer whose update needs them, each computed on one rank.

A matrix optimizer (Muon's Newton-Schulz orthogonalisation, a Shampoo or SOAP
preconditioner) transforms a whole weight matrix at a time, while each rank holds only its
shard of it (a DTensor under FSDP2 / TP / FSDP2 x TP / HSDP) or a replica that every rank of
the DDP group holds alike. ``WholeMatrices.map`` takes, per parameter, this rank's local
piece of some matrix-shaped tensor (a momentum, a gradient), and hands each piece back
transformed, as the same local piece of the transformed whole matrix:

  - matrices of one (mesh, placements, shape, tag) are stacked and dealt to the ranks in
    turn. The stack, sharded as each matrix is, is redistributed by DTensor so that every
    rank holds its share as whole matrices (an all-to-all under FSDP2 or TP), transformed
    there as one batch, and redistributed back. Under DDP, where every rank holds every
    matrix, each rank stacks its own share and the results come back in one all-gather.
    One redistribution pair per bucket, whatever the model's depth.
  - with no one to share the work with (one process, pipeline stages without data
    parallelism, Horovod), every rank transforms the matrices it holds, as one batch.

The transform must map zero matrices to zero matrices (the stack is padded with them) and
treat the matrices of a batch independently. Its tag (any hashable: Muon's split and step
count) is part of the bucket key, so matrices that need different treatment never share a
stack. Collective: every rank of a mesh calls ``map`` with its pieces in the same order.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

# One entry of the work: (parameter, this rank's local piece of the matrix-shaped tensor to
# transform, tag). The parameter gives the mesh, placements and global shape.
Item = tuple[torch.Tensor, torch.Tensor, Hashable]
Transform = Callable[[torch.Tensor, Hashable], torch.Tensor]
# apply(indices of the bucket's items, their local pieces of the result stacked in that order)
Apply = Callable[[list, torch.Tensor], None]


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def stacked_placements(placements) -> tuple:
    """The placements of one matrix, re-expressed for a stack of them (a new dim 0)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    out = []
    for pl in placements:
        # _StridedShard first: on some torch versions it subclasses Shard, on others not.
        if isinstance(pl, _StridedShard):
            out.append(_StridedShard(pl.dim + 1, split_factor=pl.split_factor))
        elif isinstance(pl, Shard):
            out.append(Shard(pl.dim + 1))
        else:
            out.append(pl)  # Replicate (Partial never reaches an optimizer: grads are reduced)
    return tuple(out)


def flat_coordinate(mesh) -> int:
    """This rank's index in the stack that nested Shard(0) placements give it (row-major)."""
    idx = 0
    for c, size in zip(mesh.get_coordinate(), mesh.shape):
        idx = idx * size + c
    return idx


class WholeMatrices:
    """Deals whole-matrix work over the ranks that hold a matrix.

    ``process_group``: the DDP group whose ranks hold replicated plain-tensor parameters
    (None: each rank transforms what it holds). DTensor parameters bring their own mesh.
    ``wire_dtype``: the dtype the pieces are stacked and redistributed in when the work is
    shared (None: their own); the transform receives that dtype.
    """

    def __init__(self, process_group=None, wire_dtype: Optional[torch.dtype] = None):
        self.process_group = process_group
        self.wire_dtype = wire_dtype
        self._ddp_mesh = None

    def map(self, items: Sequence[Item], transform: Transform, apply: Apply) -> int:
        """Transform every item's whole matrix once, somewhere; ``apply(indices, pieces)`` then
        receives, on each rank and once per bucket, the items' indices and a stack whose k-th
        entry is item ``indices[k]``'s local piece of the result (bucket by bucket, so only one
        bucket's results are alive at a time, and the caller can treat a bucket in one
        foreach pass). Returns how many matrices this rank transformed."""
        done = 0
        cursor: dict = {}  # per mesh: the stack slot where the next matrix goes
        for (mesh, placements, shape, tag), indices in self._buckets(items).items():
            done += self._bucket(mesh, placements, shape, tag, [items[i][1] for i in indices], indices,
                                 transform, apply, cursor)
        return done

    def _buckets(self, items: Sequence[Item]) -> dict:
        """Matrices that can be stacked: same mesh, placements, global shape and tag. Dict
        order follows the items' order, the same on every rank, so the collectives line up."""
        buckets: dict = {}
        for i, (p, _, tag) in enumerate(items):
            if hasattr(p, "device_mesh"):
                mesh, placements = p.device_mesh, tuple(p.placements)
            else:
                mesh, placements = self._replica_mesh(p), None
            buckets.setdefault((mesh, placements, tuple(p.shape), tag), []).append(i)
        return buckets

    def _replica_mesh(self, p: torch.Tensor):
        """The DDP group as a 1-D mesh (built once), so replicated plain tensors take the
        same DTensor path as sharded ones; None when there is no group to share work with."""
        group = self.process_group
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return None
        if self._ddp_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            self._ddp_mesh = DeviceMesh.from_group(group, p.device.type)
        return self._ddp_mesh

    def _bucket(self, mesh, placements, shape, tag, pieces: list, indices: list, transform: Transform,
                apply, cursor: dict) -> int:
        if mesh is None:
            # Nothing to share with: transform every matrix here, as one batch.
            apply(indices, transform(torch.stack(pieces), tag))
            return len(pieces)
        if placements is None:
            return self._replicated_bucket(mesh, shape, tag, pieces, indices, transform, apply, cursor)
        from torch.distributed.tensor import DTensor, Shard
        src_pl = stacked_placements(placements)
        whole = (Shard(0),) * mesh.ndim  # nested over every mesh dim: contiguous matrices per rank
        n = mesh.size()
        # The whole bucket in one stack of n * per slots, rank r owning slots [r per, (r+1) per):
        # one redistribution there and one back, and each rank transforms its share as one
        # batch. (One round of n matrices at a time cost a redistribution pair and an unbatched
        # Newton-Schulz per round: 78 ms of a 130 ms DDP2 step for speedrun-124m on 2 H100s.)
        per, slots = _deal(len(pieces), n, cursor, mesh)
        total = n * per
        gshape = (total, *shape)
        stride = _contiguous_stride(gshape)
        me = flat_coordinate(mesh)
        padded = [torch.zeros_like(pieces[0])] * total
        for slot, m in zip(slots, pieces):
            padded[slot] = m
        # Cast the stack, not each piece: one kernel per bucket (the same values).
        stacked = torch.stack(padded)
        if self.wire_dtype is not None:
            stacked = stacked.to(self.wire_dtype)
        device = stacked.device
        if device.type != mesh.device_type:  # FSDP2 CPU offload: shards in host memory
            stacked = stacked.to(torch.device(mesh.device_type, torch.cuda.current_device())
                                 if mesh.device_type == "cuda" else torch.device(mesh.device_type))
        dt = DTensor.from_local(stacked, mesh, src_pl, run_check=False, shape=gshape, stride=stride)
        mine = dt.redistribute(mesh, whole).to_local()  # (per, *shape): whole matrices
        # Empty slots hold zeros, which the transform keeps zero: no need to skip them.
        mine = transform(mine, tag)
        back = DTensor.from_local(mine, mesh, whole, run_check=False, shape=gshape,
                                  stride=stride).redistribute(mesh, src_pl).to_local().to(device)
        # The items' pieces in item order (a gather; the identity order needs none).
        in_order = (back[:len(slots)] if slots == list(range(len(slots)))
                    else back[torch.tensor(slots, device=back.device)])
        apply(indices, in_order)
        return sum(me * per <= slot < (me + 1) * per for slot in slots)

    def _replicated_bucket(self, mesh, shape, tag, pieces: list, indices: list, transform: Transform,
                           apply, cursor: dict) -> int:
        """The DDP case: every rank holds every matrix whole. The same dealing and the same
        stack as the DTensor path, but this rank stacks only its own share, and the results
        travel back in one all-gather on the DDP group. DTensor's redistribution of a
        replicated stack is that slice and that all-gather, at about 2 ms of host time a step
        of speedrun-124m under DDP2, a step that waits for its host, and every rank stacked and
        cast all of the matrices to keep 1/n of them. Without it the optimizer's phase of that
        step went from 9.8 to 8.1 ms (2 x H200: docs/results/speed.md)."""
        n = mesh.size()
        per, slots = _deal(len(pieces), n, cursor, mesh)
        me = flat_coordinate(mesh)
        dtype = self.wire_dtype or pieces[0].dtype
        mine = [torch.zeros(shape, dtype=dtype, device=pieces[0].device)] * per
        for j, slot in enumerate(slots):
            if me * per <= slot < (me + 1) * per:
                mine[slot - me * per] = pieces[j].to(dtype)
        # Empty slots hold zeros, which the transform keeps zero: no need to skip them.
        done = transform(torch.stack(mine), tag).contiguous()
        gathered = done.new_empty((n * per, *shape))
        dist.all_gather_into_tensor(gathered, done, group=self.process_group)
        in_order = (gathered[:len(slots)] if slots == list(range(len(slots)))
                    else gathered[torch.tensor(slots, device=gathered.device)])
        apply(indices, in_order)
        return sum(me * per <= slot < (me + 1) * per for slot in slots)


def _deal(count: int, n: int, cursor: dict, mesh) -> tuple[int, list[int]]:
    """(slots per rank, each matrix's slot) for ``count`` matrices over ``n`` ranks, rank r
    owning slots [r per, (r+1) per). Matrices are dealt to the ranks in turn, starting at the
    rank after the one the previous bucket on this mesh ended on: shares differ by at most one
    per bucket and the short ones rotate. Matrix j goes to rank (start + j) % n, at that rank's
    next slot."""
    per = -(-count // n)
    start = cursor.get(mesh, 0)
    slots = [((start + j) % n) * per + (start + j) // n for j in range(count)]
    cursor[mesh] = (start + count) % n
    return per, slots
