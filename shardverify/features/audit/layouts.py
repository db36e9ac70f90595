"""Layouts the audit enumerates: a sharding per tensor dim plus, beyond the strategy model,
a partial value (sum/max/min over mesh axes) and the "absent" operand of a post-added bias.

Each is a :class:`~shardverify.sharding.layout.Layout`, a plain value so combinations can be
hashed, permuted by mesh-axis symmetries and printed. The enumeration yields uneven layouts too
(blocks cut as DTensor cuts them, :mod:`shardverify.sharding.blocks`), on every dim of two or
more elements: a size-1 dim split is one rank holding it and the others nothing, which no rule
offers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from shardverify.sharding.layout import Axes, Layout

__all__ = ["tensor_layouts", "axis_symmetries", "is_extremum", "REDUCE_OPS", "PARTIAL_INPUTS"]

REDUCE_OPS = ("sum", "avg", "max", "min")   # how a partial value reduces (CommAction.op)


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
