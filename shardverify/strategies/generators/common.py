"""Cost model and strategy assembly shared by every generator.

Costs are per device and are checked by the verifier (``shardverify.verify.costs``):

* compute, :func:`~shardverify.strategies.generators.flops.compute_cost` of the local op call: forward = the FLOPs
  ``torch.utils.flop_counter.FlopCounterMode`` counts for the call, halved (multiply-accumulates),
  or, when the counter does not count the op (reductions, elementwise ops), the numel of the
  largest local operand (inputs as the op receives them after the BEFORE actions, outputs as it
  returns them before the AFTER actions); backward = 2 x forward;
* memory, bytes of the local shards (:func:`memory_cost`);
* communication, seconds of the collectives the declared actions issue, each priced by
  ``DeviceMesh.collective_cost`` from the bytes the rank passes in (:func:`action_traffic`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from shardverify.capture.call import call_op, called_module, ungraded_inputs
from shardverify.errors import StrategyError
from shardverify.strategies.by_value import call_key, shared_call
from shardverify.strategies.generators.flops import compute_cost, thread_counter
from shardverify.strategies.generators.registry import GeneratorContext
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import (
    CommAction,
    CommPattern,
    CommWhere,
    LocalArg,
    MemoryCost,
    MemoryCycle,
    OperationData,
    OperationDataType,
    ShardingStrategy,
    TrainCycleItem,
)

__all__ = ["grad_sync", "local_bytes", "memory_cost", "communication_cost", "action_traffic", "compute_cost",
           "op_call_shapes", "local_compute_cost", "make_strategy", "with_declared_costs", "NO_COST"]


def local_bytes(data: OperationData, spec: ShardingSpec) -> int:
    return spec.local_numel() * data.itemsize


def memory_cost(operands: Sequence[OperationData], specs: Mapping[str, ShardingSpec]) -> MemoryCycle:
    """Forward keeps every operand's shard; backward adds a gradient for every input and parameter.
    (Summed as plain ints: every strategy of every generator is costed so.)"""
    activation = parameter = gradient = 0
    for data in operands:
        size = local_bytes(data, specs[data.name])
        if data.is_param:
            parameter += size
        else:
            activation += size
            if data.type is not OperationDataType.OUTPUT:
                gradient += size
    fwd, bwd = MemoryCost(activation, parameter), MemoryCost(gradient, parameter)
    return MemoryCycle(fwd, bwd, fwd + bwd)


#: the patterns that change the local shape an action passes on (an all-reduce changes none); a
#: tuple: ``in`` finds a member by identity, where a set would hash it (in Python, for an Enum)
_RESHAPING = (CommPattern.GATHER_FWD_SPLIT_BWD, CommPattern.SPLIT_FWD_GATHER_BWD, CommPattern.ALL2ALL_FWD_ALL2ALL_BWD)


def _resized(pattern: CommPattern, shape: list[int], dims: tuple[int, ...], n: int, forward: bool) -> None:
    """Apply (or, ``forward=False``, undo) the forward shape change of one action in place."""
    grow, shrink = (lambda d: shape[d] * n), (lambda d: shape[d] // n)
    if pattern is CommPattern.GATHER_FWD_SPLIT_BWD:
        shape[dims[0]] = (grow if forward else shrink)(dims[0])
    elif pattern is CommPattern.SPLIT_FWD_GATHER_BWD:
        shape[dims[0]] = (shrink if forward else grow)(dims[0])
    elif pattern is CommPattern.ALL2ALL_FWD_ALL2ALL_BWD:
        split, concat = dims if forward else dims[::-1]
        shape[split], shape[concat] = shape[split] // n, shape[concat] * n


def _chain(mesh, spec: ShardingSpec, actions: Sequence[CommAction]) -> list[tuple[CommAction, tuple[int, ...]]]:
    """The actions on one operand in execution order, each with the local shape entering it.
    BEFORE actions start from the operand's layout; AFTER actions end in the output's layout."""
    if not any(action.pattern in _RESHAPING for action in actions):   # all-reduces: the layout's shape
        return [(action, spec.local_shape()) for action in actions]
    return list(_reshaped_chain(mesh, spec, actions))


def _reshaped_chain(mesh, spec: ShardingSpec, actions: Sequence[CommAction]):
    """:func:`_chain` where some action gathers, splits or exchanges a dim."""
    shape = list(spec.local_shape())
    if actions and actions[0].where is CommWhere.AFTER:
        for action in reversed(actions):
            if action.pattern in _RESHAPING:
                _resized(action.pattern, shape, _norm(action.dims, len(shape)), mesh.axes_size(action.axes), False)
    for action in actions:
        yield action, tuple(shape)
        if action.pattern in _RESHAPING:
            _resized(action.pattern, shape, _norm(action.dims, len(shape)), mesh.axes_size(action.axes), True)


def _norm(dims: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(d % ndim for d in dims) if ndim else dims


def action_traffic(mesh, actions: Sequence[CommAction], operands: Mapping[str, OperationData],
                   specs: Mapping[str, ShardingSpec]) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(phase, kind, axes, payload bytes)`` of every collective the declared actions issue on a
    rank (phase "fwd" or "bwd"); backward halves only for floating operands (the others carry no
    gradient). Payload = the bytes the rank passes to the collective."""
    found = []
    by_operand: dict[tuple[str, CommWhere], list[CommAction]] = {}
    for action in actions:
        by_operand.setdefault((action.operand, action.where), []).append(action)
    for (name, where), chain in by_operand.items():
        data = operands[name]
        grads, itemsize = data.dtype.is_floating_point, data.itemsize
        for action, shape in _chain(mesh, specs[name], chain):
            size, n = math.prod(shape) * itemsize, mesh.axes_size(action.axes)
            pattern, axes = action.pattern, action.axes
            if where is CommWhere.HOOK:
                if grads:
                    found.append(("bwd", "all_reduce", axes, size))
            elif pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD:
                found.append(("fwd", "all_reduce", axes, size))
                if grads and action.op in ("max", "min"):   # counting the holders of the extremum
                    found.append(("bwd", "all_reduce", axes, size))
            elif pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD:
                if grads:
                    found.append(("bwd", "all_reduce", axes, size))
            elif pattern is CommPattern.GATHER_FWD_SPLIT_BWD:
                found.append(("fwd", "all_gather", axes, size))
            elif pattern is CommPattern.SPLIT_FWD_GATHER_BWD:
                if grads:
                    found.append(("bwd", "all_gather", axes, size // n))
            else:
                found.append(("fwd", "all_to_all", axes, size))
                if grads:
                    found.append(("bwd", "all_to_all", axes, size))
    return found


def communication_cost(mesh, actions: Sequence[CommAction], operands: Mapping[str, OperationData],
                       specs: Mapping[str, ShardingSpec]) -> TrainCycleItem:
    """Seconds spent in the collectives the declared actions issue, priced per collective by
    ``mesh.collective_cost`` (the figure the verifier checks against the real collectives)."""
    fwd = bwd = 0.0
    if not actions:
        return TrainCycleItem(fwd, bwd, fwd + bwd)
    for phase, kind, axes, size in action_traffic(mesh, actions, operands, specs):
        cost = mesh.collective_cost(kind, size, axes)
        if phase == "fwd":
            fwd += cost
        else:
            bwd += cost
    return TrainCycleItem(fwd, bwd, fwd + bwd)


def op_call_shapes(mesh, operands: Sequence[OperationData], specs: Mapping[str, ShardingSpec],
                   actions: Sequence[CommAction], rank: int | None = None) -> dict[str, tuple[int, ...]]:
    """Local shape of each operand at the op call: inputs after their BEFORE actions, outputs
    before their AFTER actions; on ``rank``, or the largest blocks (None)."""
    reshaping = [a for a in actions if a.pattern in _RESHAPING]     # an all-reduce changes no shape
    if not reshaping:
        return {data.name: specs[data.name].local_shape() if rank is None else
                specs[data.name].local_shape_on(mesh, rank) for data in operands}
    shapes = {}
    for data in operands:
        where = CommWhere.AFTER if data.type is OperationDataType.OUTPUT else CommWhere.BEFORE
        chain = [a for a in reshaping if a.operand == data.name and a.where is where]
        spec = specs[data.name]
        shape = list(spec.local_shape() if rank is None else spec.local_shape_on(mesh, rank))
        steps = reversed(chain) if where is CommWhere.AFTER else chain
        for action in steps:
            _resized(action.pattern, shape, _norm(action.dims, len(shape)), mesh.axes_size(action.axes),
                     where is CommWhere.BEFORE)
        shapes[data.name] = tuple(shape)
    return shapes


def local_compute_cost(ctx: GeneratorContext, operands: Sequence[OperationData],
                       specs: Mapping[str, ShardingSpec], actions: Sequence[CommAction],
                       local_args: Sequence[LocalArg] = ()) -> TrainCycleItem:
    """:func:`compute_cost` of the node's op called on meta tensors of the local shapes (what the
    verifier measures on the real shards), for generators that have no formula of their own."""
    return _meta_call(ctx, operands, specs, actions, local_args)[0]


def local_output_shapes(ctx: GeneratorContext, operands: Sequence[OperationData],
                        specs: Mapping[str, ShardingSpec], actions: Sequence[CommAction],
                        local_args: Sequence[LocalArg] = (), rank: int | None = None,
                        probe: bool = False, dtypes: bool = False) -> tuple | None:
    """The shapes the node's op really gives on meta tensors of the local input shapes (None when
    it refuses them): a generator compares them with its layouts' local output shapes, since an
    op that reads sizes from its input (squeeze of a dim a shard left with one element) can
    disagree with a layout that is right for the global tensor. ``rank``: that rank's blocks,
    else the largest. ``probe``: a rank holding an empty block, where meta kernels are no guide
    (a conv with no output channel runs on meta, and raises on the CPU; adaptive pooling's
    backward refuses an empty channel dim): the op runs forward and backward on real CPU
    tensors of the local shapes, and beyond ``PROBE_ELEMENTS`` elements the layout is not
    offered at all. ``dtypes``: (shape, dtype) of each output instead (an op may give an empty
    block another dtype: native_dropout's mask of no element is float, not bool)."""
    try:
        return _meta_call(ctx, operands, specs, actions, local_args, rank, probe)[2 if dtypes else 1]
    except StrategyError:
        return None


def _meta_call(ctx: GeneratorContext, operands: Sequence[OperationData], specs: Mapping[str, ShardingSpec],
               actions: Sequence[CommAction], local_args: Sequence[LocalArg] = (),
               rank: int | None = None, probe: bool = False) -> tuple[TrainCycleItem, tuple, tuple]:
    """(compute cost, output shapes, output (shape, dtype)s) of the op on meta tensors of the local shapes, cached;
    ``probe``: on CPU tensors, backward included (see :func:`local_output_shapes`)."""

    shapes = op_call_shapes(ctx.mesh, operands, specs, actions, rank)
    inputs = [d for d in operands if d.type is not OperationDataType.OUTPUT]
    # plain tuples, not the locators: a key is hashed per strategy and a dataclass hashes in Python
    args = tuple((a.locator.kind, a.locator.key, a.value if rank is None else a.value_on(rank)) for a in local_args)
    key = (tuple((d.locator.kind, d.locator.key, shapes[d.name], d.dtype) for d in inputs), args, probe)
    calls = _META_CALLS.get(ctx.node)
    if calls is None:
        calls = _META_CALLS.setdefault(ctx.node, {})
    found = calls.get(key)
    if found is None:   # meta kernels take milliseconds; strategies share few distinct local shapes, and
        # a spec's cases and a model's layers make the same calls on them (by_value.shared_call)
        found = shared_call(call_key(ctx.graph_module, ctx.node), key,
                            lambda: _measured(ctx, inputs, shapes, local_args, rank, probe))
        if len(calls) >= 4096:
            calls.clear()
        calls[key] = found
    return found


def _measured(ctx: GeneratorContext, inputs: Sequence[OperationData], shapes: dict, local_args: Sequence[LocalArg],
              rank: int | None, probe: bool) -> tuple[TrainCycleItem, tuple, tuple]:
    """What :func:`_meta_call` gives, measured: the op called on tensors of ``shapes``."""
    if probe and sum(math.prod(shapes[d.name]) for d in inputs) > PROBE_ELEMENTS:
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: an empty block is offered only when the "
                            f"op, probed on the CPU, takes it; local shapes {shapes} exceed the probe's "
                            f"{PROBE_ELEMENTS} elements")
    arguments = {(a.locator.kind, a.locator.key): a.value if rank is None else a.value_on(rank) for a in local_args}
    module = called_module(ctx.graph_module, ctx.node)
    try:
        flops, tensors, outs = _counted_call(ctx, module, inputs, shapes, arguments, probe, probe)
    except Exception as exc:  # noqa: BLE001 - the generator's layouts do not fit the op
        # or the op has no meta kernel, or reads its input's values (torch.cov): then on the CPU
        on_cpu = None if probe or not _meta_cannot(exc) else _cpu_call(ctx, module, inputs, shapes, arguments)
        if on_cpu is None:
            spec_file = getattr(ctx.handler, "spec_file", "") or "its spec"
            raise StrategyError(f"{ctx.handler_name} ({spec_file}): node {ctx.node.name!r}: the op raised when "
                                f"called{' forward and backward' if probe else ''} on the block shapes a layout "
                                f"of the rule gives one device, {shapes}: {exc}") from exc
        flops, tensors, outs = on_cpu
    numels = [v.numel() for v in tensors] + [t.numel() for t in outs if isinstance(t, torch.Tensor)]
    return (compute_cost(flops, numels),
            tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in outs),
            tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in outs))


def _meta_cannot(error: Exception) -> bool:
    """Did the op fail for want of data rather than for the shapes: no meta kernel, or a value read
    (``Tensor.item() cannot be called on meta tensors``)?"""
    return isinstance(error, NotImplementedError) or "meta tensor" in str(error).lower()


def _cpu_call(ctx: GeneratorContext, module, inputs: Sequence[OperationData], shapes: dict,
              arguments: dict) -> tuple | None:
    """:func:`_counted_call` on small CPU tensors, integers 0 (valid ids), else 1 (torch.cov's
    frequency weights); None where the op raises on both or the blocks are too large to probe."""
    if sum(math.prod(shapes[d.name]) for d in inputs) > PROBE_ELEMENTS:
        return None
    for integer in (0, 1):
        try:
            return _counted_call(ctx, module, inputs, shapes, arguments, True, False, integer)
        except Exception:  # noqa: BLE001 - the next integer, else the meta call's reason is said
            continue
    return None


def _counted_call(ctx: GeneratorContext, module, inputs: Sequence[OperationData], shapes: dict, arguments: dict,
                  real: bool, backward: bool, integer: int = 0) -> tuple:
    """(FLOPs counted, input tensors, outputs) of the node's op on tensors of ``shapes``: meta
    tensors, or ``real`` CPU ones (floats in [0.5, 1.5), integers ``integer``); ``backward``: a
    probe of an empty block, whose backward must give every input a gradient."""
    values = {(d.locator.kind, d.locator.key): _probe_tensor(shapes[d.name], d.dtype, real, backward, integer)
              for d in inputs}
    tensors = list(values.values())
    values.update(arguments)
    with thread_counter() as counter:
        result = call_op(ctx.node, module, values)
    flops = counter.get_total_flops()
    outs = result if isinstance(result, (list, tuple)) else (result,)
    if backward:   # the kernel itself, outside the counter: under a dispatch mode an op may run its
        # Python decomposition, which takes an empty block the kernel refuses (upsample_nearest3d)
        plain = call_op(ctx.node, module, values)
        outs = plain if isinstance(plain, (list, tuple)) else (plain,)
        if ungraded := ungraded_inputs(tensors, outs):
            raise StrategyError(f"the backward gives input(s) {ungraded} no gradient on these local shapes "
                                f"(this rank would skip their resharding's backward collectives)")
    return flops, tensors, outs


#: node -> {(local shapes, local arguments, probe): (compute cost, output shapes)}; weakly keyed:
#: a node holds its graph and the graph its module, whose weights (a float64 copy of a whole
#: model, when a plan is made) must go with the graph, not stay as long as the cache does
_META_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: the most input elements a CPU probe of an empty block allocates (16 MB of float32)
PROBE_ELEMENTS = 1 << 22


def _probe_tensor(shape: tuple[int, ...], dtype: torch.dtype, real: bool, graded: bool = False,
                  integer: int = 0) -> torch.Tensor:
    if not real:
        return torch.empty(shape, dtype=dtype, device="meta")
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype).add_(0.5).requires_grad_(graded)
    return torch.full(shape, integer, dtype=dtype)   # ids and masks: zero is a valid one, and the default


def make_strategy(ctx: GeneratorContext, name: str, operands: Sequence[OperationData],
                  specs: Mapping[str, ShardingSpec], actions: Sequence[CommAction],
                  compute: TrainCycleItem | tuple[float, float] | None = None,
                  local_args: Sequence[LocalArg] = (), memory: MemoryCycle | None = None,
                  **fields: object) -> ShardingStrategy:
    """Assemble a strategy over ``operands`` (output last) with all three costs filled in.

    ``compute``: None (the default) measures :func:`local_compute_cost` on meta tensors; a
    generator with a closed formula passes ``compute_cost(flops, numels)`` of the local call
    (a ``(fwd, bwd)`` pair is taken as is, for nodes that are not ops). ``local_args``: the
    non-tensor arguments the ranks pass instead of the recorded ones (a view's local shape);
    ``memory``: :func:`memory_cost` of the layouts, where the generator has it already (None:
    worked out here); ``fields``: the strategy's other fields (``partial_inputs``, ``post_add``...). Under
    ``ctx.layouts_only`` every cost is left at zero (:data:`NO_COST`): a following op reads
    only the layouts of its producer's strategies.
    """
    missing = [d.name for d in operands if d.name not in specs]
    if missing:
        raise StrategyError(f"{ctx.handler_name}: strategy {name!r} has no layout for {missing}")
    if ctx.layouts_only:
        compute, memory, communication = NO_COST.compute, NO_COST.memory, NO_COST.communication
    else:
        if compute is None:
            compute = local_compute_cost(ctx, operands, specs, actions, local_args)
        elif not isinstance(compute, TrainCycleItem):
            fwd, bwd = compute
            compute = TrainCycleItem(float(fwd), float(bwd), float(fwd + bwd))
        if memory is None:
            memory = memory_cost(operands, specs)
        communication = communication_cost(ctx.mesh, actions, {d.name: d for d in operands}, specs)
    return ShardingStrategy(
        name=name,
        sharding_specs=tuple((d.name, specs[d.name]) for d in operands),
        operands=tuple(operands),
        compute_cost=compute,
        memory_cost=memory,
        communication_cost=communication,
        communication_actions=tuple(actions),
        local_args=tuple(local_args),
        **fields,
    )


class _NoCost(NamedTuple):
    compute: TrainCycleItem
    memory: MemoryCycle
    communication: TrainCycleItem


#: the costs of a strategy generated for its layouts alone (``GeneratorContext.layouts_only``)
NO_COST = _NoCost(TrainCycleItem(0.0, 0.0, 0.0), MemoryCycle(MemoryCost(), MemoryCost(), MemoryCost()),
                  TrainCycleItem(0.0, 0.0, 0.0))


def with_declared_costs(strategy: ShardingStrategy, graph_module, node_name: str, mesh) -> ShardingStrategy:
    """``strategy`` with all three costs restated by the rules above (compute measured on meta
    tensors), for strategies whose layouts or actions were edited by hand."""
    node = next(n for n in graph_module.graph.nodes if n.name == node_name)
    ctx = GeneratorContext(node=node, graph_module=graph_module, mesh=mesh, operands={}, handler_name=strategy.name)
    specs = dict(strategy.sharding_specs)
    actions = strategy.communication_actions
    return strategy.replace(
        compute_cost=local_compute_cost(ctx, strategy.operands, specs, actions, strategy.local_args),
        memory_cost=memory_cost(strategy.operands, specs),
        communication_cost=communication_cost(mesh, actions, {d.name: d for d in strategy.operands}, specs))


def grad_sync(data: OperationData, axes: tuple[int, ...]) -> list[CommAction]:
    """All-reduce of a gradient that is partial over ``axes``: a hook on a parameter, before
    the op on an activation, nothing for a buffer or an integer operand (no gradient)."""
    if not axes or data.type is OperationDataType.BUFFER or not data.dtype.is_floating_point:
        return []
    where = CommWhere.HOOK if data.type is OperationDataType.PARAM else CommWhere.BEFORE
    return [CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, axes, data.name, where)]
