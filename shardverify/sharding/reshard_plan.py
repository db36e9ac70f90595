"""Resharding maths: the collectives that convert a tensor from one layout on a mesh to another,
and their alpha-beta price (running them is :mod:`shardverify.collectives.reshard`'s job).

Source and target are each a :class:`~shardverify.sharding.layout.ShapedLayout`: a layout of a
tensor of known shape on a mesh of known shape, possibly partial over some mesh axes (summing the
local tensors over those axes gives the shard): a strategy's output before its AFTER all-reduce,
or a contraction's result.

:func:`plan_reshard` returns the steps, in order:

1. every source-partial axis the target does not keep is reduced: a reduce-scatter onto a
   dim whose target sharding continues with that axis, else one all-reduce over all the rest;
2. each dim keeps the longest prefix of its mesh axes it shares with the target; the rest is
   moved with one all-to-all when a single axis moves to a dim that wants it next, else
   all-gathered (the suffix of a dim's axes in one collective);
3. each dim is split locally over the axes the target adds after the kept prefix;
4. target-partial axes the source lacks keep the value on group position 0 and zeros elsewhere.

Gradients follow the Megatron convention the strategies use (patterns.py): the gradient of a
tensor laid out as ``(spec, partial)`` is laid out as ``spec`` (a partial tensor's gradient is
replicated over its partial axes). Every step's backward is the adjoint of its forward under
the inner product of the global tensors: gather <-> split, reduce-scatter -> all-gather,
all-reduce of a partial -> identity, all-to-all -> the reverse all-to-all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from shardverify.errors import InvalidArgument
from shardverify.sharding.layout import ShapedLayout
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["ReshardStep", "plan_reshard", "reshard_cost", "STEP_KINDS"]

STEP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "split", "zero_partial")


@dataclass(frozen=True)
class ReshardStep:
    """One collective or local step; ``dims`` = (dim,) or (split_dim, concat_dim) for all-to-all.
    ``shape`` is the global tensor's and ``held`` each dim's mesh axes just before the step: with
    them every rank knows the length of every block the step moves, when sizes do not divide
    (each rank's block of ``S<held[d]>``, DTensor's cut)."""

    kind: str
    axes: tuple[int, ...]
    dims: tuple[int, ...] = ()
    shape: tuple[int, ...] = field(default=(), compare=False)              # context, not the step's identity
    held: tuple[tuple[int, ...], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise InvalidArgument(f"reshard step kind {self.kind!r} is not one of {STEP_KINDS}")

    def __str__(self) -> str:
        dims = ""
        if self.kind == "all_to_all":
            dims = f", split_dim={self.dims[0]}, concat_dim={self.dims[1]}"
        elif self.dims:
            dims = f", dim={self.dims[0]}"
        return f"{self.kind}(axes={self.axes}{dims})"


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def plan_reshard(source: ShapedLayout, target: ShapedLayout) -> tuple[ReshardStep, ...]:
    """The steps converting ``source`` into ``target`` (same tensor and mesh shape); memoised,
    since the plan solver asks for every (producer strategy, consumer strategy) pair."""
    return _plan_reshard(source, target)


@functools.lru_cache(maxsize=1 << 16)
def _plan_reshard(source: ShapedLayout, target: ShapedLayout) -> tuple[ReshardStep, ...]:
    if source.spec.tensor_shape != target.spec.tensor_shape or source.spec.mesh_shape != target.spec.mesh_shape:
        raise InvalidArgument(f"cannot reshard {source} of shape {source.spec.tensor_shape} on mesh "
                              f"{source.spec.mesh_shape} into {target} of shape {target.spec.tensor_shape} on "
                              f"mesh {target.spec.mesh_shape}")
    ndim = len(source.spec.tensor_shape)
    cur = {d: source.axes.get(d, ()) for d in range(ndim)}
    want = {d: target.axes.get(d, ()) for d in range(ndim)}
    steps: list[ReshardStep] = []

    def step(kind: str, axes: tuple[int, ...], dims: tuple[int, ...] = ()) -> ReshardStep:
        return ReshardStep(kind, axes, dims, source.spec.tensor_shape, tuple(cur[d] for d in range(ndim)))

    # 1. reduce the partial axes the target does not keep; a reduce-scatter may enable another
    #    one (S1 then S12), so repeat until none applies: the result does not depend on axis order
    pending = [p for p in source.partial if p not in target.partial]
    progress = True
    while progress:
        progress = False
        for p in list(pending):
            dim = next((d for d in range(ndim) if want[d][:len(cur[d]) + 1] == cur[d] + (p,)), None)
            if dim is not None:
                steps.append(step("reduce_scatter", (p,), (dim,)))
                cur[dim] = cur[dim] + (p,)
                pending.remove(p)
                progress = True
    if pending:   # one all-reduce over every axis left, as a strategy's AFTER action would do
        steps.append(step("all_reduce", tuple(pending)))
    # 2. keep the common prefix of each dim; move a single trailing axis with an all-to-all to a
    #    dim that wants it next (repeated to a fixpoint), gather whatever else does not fit
    progress = True
    while progress:
        progress = False
        for d in range(ndim):
            extra = cur[d][_common_prefix(cur[d], want[d]):]
            if len(extra) != 1:
                continue
            dest = next((e for e in range(ndim) if e != d and _common_prefix(cur[e], want[e]) == len(cur[e])
                         and want[e][len(cur[e]):len(cur[e]) + 1] == extra), None)
            if dest is not None:
                steps.append(step("all_to_all", extra, (dest, d)))
                cur[d], cur[dest] = cur[d][:-1], cur[dest] + extra
                progress = True
    for d in range(ndim):
        keep = _common_prefix(cur[d], want[d])
        if cur[d][keep:]:
            steps.append(step("all_gather", cur[d][keep:], (d,)))
            cur[d] = cur[d][:keep]
    # 3. split locally over what the target adds
    for d in range(ndim):
        add = want[d][len(cur[d]):]
        if add:
            steps.append(step("split", add, (d,)))
            cur[d] = want[d]
    # 4. make the new partial axes
    for q in target.partial:
        if q not in source.partial:
            steps.append(step("zero_partial", (q,)))
    return tuple(steps)


def reshard_cost(mesh: DeviceMesh, source: ShapedLayout, steps, itemsize: int) -> float:
    """Alpha-beta seconds of ``steps`` (forward plus backward) starting from ``source``: the
    largest block's (uneven blocks are padded to it)."""
    shape = list(source.local_shape())
    total = 0.0
    for step in steps:
        n = mesh.axes_size(step.axes)
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        if step.kind == "all_reduce":
            total += mesh.all_reduce_cost(nbytes, step.axes)          # backward: identity
        elif step.kind == "reduce_scatter":
            total += 2 * mesh.reduce_scatter_cost(nbytes, step.axes)  # backward: all-gather
            shape[step.dims[0]] = -(-shape[step.dims[0]] // n)
        elif step.kind == "all_gather":
            total += mesh.all_gather_cost(nbytes * n, step.axes)      # backward: local split
            shape[step.dims[0]] *= n
        elif step.kind == "split":
            total += mesh.all_gather_cost(nbytes, step.axes)          # backward: all-gather
            shape[step.dims[0]] = -(-shape[step.dims[0]] // n)
        elif step.kind == "all_to_all":
            total += 2 * mesh.all_to_all_cost(nbytes, step.axes)
            shape[step.dims[0]] = -(-shape[step.dims[0]] // n)
            shape[step.dims[1]] *= n
    return total
