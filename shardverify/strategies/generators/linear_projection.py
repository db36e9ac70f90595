"""Strategies for ``output = input @ other (+ bias)`` with ``input [..., K]``, ``other [K, N]``.

Every strategy is reasoned on logical 2-D views: input ``[M, K]`` (all leading dims
flattened into M), other ``[K, N]`` (a weight stored ``[N, K]`` as nn.Linear does is read
transposed, option ``other_layout="out_in"``), output ``[M, N]``, bias ``[N]``.
A strategy is a triple of mesh-axis tuples ``(A, B, C)`` laid on ``(M, K, N)``; its name
reads ``OUT = IN x OTHER`` (``S0S1 = S0R x RS1``) and its communication follows from it:

* ``B`` (contraction) sharded: the output is a partial sum -> ALLREDUCE_FWD_IDENTITY_BWD
  AFTER the op on the output over ``B``;
* ``C`` sharded: the input's gradient is partial over ``C`` -> IDENTITY_FWD_ALLREDUCE_BWD
  BEFORE the op on the input over ``C``;
* ``A`` sharded: the gradients of ``other`` and ``bias`` are partial over ``A`` ->
  IDENTITY_FWD_ALLREDUCE_BWD as a gradient HOOK (parameters) or BEFORE the op (activations).

Families, in ColossalAI's order: ``SS = SR x RS``, ``SR = SS x SR``, ``RS = RS x SS`` over
ordered pairs of distinct mesh axes ((0, 1), (1, 0), then (0, 2), ... on 3-D meshes, in
``itertools.permutations`` order); ``RR = RS x SR`` and ``RS = RR x RS`` over each axis;
``S01R = S01R x RR``, ``RR = RS01 x S01R``, ``RS01 = RR x RS01`` over all mesh axes in
order (``S012`` on a 3-D mesh); ``RR = RR x RR``. Duplicates by name are dropped, so a 1-D
mesh has ``RR = RS0 x S0R``, ``RS0 = RR x RS0``, ``S0R = S0R x RR`` and ``RR = RR x RR``.

A sharded M is laid on one physical leading input dim ``i`` at a time, giving one strategy
per ``i`` named with the suffix ``_i`` (``S0S1 = S0R x RS1_1``). A size that does not divide
is split as DTensor splits it (blocks of ceil(n/k), the last smaller or empty): M, K and N are
whole dims of every operand, so each is cut the same way wherever it appears. A dim of one
element is never split (one rank would hold it, the others nothing).

Bias: it follows the output's last dim. When ``B`` is sharded, adding the bias inside the
op would count it ``|B|`` times in the all-reduced sum, so those strategies declare the bias
as a :class:`~shardverify.sharding.strategy.PostAdd`: the op runs without it and the bias is added
once, after the partial output is reduced (Megatron's row-parallel Linear; ColossalAI gets
the same by splitting the bias add off the linear in its tracer). So a Linear with a bias
has exactly the strategies, names and order of one without.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from shardverify.errors import StrategyError
from shardverify.strategies.generators.common import compute_cost, grad_sync, make_strategy
from shardverify.strategies.generators.registry import GeneratorContext, register_generator
from shardverify.sharding.sharding_spec import DimSpec, ShardingSpec
from shardverify.sharding.strategy import (
    CommAction,
    CommPattern,
    CommWhere,
    PostAdd,
    ShardingStrategy,
)

Axes = tuple[int, ...]
LAYOUTS = ("in_out", "out_in")


def logical_families(mesh_ndim: int) -> list[tuple[Axes, Axes, Axes]]:
    """The ``(A, B, C)`` triples (axes on M, K, N) in generation order, deduplicated."""
    axes = tuple(range(mesh_ndim))
    pairs = list(itertools.permutations(axes, 2))
    triples: list[tuple[Axes, Axes, Axes]] = []
    triples += [((x,), (), (y,)) for x, y in pairs]      # SS = SR x RS
    triples += [((x,), (y,), ()) for x, y in pairs]      # SR = SS x SR
    triples += [((), (x,), (y,)) for x, y in pairs]      # RS = RS x SS
    triples += [((), (x,), ()) for x in axes]            # RR = RS x SR
    triples += [((), (), (x,)) for x in axes]            # RS = RR x RS
    triples += [(axes, (), ()), ((), axes, ()), ((), (), axes)]   # S01R, RR = RS01 x S01R, RS01
    triples.append(((), (), ()))                         # RR = RR x RR
    return list(dict.fromkeys(triples))


def logical_name(a: Axes, b: Axes, c: Axes) -> str:
    def s(axes: Axes) -> str:
        return str(DimSpec(axes))
    return f"{s(a)}{s(c)} = {s(a)}{s(b)} x {s(b)}{s(c)}"


def _validate(ctx: GeneratorContext, layout: str) -> tuple[int, int]:
    inp, other, out = ctx.operand("input"), ctx.operand("other"), ctx.operand("output")
    bias = ctx.operands.get("bias")
    if layout not in LAYOUTS:
        raise StrategyError(f"{ctx.handler_name}: option other_layout={layout!r}, expected one of {LAYOUTS}")
    if len(other.shape) != 2 or not inp.shape:
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r} needs a 2-D other and an input of "
                            f"rank >= 1, got input {inp.shape} and other {other.shape}")
    k, n = other.shape if layout == "in_out" else other.shape[::-1]
    if inp.shape[-1] != k or out.shape != inp.shape[:-1] + (n,):
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: input {inp.shape}, other {other.shape} "
                            f"({layout}) and output {out.shape} are not a projection [..., K] x [K, N]")
    if bias is not None and bias.shape != (n,):
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: bias shape {bias.shape}, expected ({n},)")
    return k, n


@register_generator("linear_projection")
def generate(ctx: GeneratorContext) -> list[ShardingStrategy]:
    layout = str(ctx.option("other_layout", "in_out"))
    k, n = _validate(ctx, layout)
    inp, other, out = ctx.operand("input"), ctx.operand("other"), ctx.operand("output")
    bias = ctx.operands.get("bias")
    inp = dataclasses.replace(inp, logical_shape=(math.prod(inp.shape[:-1]), k))
    other = dataclasses.replace(other, logical_shape=(k, n))
    out = dataclasses.replace(out, logical_shape=(math.prod(out.shape[:-1]), n))
    operands = [inp, other] + ([bias] if bias is not None else []) + [out]
    mesh_shape = ctx.mesh.shape

    strategies: list[ShardingStrategy] = []
    for a, b, c in logical_families(ctx.mesh.ndim):
        def splits_one(axes: Axes, size: int) -> bool:    # a one-element dim split is no sharding
            return size < 2 and math.prod(mesh_shape[x] for x in axes) > 1
        if splits_one(b, k) or splits_one(c, n):
            continue
        batch_dims: list[int | None] = [d for d in range(len(inp.shape) - 1) if not splits_one(a, inp.shape[d])] \
            if a else [None]
        for dim in batch_dims:
            other_part = {0: b, 1: c} if layout == "in_out" else {0: c, 1: b}
            specs = {
                inp.name: ShardingSpec.from_partition(mesh_shape, inp.shape, {-1: b, **({dim: a} if a else {})}),
                other.name: ShardingSpec.from_partition(mesh_shape, other.shape, other_part),
                out.name: ShardingSpec.from_partition(mesh_shape, out.shape, {-1: c, **({dim: a} if a else {})}),
            }
            if bias is not None:
                specs[bias.name] = ShardingSpec.from_partition(mesh_shape, bias.shape, {-1: c})
            actions = []
            if c:
                actions.append(CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, c, inp.name, CommWhere.BEFORE))
            actions += grad_sync(other, a)
            if bias is not None:
                actions += grad_sync(bias, a)
            if b:
                actions.append(CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, b, out.name, CommWhere.AFTER))
            m_local = math.prod(specs[inp.name].local_shape()[:-1])
            k_local, n_local = specs[inp.name].local_shape()[-1], specs[out.name].local_shape()[-1]
            compute = compute_cost(2 * m_local * k_local * n_local, ())   # FLOPs of the local matmul
            name = logical_name(a, b, c) + (f"_{dim}" if dim is not None else "")
            strategy = make_strategy(ctx, name, operands, specs, actions, compute)
            if bias is not None and b:
                strategy = strategy.replace(post_add=(PostAdd(bias.name, (len(out.shape) - 1,)),))
            strategies.append(strategy)
    return strategies
