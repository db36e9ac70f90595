"""What a check needs of a strategy on one rank, worked out once per (strategy, mesh, rank).

Every check asks the same questions of its strategy on every rank: where each operand sits,
which slice of it the rank holds and its local shape, which collectives the declared actions
imply.  The answers depend only on the strategy, the mesh and the rank.  The slices and
shapes are kept per layout (every strategy laying a tensor out alike shares them); a rank's
whole layout is kept while the strategy lives where each rank asks on its own (a rank thread
or process), and built once for all ranks where one thread holds them all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from shardverify.sharding.blocks import nested_block
from shardverify.sharding.mesh import DeviceMesh
from shardverify.verify.memo import remembered
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import CommPattern, CommWhere, OperationData, ShardingStrategy

__all__ = ["LocalOperand", "RankLayout", "rank_layout", "rank_layouts", "expected_collectives", "stacked_shards"]

# Collectives each pattern issues in the forward pass and in the backward pass.
_FWD = {CommPattern.ALLREDUCE_FWD_IDENTITY_BWD: "all_reduce", CommPattern.GATHER_FWD_SPLIT_BWD: "all_gather",
        CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: "all_to_all"}
_BWD = {CommPattern.IDENTITY_FWD_ALLREDUCE_BWD: "all_reduce", CommPattern.SPLIT_FWD_GATHER_BWD: "all_gather",
        CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: "all_to_all"}


def expected_collectives(strategy: ShardingStrategy, carrying_grad: Iterable[str]) -> dict:
    """(kind, axes) -> count that the declared actions issue; a backward half only runs on an
    operand in ``carrying_grad`` (the differentiable inputs and parameters, and the outputs
    whose gradient flows back).  (A plain dict, not a Counter: every check works one out.)"""
    differentiable = set(carrying_grad)
    issued: list[tuple] = []
    for action in strategy.communication_actions:
        if action.where is CommWhere.HOOK:
            if action.operand in differentiable:
                issued.append(("all_reduce", action.axes))
            continue
        if action.pattern in _FWD:
            issued.append((_FWD[action.pattern], action.axes))
        if action.operand not in differentiable:
            continue
        if action.pattern in _BWD:
            issued.append((_BWD[action.pattern], action.axes))
        elif action.op in ("max", "min"):   # the holders of the extremum are counted in backward
            issued.append(("all_reduce", action.axes))
    expected: dict = {}
    for key in issued:
        expected[key] = expected.get(key, 0) + 1
    return expected


class LocalOperand(NamedTuple):
    """One operand as this rank holds it: its layout, the slice of the full tensor, the shape.
    (A named tuple: a check builds one per operand and rank of every strategy it is handed.)"""

    data: OperationData
    spec: ShardingSpec
    slices: tuple[slice, ...]
    local_shape: tuple[int, ...]
    largest: bool = True   # whether this is the largest block (``spec.local_shape()``) of the layout

    def shard(self, tensor: torch.Tensor, mesh: DeviceMesh, rank: int) -> torch.Tensor:
        """``spec.local_shard`` with the slices known (a view of ``tensor``)."""
        if tuple(tensor.shape) != self.spec.tensor_shape:
            return self.spec.local_shard(tensor, mesh, rank)   # raises, naming both shapes
        return tensor[self.slices]


class RankLayout(NamedTuple):
    """A strategy's operands on one rank of ``mesh``, inputs then outputs (tuple order).  (A
    named tuple, built with every check's strategy on every rank, as ``LocalOperand``.)"""

    strategy: ShardingStrategy
    mesh: DeviceMesh
    rank: int
    inputs: tuple[LocalOperand, ...]
    outputs: tuple[LocalOperand, ...]
    #: whether this rank holds the largest block of every operand (the one the strategy's costs
    #: are declared for; every rank when the blocks are even)
    holds_largest: bool
    #: differentiable operand names -> expected_collectives, filled on first use
    expected: dict

    def expected_collectives(self, carrying_grad: tuple[str, ...]) -> dict:
        """``expected_collectives(strategy, carrying_grad)``, remembered (shared: never modify it)."""
        found = self.expected.get(carrying_grad)
        if found is None:
            found = self.expected[carrying_grad] = expected_collectives(self.strategy, carrying_grad)
        return found


_LAYOUTS: dict = {}


def rank_layout(strategy: ShardingStrategy, mesh: DeviceMesh, rank: int) -> RankLayout:
    """The strategy's :class:`RankLayout` on ``rank`` of ``mesh``, built once while the
    strategy lives (the layout holds the mesh, so its id is not reused either)."""
    return remembered(_LAYOUTS, (id(strategy), id(mesh), rank), strategy, lambda: _build(strategy, mesh, rank),
                      limit=8192)


def rank_layouts(strategy: ShardingStrategy, mesh: DeviceMesh, ranks: tuple[int, ...]) -> tuple[RankLayout, ...]:
    """:func:`rank_layout` on each of ``ranks``, built together (the strategy's operands
    sorted once for all of them).  Not remembered for several ranks: the check holding every
    rank asks once per strategy, and a table would keep thousands of strategies alive for the
    garbage collector to walk."""
    if len(ranks) == 1:
        return (rank_layout(strategy, mesh, ranks[0]),)
    return _build_all(strategy, mesh, ranks)


def _build(strategy: ShardingStrategy, mesh: DeviceMesh, rank: int) -> RankLayout:
    return _build_all(strategy, mesh, (rank,))[0]


def _build_all(strategy: ShardingStrategy, mesh: DeviceMesh, ranks: tuple[int, ...]) -> tuple[RankLayout, ...]:
    specs = dict(strategy.sharding_specs)
    operands = strategy.operands
    n_inputs = len(operands) - len(strategy.outputs)
    placed = [(d, specs[d.name], _geometries(specs[d.name], mesh)) for d in operands]
    layouts = []
    for rank in ranks:
        held = [LocalOperand(d, spec, *geometry[rank]) for d, spec, geometry in placed]
        layouts.append(RankLayout(strategy, mesh, rank, tuple(held[:n_inputs]), tuple(held[n_inputs:]),
                                  all([operand.largest for operand in held]), {}))
    return tuple(layouts)


_GEOMETRIES: dict = {}


def _geometries(spec: ShardingSpec, mesh: DeviceMesh) -> tuple[tuple[tuple[slice, ...], tuple[int, ...], bool], ...]:
    """A layout's local slices and shape on each rank of ``mesh``, and whether that is its
    largest block, remembered per layout (``spec.key``, which holds the mesh shape, the only
    thing of the mesh they depend on; a mesh of another shape is refused by ``local_slices``):
    the strategies of a case share a few layouts, and a suite hands every check new strategy
    objects."""
    found = _GEOMETRIES.get(spec.key)
    if found is None:
        if tuple(mesh.shape) != spec.mesh_shape:
            spec.local_slices(mesh, 0)   # raises, naming both meshes
        largest = spec.local_shape()
        partition = dict(spec.dim_partition)
        per_dim = [_dim_slices(mesh, size, partition.get(dim, ())) for dim, size in enumerate(spec.tensor_shape)]
        found = []
        for rank in range(mesh.size):
            slices = tuple([dim[rank] for dim in per_dim])
            shape = tuple([s.stop - s.start for s in slices])
            found.append((slices, shape, shape == largest))
        if len(_GEOMETRIES) >= 4096:
            _GEOMETRIES.clear()
        found = _GEOMETRIES[spec.key] = tuple(found)
    return found


_DIM_SLICES: dict = {}


def _dim_slices(mesh: DeviceMesh, size: int, axes: tuple[int, ...]) -> tuple[slice, ...]:
    """Each rank's slice of a dim of ``size`` cut over mesh ``axes`` (``ShardingSpec.local_slices``
    dim by dim), remembered per (mesh shape, size, axes): a case's layouts cut its few dim sizes
    over the same few axes, so a layout seen for the first time is put together from them."""
    key = (tuple(mesh.shape), size, axes)
    found = _DIM_SLICES.get(key)
    if found is None:
        shape = tuple(mesh.shape)
        found = []
        for rank in range(mesh.size):
            coord = mesh.coordinate(rank)
            start, length = nested_block(size, [(shape[a], coord[a]) for a in axes])
            found.append(slice(start, start + length))
        if len(_DIM_SLICES) >= 4096:
            _DIM_SLICES.clear()
        found = _DIM_SLICES[key] = tuple(found)
    return found


def stacked_shards(tensor: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
    """Every rank's block of ``tensor`` laid out as ``spec``, stacked on a new leading dim in rank
    order, a tensor of its own: for a layout whose blocks are all of one shape (every rank holds
    the largest), one reshape, permute and expand instead of a slice per rank.  A dim split over
    mesh axes ``(a, b)`` is viewed as ``(size a, size b, block)``, ``a`` most significant, as
    ``ShardingSpec.local_slices`` cuts it; a mesh axis splitting nothing repeats the block.
    Contiguous, as each rank's own copy of its block is: a kernel may sum in another order on
    other strides (a matmul's weight gradient), and each row must compute what the rank does."""
    found = _STACKING.get(spec.key)
    if found is None:
        if len(_STACKING) >= 4096:
            _STACKING.clear()
        found = _STACKING[spec.key] = _stacking(spec.key)
    view, order, grid, stacked = found
    found = tensor.reshape(view).permute(order).expand(grid).reshape(stacked)
    return found.clone(memory_format=torch.contiguous_format) if found._is_view() else found


_STACKING: dict = {}


def _stacking(key: tuple) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(view, permutation, expanded shape, stacked shape) of :func:`stacked_shards` for a layout's key
    (remembered per key in ``_STACKING``, as ``_GEOMETRIES``)."""
    mesh_shape, tensor_shape, partition = key
    split = dict(partition)
    view, labels, block = [], [], []
    for dim, size in enumerate(tensor_shape):
        axes = split.get(dim, ())
        parts = math.prod(mesh_shape[a] for a in axes)
        if size % parts:
            raise ValueError(f"dim {dim} of size {size} does not split evenly over mesh axes {axes} of {mesh_shape}")
        view += [mesh_shape[a] for a in axes] + [size // parts]
        labels += [("mesh", a) for a in axes] + [("dim", dim)]
        block.append(size // parts)
    for axis in range(len(mesh_shape)):
        if ("mesh", axis) not in labels:
            view.append(1)
            labels.append(("mesh", axis))
    order = [labels.index(("mesh", a)) for a in range(len(mesh_shape))] + \
        [labels.index(("dim", d)) for d in range(len(tensor_shape))]
    return (tuple(view), tuple(order), tuple(mesh_shape) + tuple(block),
            (math.prod(mesh_shape),) + tuple(block))
