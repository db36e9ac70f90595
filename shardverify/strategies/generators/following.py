"""Strategies for an op whose layout follows its predecessor's (a reduction, an elementwise op).

For each layout the followed operand can arrive in (each strategy of its producer, in the same
order; for a graph input or attribute, whose node is replicated but which a plan may lay out any
way by a local slice, every layout its shape admits, replicated first): one strategy named
``<input layout> -> <output layout>_<predecessor index>`` (ColossalAI's convention) whose
input takes the layout the predecessor produces except that a shard on a reduced dim is
dropped (the input is gathered there), so no communication is needed: every kept shard maps
to the same shard of the output.  When the predecessor shards a reduced dim, a second one,
``... | P<axes> <op>_<index>``, keeps that shard: each rank reduces its part and the partial
output is all-reduced over those mesh axes after the op (``reduce_op``), unless the blocks
forbid it (an avg over blocks of unequal size, a max or min with an empty block:
:func:`~shardverify.sharding.blocks.partial_refusal`).

Options (all op knowledge stays in the handler's data):
``follow_operand``    role of the operand whose producer is followed (default ``"input"``);
``reduce_dims_param`` call parameter naming the reduced dims (int, sequence, or None/() = all);
                      without it the op keeps every dim (elementwise);
``keepdim_param``     call parameter that keeps reduced dims as size 1 (their layout R);
``reduce_op``         how partial results combine: ``sum`` (default), ``avg``, ``max``, ``min``;
``linear_in``         ``[<followed role>]`` where the op is linear in its operand (a sum, a mean):
                      after the strategies above, each again with the operand held as a partial
                      sum over mesh axes its layout leaves free, ``[S0, R]+P1 -> [S0] | P1 sum_i``
                      (the output is a partial sum over those axes too, all-reduced after the op;
                      a kept shard's own reduction joins it where that is a sum).
``naming``            ``distinct`` (default): each layout once, named by the first predecessor
                      strategy that produces it; ``colossalai``: ColossalAI's contract, first one
                      gathered strategy per predecessor strategy, in its order, named by its index,
                      identical layouts included (the plan collapses them, the verifier checks each
                      layout once), then the strategies above beyond ColossalAI, each layout once.
"""

from __future__ import annotations

import itertools
import math

from shardverify.capture.call import tuple_element
from shardverify.errors import HandlerError, StrategyError
from shardverify.strategies.generators.common import compute_cost, make_strategy
from shardverify.strategies.generators.registry import GeneratorContext, register_generator
from shardverify.strategies.handlers.base import Computed
from shardverify.sharding.blocks import partial_refusal
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.partial import PartialInput
from shardverify.sharding.strategy import REDUCE_OPS, CommAction, CommPattern, CommWhere, ShardingStrategy


def normalize_dims(value: object, ndim: int, what: str = "dim") -> tuple[int, ...]:
    """Reduced dims as sorted non-negative ints; None or () mean every dim."""
    if value is None:
        return tuple(range(ndim))
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)  # type: ignore[arg-type]
    except TypeError:
        raise StrategyError(f"{what}={value!r} must be an int, a sequence of ints or None") from None
    if not items:
        return tuple(range(ndim))
    dims = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise StrategyError(f"{what}={value!r} is not a dim or a list of dims (it holds a {type(item).__name__}): "
                                f"the call is another overload of the op, passing another argument where the spec "
                                f"reads {what}; only the overload taking {what} is served")
        if not -max(ndim, 1) <= item < max(ndim, 1):
            raise StrategyError(f"{what}={value!r}: dim {item} is out of range for a {ndim}-D input")
        dims.append(item % max(ndim, 1))
    if len(set(dims)) != len(dims):
        raise StrategyError(f"{what}={value!r} names a dim twice")
    return tuple(sorted(dims))


NAMINGS = ("distinct", "colossalai")


@register_generator("following")
def generate(ctx: GeneratorContext) -> list[ShardingStrategy]:
    reduce_op = ctx.option("reduce_op", "sum")
    if reduce_op not in REDUCE_OPS:
        raise HandlerError(f"{ctx.handler_name}: option reduce_op must be one of {', '.join(REDUCE_OPS)}, "
                           f"got {reduce_op!r}")
    naming = ctx.option("naming", "distinct")
    if naming not in NAMINGS:
        raise HandlerError(f"{ctx.handler_name}: option naming must be one of {', '.join(NAMINGS)}, "
                           f"got {naming!r}")
    role = str(ctx.option("follow_operand", "input"))
    inp, out = ctx.operand(role), ctx.operand("output")
    extra = [r for r in ctx.operands if r not in (role, "output")]
    if extra:
        raise HandlerError(f"{ctx.handler_name}: the following generator takes one tensor operand, "
                           f"node {ctx.node.name!r} also has {extra}")
    ndim = len(inp.shape)
    reduce_param, keepdim_param = ctx.option("reduce_dims_param"), ctx.option("keepdim_param")
    for name in (reduce_param, keepdim_param):
        if isinstance(ctx.params.get(name), Computed):
            raise ctx.params[name].refuse(ctx.handler_name, ctx.node.name)
    reduced = normalize_dims(ctx.params.get(reduce_param), ndim, str(reduce_param)) if reduce_param else ()
    keepdim = bool(ctx.params.get(keepdim_param, False)) if keepdim_param else False
    if keepdim or not reduce_param:
        out_dim = {d: d for d in range(ndim)}
    else:
        kept = [d for d in range(ndim) if d not in reduced]
        out_dim = {d: i for i, d in enumerate(kept)}
    if len(out_dim) != len(out.shape):
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r} reduces dims {reduced} of {inp.shape} "
                            f"(keepdim={keepdim}) but its output has shape {out.shape}")

    linear = _linear_in(ctx, role)
    operands = [inp, out]
    gathered, strategies, pieces = [], [], []
    for index, produced in enumerate(_produced_layouts(ctx, role)):
        in_part = {d: axes for d, axes in produced.items() if d not in reduced}
        out_part = {out_dim[d]: axes for d, axes in in_part.items()}
        specs = {
            inp.name: ShardingSpec.from_partition(ctx.mesh.shape, inp.shape, in_part),
            out.name: ShardingSpec.from_partition(ctx.mesh.shape, out.shape, out_part),
        }
        name = f"{specs[inp.name].sharding_sequence} -> {specs[out.name].sharding_sequence}"
        gathered.append(_strategy(ctx, f"{name}_{index}", operands, specs, ()))
        strategies.append(gathered[-1])
        if linear:
            pieces += _partial_variants(ctx, operands, specs, (), index)
        partial = tuple(sorted(a for d, axes in produced.items() if d in reduced for a in axes))
        # keep the shard, reduce the partial output after the op (over size-1 axes alone it is the gathered one)
        refused = any(partial_refusal(reduce_op, inp.shape[d], [ctx.mesh.shape[a] for a in axes])
                      for d, axes in produced.items() if d in reduced)
        if math.prod(ctx.mesh.shape[a] for a in partial) > 1 and out.dtype.is_floating_point and not refused:
            specs = {**specs, inp.name: ShardingSpec.from_partition(ctx.mesh.shape, inp.shape, produced)}
            name = f"{specs[inp.name].sharding_sequence} -> {specs[out.name].sharding_sequence}"
            action = CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, partial, out.name, CommWhere.AFTER,
                                op=reduce_op)
            strategies.append(_strategy(ctx, f"{name} | P{''.join(map(str, partial))} {reduce_op}_{index}",
                                        operands, specs, (action,)))
            if linear and reduce_op == "sum":
                pieces += _partial_variants(ctx, operands, specs, partial, index)
    if naming == "colossalai":   # every gathered one, then the others not among them, each once
        taken = {id(s) for s in gathered}
        return gathered + _first_of_each([s for s in strategies + pieces if id(s) not in taken])
    return _first_of_each(strategies + pieces)


def _produced_layouts(ctx: GeneratorContext, role: str) -> list[dict[int, tuple[int, ...]]]:
    """The layouts (tensor dim -> mesh axes) the followed operand can arrive in: those its
    producer's strategies give it, or, for a graph input or attribute (its node's single
    strategy is replicated, but a plan may lay it out any way, by a local slice), every
    layout its shape admits, replicated first."""
    data = ctx.operand(role)
    producer = next((n for n in ctx.node.all_input_nodes if n.name == data.name), None)
    if producer is not None and producer.op in ("placeholder", "get_attr"):
        return _every_layout(data.shape, ctx.mesh.shape)
    element = tuple_element(producer) if producer is not None else None
    if element is not None and ctx.strategies_of is not None:   # topk's values: as topk's strategies lay them out
        source, index = element
        return [pred.get_sharding_spec_by_name(pred.outputs[index].name).partition_dict()
                for pred in ctx.strategies_of(source)]
    return [pred.get_sharding_spec_by_name(data.name).partition_dict()
            for pred in ctx.predecessor_strategies(role)]


def _every_layout(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[dict[int, tuple[int, ...]]]:
    """Each mesh axis (of more than one rank) given to one dim of two or more elements or to
    none, a dim's axes in every order (``S01`` and ``S10``); the replicated layout first."""
    axes = [a for a, size in enumerate(mesh_shape) if size > 1]
    dims = [d for d, size in enumerate(shape) if size > 1]
    found: list[dict[int, tuple[int, ...]]] = []
    for choice in itertools.product([None, *dims], repeat=len(axes)):
        ascending: dict[int, tuple[int, ...]] = {}
        for axis, dim in zip(axes, choice):
            if dim is not None:
                ascending[dim] = ascending.get(dim, ()) + (axis,)
        for orders in itertools.product(*(itertools.permutations(held) for held in ascending.values())):
            found.append(dict(zip(ascending, orders)))
    return found


def _first_of_each(strategies: list[ShardingStrategy]) -> list[ShardingStrategy]:
    """The first strategy of each layout: its name without the predecessor index says every
    layout and action (several predecessor strategies produce the same output layout)."""
    found: dict[str, ShardingStrategy] = {}
    for strategy in strategies:
        found.setdefault(strategy.name.rpartition("_")[0], strategy)
    return list(found.values())


def _linear_in(ctx: GeneratorContext, role: str) -> bool:
    """Whether the spec says the op is linear in the followed operand (option ``linear_in``)."""
    value = ctx.option("linear_in", ())
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or any(v != role for v in value):
        raise HandlerError(f"{ctx.handler_name}: option linear_in must be [] or [{role!r}] (the followed "
                           f"operand), got {value!r}")
    inp, out = ctx.operand(role), ctx.operand("output")
    return bool(value) and inp.dtype.is_floating_point and out.dtype.is_floating_point


def _partial_variants(ctx: GeneratorContext, operands, specs: dict, reduced: tuple[int, ...],
                      index: int) -> list[ShardingStrategy]:
    """The strategy with layouts ``specs`` (its output reduced by a sum over ``reduced``), again
    with the input a partial sum over each set of mesh axes its layout leaves free."""
    inp, out = operands
    used = specs[inp.name].sharded_axes()
    free = [a for a, size in enumerate(ctx.mesh.shape) if size > 1 and a not in used]
    found = []
    for k in range(1, len(free) + 1):
        for held in itertools.combinations(free, k):
            axes = tuple(sorted(set(held) | set(reduced)))
            action = CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, axes, out.name, CommWhere.AFTER)
            name = (f"{specs[inp.name].sharding_sequence}+P{''.join(map(str, held))} -> "
                    f"{specs[out.name].sharding_sequence} | P{''.join(map(str, axes))} sum_{index}")
            strategy = _strategy(ctx, name, operands, specs, (action,))
            found.append(strategy.replace(partial_inputs=(PartialInput(inp.name, held),)))
    return found


def _strategy(ctx: GeneratorContext, name: str, operands, specs: dict, actions: tuple) -> ShardingStrategy:
    # FlopCounterMode counts only ops of two or more tensors (matmul, conv, attention), never a
    # one-tensor op: the rule's figure is the larger local operand (the verifier re-checks it)
    compute = compute_cost(0, [spec.local_numel() for spec in specs.values()])
    return make_strategy(ctx, name, operands, specs, actions, compute)
