"""Where each weight is held: the layouts a parameter's own node (its ``get_attr``) may keep it in.

Held replicated, a weight costs every device its whole size with its gradient and optimizer state.
Held sharded, each device keeps a block of it, of its gradient and of its state, and an op that
takes it in another layout gets it by the plan's resharding: sharded over the data-parallel axis
and gathered whole before use, this is FSDP / ZeRO-3 (the all-gather forward; backward, the op's
own gradient reduction and the gather's transpose, a slice, reduce the gradient into the block);
held in the layout a tensor-parallel op takes it, it is tensor parallelism with nothing gathered;
both at once on two axes is the 2-D plan people train large models with.

These options only lower memory, never time, so they are offered when the plan has a memory limit
(a device profile's memory, or ``--memory-limit``). A parameter reached by two nodes (a tied
embedding and head) keeps one layout for both, so it is held replicated, as before.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping

from torch import fx

from shardverify.capture.meta import tensor_meta
from shardverify.plan.graph import parameter_names
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import OperandLocator, OperationData, OperationDataType, ShardingStrategy
from shardverify.strategies.generators.common import NO_COST

__all__ = ["weight_layouts", "with_weight_layouts", "trainable_weights", "held_weights"]


def _partitions(shape: tuple[int, ...], mesh: DeviceMesh):
    """Every way to split ``shape`` over the mesh's axes (each axis on one dim or none, in every
    order within a dim), each dim dividing evenly; replicated first."""
    ndim, axes = len(shape), range(len(mesh.shape))
    for placement in itertools.product(range(-1, ndim), repeat=len(mesh.shape)):
        on = {d: [a for a in axes if placement[a] == d] for d in range(ndim)}
        for orders in itertools.product(*(itertools.permutations(on[d]) for d in range(ndim))):
            partition = tuple((d, tuple(order)) for d, order in enumerate(orders) if order)
            if all(shape[d] % mesh.axes_size(order) == 0 for d, order in partition):
                yield partition


def weight_layouts(node: fx.Node, mesh: DeviceMesh) -> list[ShardingStrategy]:
    """The layouts ``node`` (a parameter's get_attr) may hold its weight in, each a strategy with
    the weight as its one output and no cost of its own (its bytes are the plan's to count)."""
    meta = tensor_meta(node)
    shape = tuple(meta.shape)
    data = OperationData("weight", OperationDataType.OUTPUT, "output", shape, meta.dtype,
                         locator=OperandLocator("output"))
    found = []
    for partition in _partitions(shape, mesh):
        spec = ShardingSpec(tuple(mesh.shape), shape, partition)
        name = "".join(map(str, spec.sharding_sequence))      # S0R, S1S0, RR: as strategies name a layout
        found.append(ShardingStrategy(name, (("weight", spec),), (data,), compute_cost=NO_COST.compute,
                                      memory_cost=NO_COST.memory, communication_cost=NO_COST.communication))
    return found


def trainable_weights(graph: fx.GraphModule) -> dict[str, str]:
    """get_attr node -> the trainable parameter it reads, by the name ``named_parameters()`` gives
    it (a tied weight's nodes name the one parameter)."""
    params = parameter_names(graph)
    return {n.name: params[str(n.target)] for n in graph.graph.nodes
            if n.op == "get_attr" and str(n.target) in params and graph.get_parameter(params[str(n.target)]).requires_grad}


def held_weights(graph: fx.GraphModule) -> list[fx.Node]:
    """The nodes that alone reach a trainable floating-point parameter of at least one dim."""
    weights = trainable_weights(graph)
    reached = Counter(weights.values())
    return [node for node in graph.graph.nodes if node.name in weights and reached[weights[node.name]] == 1
            and (meta := tensor_meta(node)) is not None and meta.shape and meta.dtype.is_floating_point]


def with_weight_layouts(graph: fx.GraphModule, options: Mapping[str, list[ShardingStrategy] | None],
                        mesh: DeviceMesh) -> dict[str, list[ShardingStrategy] | None]:
    """``options`` with every weight's node offered the layouts it may be held in."""
    found = dict(options)
    for node in held_weights(graph):
        found[node.name] = weight_layouts(node, mesh)
    return found
