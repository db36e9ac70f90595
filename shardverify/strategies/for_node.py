"""``strategies_for_node``: the strategies of one traced node, building its predecessors' on demand."""

from __future__ import annotations

from torch.fx import GraphModule, Node

from shardverify.strategies import generators as _generators  # noqa: F401  (registers the generators)
from shardverify.strategies import handlers as _handlers  # noqa: F401  (registers the generated handlers)
from shardverify.errors import HandlerError, InvalidArgument, StrategyError
from shardverify.strategies.generators.registry import GeneratorContext, get_generator
from shardverify.strategies.handlers.base import HandlerDef, handler_for_node, refusal, resolve_operands, resolve_params
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import OperandLocator, OperationData, OperationDataType, StrategiesVector

__all__ = ["strategies_for_node", "find_node"]

CACHE_KEY = "shardverify_strategies"   # node.meta[CACHE_KEY][(mesh, shapes)] -> StrategiesVector
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
                        mesh: DeviceMesh) -> StrategiesVector:
    """The node's strategies on ``mesh`` (cached in ``node.meta``)."""
    if not isinstance(graph_module, GraphModule):
        raise InvalidArgument(f"graph_module must be a torch.fx.GraphModule (see shardverify.trace), "
                              f"got {type(graph_module).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise InvalidArgument(f"mesh must be a shardverify.DeviceMesh, got {mesh!r}; use DeviceMesh({mesh!r})")
    return _strategies(graph_module, find_node(graph_module, node_name_or_index), mesh)


def _shapes(node: Node) -> tuple:
    """The shapes and dtypes a node's strategies are computed from: its own and its inputs'."""
    def of(n: Node) -> object:
        meta = n.meta.get("tensor_meta")
        metas = meta if isinstance(meta, (list, tuple)) and not hasattr(meta, "shape") else (meta,)
        return tuple((tuple(m.shape), m.dtype) if hasattr(m, "shape") else None for m in metas)

    return (of(node),) + tuple((n.name, of(n)) for n in node.all_input_nodes)


def _strategies(graph_module: GraphModule, node: Node, mesh: DeviceMesh) -> StrategiesVector:
    """The node's strategies, cached in ``node.meta`` by mesh and by the shapes and dtypes they
    were computed from: a copy of the graph traced again for other inputs (``deepcopy`` keeps
    ``node.meta``) gets its own, not the strategies of the old shapes."""
    cache = node.meta.setdefault(CACHE_KEY, {})
    key = (mesh, _shapes(node))
    if key not in cache:
        cache[key] = _build(graph_module, node, mesh)
    return cache[key]


def handler_strategies(handler: HandlerDef, graph_module: GraphModule, node: Node,
                       mesh: DeviceMesh) -> tuple[dict[str, OperationData], list]:
    """(operand data by role, strategies) that ``handler`` generates for ``node``: the one path
    from a handler to its strategies, shared by the registry lookup below and the audit (which
    runs a spec's handler that need not be registered)."""
    why = refusal(handler, node, graph_module)
    if why is not None:
        raise HandlerError(why)
    operands = resolve_operands(handler, node, graph_module)
    ctx = GeneratorContext(node=node, graph_module=graph_module, mesh=mesh, operands=operands,
                           params=resolve_params(handler, node, graph_module), options=handler.option_dict,
                           handler_name=handler.name, handler=handler,
                           strategies_of=lambda producer: _strategies(graph_module, producer, mesh))
    return operands, list(get_generator(handler.generator)(ctx))


def _build(graph_module: GraphModule, node: Node, mesh: DeviceMesh) -> StrategiesVector:
    handler = handler_for_node(node, graph_module)
    if handler is not None:
        _, strategies = handler_strategies(handler, graph_module, node, mesh)
        _check_unique(strategies, handler.name, node)
        return StrategiesVector(node, strategies, predecessor_nodes=node.all_input_nodes)
    if node.op in _SOURCE_OPS:
        meta = node.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            raise HandlerError(f"node {node.name!r} has no tensor shape; trace the module with shardverify.trace()")
        kind = OperationDataType.ARG if node.op == "placeholder" else OperationDataType.PARAM
        operands = {"output": OperationData(node.name, kind, "output", tuple(meta.shape), meta.dtype,
                                            locator=OperandLocator("output"))}
        params, options, name = {}, {"name": _SOURCE_OPS[node.op]}, node.op
        generate = get_generator("replicated")
    else:
        target = getattr(node.target, "__name__", node.target)
        raise HandlerError(f"no handler for node {node.name!r} ({node.op} {target!r}); write a spec for it "
                           f"in specs/ and run `shardverify generate`")
    ctx = GeneratorContext(node=node, graph_module=graph_module, mesh=mesh, operands=operands, params=params,
                           options=options, handler_name=name,
                           strategies_of=lambda producer: _strategies(graph_module, producer, mesh))
    strategies = generate(ctx)
    _check_unique(strategies, name, node)
    return StrategiesVector(node, strategies, predecessor_nodes=node.all_input_nodes)


def _check_unique(strategies: list, name: str, node: Node) -> None:
    names = [s.name for s in strategies]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise StrategyError(f"handler {name!r} produced duplicate strategy names {duplicates} for node {node.name!r}")
