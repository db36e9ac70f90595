"""Layouts the audit enumerates: a sharding per tensor dim plus, beyond the strategy model,
a partial value (sum/max/min over mesh axes) and the "absent" operand of a post-added bias.

A :class:`Layout` is a plain value so combinations can be hashed, permuted by mesh-axis
symmetries and printed. The enumeration yields uneven layouts too (blocks cut as DTensor cuts
them, :mod:`shardverify.sharding.blocks`), on every dim of two or more elements: a size-1 dim
split is one rank holding it and the others nothing, which no rule offers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardverify.sharding.sharding_spec import DimSpec, ShardingSequence, ShardingSpec

__all__ = ["Layout", "tensor_layouts", "axis_symmetries", "spec_layout", "is_extremum", "REDUCE_OPS", "PARTIAL_INPUTS"]

REDUCE_OPS = ("sum", "avg", "max", "min")   # how a partial value reduces (CommAction.op)
Axes = tuple[int, ...]


@dataclass(frozen=True, order=True)
class Layout:
    """``dims[d]``: the mesh axes sharding tensor dim d (axes[0] most significant, () = R);
    ``partial``: mesh axes over which the value is a partial ``reduce`` still to be reduced;
    ``absent``: the op is given zeros here and the operand is added after (post_add)."""

    dims: tuple[Axes, ...]
    partial: Axes = ()
    reduce: str = "sum"
    absent: bool = False

    def __hash__(self) -> int:
        # remembered: an audit looks layouts up hundreds of thousands of times (combinations,
        # renamings, local inputs), and hashing the nested tuples anew was a tenth of its time
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.dims, self.partial, self.reduce, self.absent))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict:
        # a str's hash differs between processes: a pickled layout hashes anew where it lands
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def used_axes(self) -> set[int]:
        return {a for axes in self.dims for a in axes}

    def shard_counts(self, mesh_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(math.prod(mesh_shape[a] for a in axes) for axes in self.dims)

    def permuted(self, perm: Sequence[int]) -> Layout:
        """The same layout with mesh axis a renamed perm[a] (a symmetry of the mesh)."""
        return Layout(tuple(tuple(perm[a] for a in axes) for axes in self.dims),
                      tuple(sorted(perm[a] for a in self.partial)), self.reduce, self.absent)

    def normalized(self, mesh_shape: Sequence[int]) -> Layout:
        """Without mesh axes of size 1, which split and reduce nothing (S0 on a (1, 4) mesh is R)."""
        def keep(axes: Axes) -> Axes:
            return tuple(a for a in axes if mesh_shape[a] > 1)
        partial = keep(self.partial)
        return Layout(tuple(keep(axes) for axes in self.dims), partial, self.reduce if partial else "sum",
                      self.absent)

    def spec(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> ShardingSpec:
        return ShardingSpec(tuple(mesh_shape), tuple(shape),
                            tuple((d, axes) for d, axes in enumerate(self.dims) if axes))

    def key(self) -> str:
        """What coverage compares: an absent operand's sharding is irrelevant (it is zeros)."""
        return "absent" if self.absent else str(self)

    def __str__(self) -> str:
        text = str(ShardingSequence(DimSpec(axes) for axes in self.dims))
        if self.absent:
            return "absent (post-added)"
        if self.partial:
            text += f" P({self.reduce}:{''.join(map(str, self.partial))})"
        return text


def spec_layout(spec: ShardingSpec) -> Layout:
    partition = spec.partition_dict()
    return Layout(tuple(partition.get(d, ()) for d in range(len(spec.tensor_shape))))


def _shardings(shape: Sequence[int], mesh_shape: Sequence[int]) -> Iterator[tuple[Axes, ...]]:
    """Every sharding, even or not: each mesh axis unused or on one dim of two or more elements,
    every order on a shared dim."""
    ndim = len(shape)
    # an axis of size 1 shards nothing: it is never placed (see Layout.normalized)
    options = [[-1] + [d for d in range(ndim) if shape[d] > 1] if size > 1 else (-1,) for size in mesh_shape]
    for placement in itertools.product(*options):
        groups: list[list[int]] = [[] for _ in range(ndim)]
        for axis, dim in enumerate(placement):
            if dim >= 0:
                groups[dim].append(axis)
        for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
            yield tuple(tuple(o) for o in orders)


def _subsets(axes: Sequence[int]) -> Iterator[Axes]:
    for size in range(1, len(axes) + 1):
        yield from itertools.combinations(axes, size)


PARTIAL_INPUTS = ("sum", "max", "min")     # how a partial input's pieces may reduce


def tensor_layouts(shape: Sequence[int], mesh_shape: Sequence[int], *, partial: Sequence[str] = PARTIAL_INPUTS,
                   absent: bool = False) -> list[Layout]:
    """The layouts of one operand: every sharding, each partial value (reducing by each op in
    ``partial``) over a subset of the axes the sharding leaves free, with ``absent`` the zeros
    of a post-add."""
    found = []
    shardings = list(_shardings(tuple(shape), tuple(mesh_shape)))
    for dims in shardings:
        found.append(Layout(dims))
        free = [a for a in range(len(mesh_shape)) if mesh_shape[a] > 1 and all(a not in axes for axes in dims)]
        found += [Layout(dims, p, op) for op in partial for p in _subsets(free)]
    if absent:
        found += [Layout(dims, absent=True) for dims in shardings]
    return found


def axis_symmetries(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Permutations of the mesh axes that keep the mesh shape (swap axes of equal size)."""
    n = len(mesh_shape)
    return [perm for perm in itertools.permutations(range(n))
            if all(mesh_shape[perm[a]] == mesh_shape[a] for a in range(n))]


def is_extremum(layout: Layout) -> bool:
    """A partial max or min (of an input: at most one per combination is enumerated)."""
    return bool(layout.partial) and layout.reduce in ("max", "min")
