"""``strategies_for_node``: the strategies of one traced node, building its predecessors' on demand.

A call the spec's grid never covered (a parameter value, an undeclared argument) is served only
through an :class:`OnDemand` verifier given by the caller: the rule's strategies at that call are
handed to it and it returns those that verified there. Without one, such a call is refused, as
the strict grid binding (``--verified-only``) wants. This room only produces strategies; the
verifier lives in ``shardverify.verify.on_demand``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch.fx import GraphModule, Node

from shardverify.capture.meta import output_metas, tensor_meta
from shardverify.strategies import generators as _generators  # noqa: F401  (registers the generators)
from shardverify.strategies import handlers as _handlers  # noqa: F401  (registers the generated handlers)
from shardverify.errors import HandlerError, InvalidArgument, StrategyError
from shardverify.strategies.by_value import shared, value_key
from shardverify.strategies.generators.registry import GeneratorContext, get_generator
from shardverify.strategies.generators.replicated import source_strategy
from shardverify.strategies.handlers.base import HandlerDef
from shardverify.strategies.handlers.call_values import resolve_operands, resolve_params
from shardverify.strategies.handlers.serving import handler_for_node, outside_grid, refusal
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import (OperandLocator, OperationData, OperationDataType, ShardingStrategy,
                                           StrategiesVector)

__all__ = ["strategies_for_node", "find_node", "UnverifiedCall", "OnDemand", "handler_strategies"]


@dataclass(frozen=True)
class UnverifiedCall:
    """A call outside its spec's grid, with the strategies its rule yields there, unverified."""

    handler: HandlerDef
    graph_module: GraphModule
    node: Node
    mesh: DeviceMesh
    operands: dict
    strategies: tuple[ShardingStrategy, ...]
    reason: str            # why the grid does not cover it (the value, the argument)


class OnDemand(Protocol):
    """Verifies an :class:`UnverifiedCall`'s strategies at that call and returns those that passed
    (raising HandlerError when the call cannot be checked at all). ``cache_key`` tells apart the
    strategies cached in ``node.meta`` under different verifiers."""

    cache_key: object

    def __call__(self, call: UnverifiedCall) -> Sequence[ShardingStrategy]: ...

CACHE_KEY = "shardverify_strategies"   # node.meta[CACHE_KEY][(mesh, shapes)] -> StrategiesVector
LAYOUTS_ONLY = "layouts only"          # a key's last item where the strategies are built without costs
_SOURCE_OPS = {"placeholder": "Replica Placeholder", "get_attr": "Replica Attribute"}


def find_node(graph_module: GraphModule, node_name_or_index: str | int) -> Node:
    """A node by name, or by its position in ``graph.nodes`` (negative counts from the end)."""
    nodes = list(graph_module.graph.nodes)
    if isinstance(node_name_or_index, bool) or not isinstance(node_name_or_index, (int, str)):
        raise InvalidArgument(f"node_name_or_index must be a node name or an index, got {node_name_or_index!r}")
    if isinstance(node_name_or_index, int):
        if not -len(nodes) <= node_name_or_index < len(nodes):
            raise InvalidArgument(f"node index {node_name_or_index} is out of range for a graph of {len(nodes)} nodes")
        return nodes[node_name_or_index]
    for node in nodes:
        if node.name == node_name_or_index:
            return node
    raise InvalidArgument(f"no node named {node_name_or_index!r}; nodes are {[n.name for n in nodes]}")


def strategies_for_node(graph_module: GraphModule, node_name_or_index: str | int,
                        mesh: DeviceMesh, *, on_demand: OnDemand | None = None) -> StrategiesVector:
    """The node's strategies on ``mesh`` (cached in ``node.meta``). A call outside its spec's grid
    is served through ``on_demand`` (its strategies that verified at the call), refused without."""
    if not isinstance(graph_module, GraphModule):
        raise InvalidArgument(f"graph_module must be a torch.fx.GraphModule (see shardverify.trace), "
                              f"got {type(graph_module).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise InvalidArgument(f"mesh must be a shardverify.DeviceMesh, got {mesh!r}; use DeviceMesh({mesh!r})")
    return _strategies(graph_module, find_node(graph_module, node_name_or_index), mesh, on_demand)


def _shapes(node: Node) -> tuple:
    """The shapes and dtypes a node's strategies are computed from: its own and its inputs'."""
    def of(n: Node) -> object:
        metas = output_metas(n)
        return tuple((tuple(m.shape), m.dtype) if m is not None else None
                     for m in ((None,) if metas is None else metas))

    return (of(node),) + tuple((n.name, of(n)) for n in node.all_input_nodes)


def _refuse_symbolic(node: Node, shapes: tuple) -> None:
    """A shape torch.export could not know before running (``x[bool_mask]``, ``nonzero``: a size
    ``u0`` that the data decides) cannot be laid out ahead: refused, naming the node and the size."""
    own, *inputs = shapes
    for name, metas in ((node.name, own), *inputs):
        for meta in metas:
            shape = meta[0] if meta is not None else ()
            symbolic = [size for size in shape if not isinstance(size, int)]
            if symbolic:
                where = "" if name == node.name else f" (its input {name!r})"
                raise HandlerError(f"node {node.name!r}{where} has a data-dependent shape "
                                   f"[{', '.join(map(str, shape))}]: the size {symbolic[0]} is known only when the "
                                   f"data is (a boolean mask, nonzero), so no layout can be planned for it ahead")


def _strategies(graph_module: GraphModule, node: Node, mesh: DeviceMesh,
                on_demand: OnDemand | None = None) -> StrategiesVector:
    """The node's strategies, cached in ``node.meta`` by mesh and by the shapes and dtypes they
    were computed from: a copy of the graph traced again for other inputs (``deepcopy`` keeps
    ``node.meta``) gets its own, not the strategies of the old shapes."""
    shapes = _shapes(node)
    _refuse_symbolic(node, shapes)
    cache = node.meta.setdefault(CACHE_KEY, {})
    key = (mesh, shapes, getattr(on_demand, "cache_key", None))
    if key not in cache:
        cache[key] = _build(graph_module, node, mesh, on_demand)
    return cache[key]


def _layouts(graph_module: GraphModule, node: Node, mesh: DeviceMesh,
             on_demand: OnDemand | None = None) -> StrategiesVector:
    """The node's strategies read for their layouts alone (what a following op takes up): those
    of :func:`_strategies` where built already, else built with every cost left at zero, which
    is most of their making (cached apart: :func:`strategies_for_node` never returns them)."""
    shapes = _shapes(node)
    _refuse_symbolic(node, shapes)
    cache = node.meta.setdefault(CACHE_KEY, {})
    key = (mesh, shapes, getattr(on_demand, "cache_key", None))
    if key in cache:
        return cache[key]
    if key + (LAYOUTS_ONLY,) not in cache:
        cache[key + (LAYOUTS_ONLY,)] = _build(graph_module, node, mesh, on_demand, layouts_only=True)
    return cache[key + (LAYOUTS_ONLY,)]


def handler_strategies(handler: HandlerDef, graph_module: GraphModule, node: Node, mesh: DeviceMesh,
                       on_demand: OnDemand | None = None, *,
                       layouts_only: bool = False) -> tuple[dict[str, OperationData], list]:
    """(operand data by role, strategies) that ``handler`` generates for ``node``: the one path
    from a handler to its strategies, shared by the registry lookup below and the audit (which
    runs a spec's handler that need not be registered). A call outside the grid: refused
    without ``on_demand``, else the strategies that verified at the call (costed: the verifier
    checks costs). ``layouts_only``: costs left at zero, for their layouts alone."""
    why = refusal(handler, node, graph_module)
    if why is not None:
        raise HandlerError(why)
    unverified = outside_grid(handler, node, graph_module)
    if unverified is not None and on_demand is None:
        raise HandlerError(f"{unverified}; strict grid binding (--verified-only): a call outside the grid is "
                           f"served only when verified where it is met")
    operands = resolve_operands(handler, node, graph_module)
    ctx = GeneratorContext(node=node, graph_module=graph_module, mesh=mesh, operands=operands,
                           params=resolve_params(handler, node, graph_module),
                           handler_name=handler.name, handler=handler, layouts_only=layouts_only and unverified is None,
                           strategies_of=lambda producer: _strategies(graph_module, producer, mesh, on_demand),
                           layouts_of=lambda producer: _layouts(graph_module, producer, mesh, on_demand))
    strategies = list(get_generator(handler.generator)(ctx))
    if unverified is not None:        # on_demand is given: refused above otherwise
        strategies = list(on_demand(UnverifiedCall(handler, graph_module, node, mesh, operands, tuple(strategies),
                                                   unverified)))
    return operands, strategies


def _build(graph_module: GraphModule, node: Node, mesh: DeviceMesh, on_demand: OnDemand | None,
           layouts_only: bool = False) -> StrategiesVector:
    handler = handler_for_node(node, graph_module)
    if handler is not None:
        def derive() -> list:
            _, strategies = handler_strategies(handler, graph_module, node, mesh, on_demand, layouts_only=layouts_only)
            _check_unique(strategies, handler.name, node)
            return strategies

        # a producer read for its layouts alone, with no verifier to count its calls: the same in
        # every graph that calls the same thing on the same shapes (a spec case's predecessor)
        key = value_key(graph_module, node, handler, (mesh,)) if layouts_only and on_demand is None else None
        return StrategiesVector(node, shared(key, handler, derive), predecessor_nodes=node.all_input_nodes)
    if node.op in _SOURCE_OPS:
        meta = tensor_meta(node)
        if meta is None:
            raise HandlerError(f"node {node.name!r} has no tensor shape; trace the module with shardverify.trace()")
        kind = OperationDataType.ARG if node.op == "placeholder" else OperationDataType.PARAM
        operands = {"output": OperationData(node.name, kind, "output", tuple(meta.shape), meta.dtype,
                                            locator=OperandLocator("output"))}
        ctx = GeneratorContext(node=node, graph_module=graph_module, mesh=mesh, operands=operands,
                               handler_name=node.op, layouts_only=layouts_only)
        return StrategiesVector(node, source_strategy(ctx, _SOURCE_OPS[node.op]), predecessor_nodes=node.all_input_nodes)
    target = getattr(node.target, "__name__", node.target)
    raise HandlerError(f"no handler for node {node.name!r} ({node.op} {target!r}); write a spec for it "
                       f"in specs/ and run `shardverify generate`")


def _check_unique(strategies: list, name: str, node: Node) -> None:
    seen: set[str] = set()
    duplicates = sorted({s.name for s in strategies if s.name in seen or seen.add(s.name)})
    if duplicates:
        raise StrategyError(f"handler {name!r} produced duplicate strategy names {duplicates} for node {node.name!r}")
