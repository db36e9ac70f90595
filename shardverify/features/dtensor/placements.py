"""A shardverify layout as DTensor placements, and back.

A dim sharded over mesh axes in mesh order (``S01``) is ``Shard(d)`` on each axis; the other
order (``S10``: cut by axis 1 first, then each block by axis 0) is DTensor's
``_StridedShard(d, split_factor=...)`` on every axis that DTensor processes before an axis
shardverify cuts earlier (DTensor reads placements left to right, as if axis 0 cut first; the
split factor counts the blocks already cut by the axes to its right). Whether DTensor reads
the blocks back as shardverify cut them is not assumed: the executor checks every input it
builds against the full value (:func:`shardverify.features.dtensor.execute`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardverify.sharding.layout import Layout

__all__ = ["placements_of", "layout_of", "placement_text", "placement_json", "placements_text"]


def placements_of(layout: Layout, mesh_shape: Sequence[int]) -> list:
    """DTensor placements for ``layout`` on a mesh of ``mesh_shape`` (``layout.absent`` has none)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if layout.absent:
        raise ValueError("an absent (post-added) operand has no DTensor placement")
    placements: list = [Replicate() for _ in mesh_shape]
    for dim, axes in enumerate(layout.dims):
        for position, axis in enumerate(axes):
            # axes cut before this one (earlier in ``axes``) that DTensor reads after it
            earlier_later = [a for a in axes[:position] if a > axis]
            split = math.prod(mesh_shape[a] for a in earlier_later)
            placements[axis] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    for axis in layout.partial:
        placements[axis] = Partial(layout.reduce)
    return placements


def layout_of(placements, tensor_ndim: int) -> Layout | None:
    """The layout of DTensor ``placements`` (mesh-order shards, partials), or None for a
    ``_StridedShard`` or another placement that is not a block layout in mesh order."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    dims: list[list[int]] = [[] for _ in range(tensor_ndim)]
    partial, reduce = [], "sum"
    for axis, placement in enumerate(placements):
        if type(placement) is Shard:
            dims[placement.dim % max(tensor_ndim, 1)].append(axis)
        elif isinstance(placement, Partial):
            partial.append(axis)
            reduce = str(placement.reduce_op)
        elif not isinstance(placement, Replicate):
            return None
    return Layout(tuple(tuple(d) for d in dims), tuple(partial), reduce)


def placement_text(placement) -> str:
    """DTensor's short name: ``S(0)``, ``R``, ``P(sum)``, ``_S(0, sf=2)``."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return f"_S({placement.dim}, sf={placement.split_factor})"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return f"P({placement.reduce_op})"
    return str(placement)


def placement_json(placement) -> list:
    """The placement as a repro case's data (``repro_runner._placement`` builds it again):
    ``["R"]``, ``["S", dim]``, ``["SS", dim, split_factor]`` or ``["P", reduce]``."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return ["SS", int(placement.dim), int(placement.split_factor)]
    if isinstance(placement, Shard):
        return ["S", int(placement.dim)]
    if isinstance(placement, Replicate):
        return ["R"]
    if isinstance(placement, Partial):
        return ["P", str(placement.reduce_op)]
    raise ValueError(f"no case data for placement {placement!r}")


def placements_text(placements) -> str:
    return "[" + ", ".join(placement_text(p) for p in placements) + "]"
