"""The planning problem a traced model poses on a mesh: each node's options (its strategies, or
none for a node that runs generically), the layout each strategy gives a node's operands and
output, and what every edge costs to reshard. A read of a tensor's metadata (``x.shape``,
``x.size(1)``, ``x.dim()``) is answered from the traced global shape: it moves no data, so it
costs no resharding whatever the tensor's layout. :mod:`shardverify.plan.problem` poses the
problem from it (solver and assembly read that), the executor runs by it."""

from __future__ import annotations

from torch import fx

from shardverify.capture.meta import tensor_meta
from shardverify.capture.call import tuple_element
from shardverify.errors import StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.layout import ShapedLayout
from shardverify.sharding.reshard_plan import plan_reshard, reshard_cost
from shardverify.plan.coverage import classify_nodes, meta_shapes
from shardverify.plan.model import Reshard
from shardverify.sharding.strategy import CommPattern, CommWhere, OperandLocator, ShardingStrategy

__all__ = ["node_options", "operand_producer", "parameter_names", "deferrable", "deferred_saving", "node_layouts",
           "metadata_read", "asserts_metadata_only", "edge_targets", "operand_layout", "make_reshard",
           "replicated_choice", "source_of", "element_layout"]


def node_options(graph_module: fx.GraphModule, mesh: DeviceMesh) -> dict[str, list[ShardingStrategy] | None]:
    """node name -> its strategies, or None for a node that runs generically (why: see
    :func:`shardverify.plan.coverage.classify_nodes`)."""
    return classify_nodes(graph_module, mesh)[0]


def operand_producer(node: fx.Node, locator: OperandLocator) -> fx.Node | None:
    """The graph node feeding an operand at ``locator`` (None for module parameters)."""
    value = None
    if locator.kind == "arg" and isinstance(locator.key, int) and locator.key < len(node.args):
        value = node.args[locator.key]
    elif locator.kind == "kwarg":
        value = node.kwargs.get(locator.key)
    elif locator.kind == "item":
        i, j = locator.key  # type: ignore[misc]
        value = node.args[i][j] if i < len(node.args) else None
    return value if isinstance(value, fx.Node) else None


def parameter_names(gm: fx.GraphModule) -> dict[str, str]:
    """Every name a parameter is reachable by -> the name ``named_parameters()`` gives it (a tied
    weight, GPT-2's embedding and LM head, is one parameter under two names: one leaf, one
    gradient, compared with the reference's)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in gm.named_parameters(remove_duplicate=False)}


def deferrable(strategy: ShardingStrategy | None) -> tuple[int, ...]:
    """Mesh axes of a single-output strategy's AFTER sum all-reduce that the plan may leave to
    the resharding (so a consumer that wants the tensor sharded over those axes gets a
    reduce-scatter instead of an all-reduce and a split); () when there is none to defer."""
    if strategy is None or len(strategy.outputs) != 1 or strategy.post_add:
        return ()
    after = [a for a in strategy.communication_actions if a.where is CommWhere.AFTER]
    if len(after) != 1 or after[0].pattern is not CommPattern.ALLREDUCE_FWD_IDENTITY_BWD or after[0].op != "sum":
        return ()
    return after[0].axes


def deferred_saving(strategy: ShardingStrategy, axes: tuple[int, ...], mesh: DeviceMesh) -> float:
    """The declared seconds of the AFTER all-reduce that deferring removes from the strategy."""
    out = strategy.outputs[0]
    size = strategy.get_sharding_spec_by_name(out.name).local_numel() * out.itemsize
    return mesh.all_reduce_cost(size, axes)


def node_layouts(node: fx.Node, strategy: ShardingStrategy | None, mesh: DeviceMesh, deferred: tuple[int, ...] = ()):
    """The node's output layout: a ShapedLayout, a list of them for a tuple, or None (not a tensor)."""
    if strategy is not None:
        layouts = [ShapedLayout.of_spec(strategy.get_sharding_spec_by_name(d.name), deferred)
                   for d in strategy.outputs]
        return layouts[0] if len(layouts) == 1 else layouts
    shapes = meta_shapes(node)
    if shapes is None:
        return None
    if isinstance(shapes, list):
        return [ShapedLayout.replicated(mesh.shape, s) for s in shapes]
    return ShapedLayout.replicated(mesh.shape, shapes)


def source_of(producer: fx.Node) -> tuple[fx.Node, int | None]:
    """Where a value is laid out: (its tuple's producer, the element) for a tuple element
    (:func:`~shardverify.capture.call.tuple_element`), (the node, None) for any other: a consumer's
    resharding starts from the producer's layout of that tensor."""
    element = tuple_element(producer)
    return element if element is not None else (producer, None)


def element_layout(node: fx.Node, layouts: dict):
    """A tuple element's layout, its producer's of that tensor (None for any other node)."""
    element = tuple_element(node)
    if element is None:
        return None
    found = layouts.get(element[0].name)
    return found[element[1]] if isinstance(found, list) else None


def _itemsize(node: fx.Node) -> int:
    dtype = getattr(tensor_meta(node), "dtype", None)
    import torch

    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 4


def metadata_read(node: fx.Node) -> object | None:
    """What a read of a tensor's metadata (``x.shape``, ``x.size()``, ``x.size(d)``, ``x.dim()``,
    ``x.ndim``) gives, from the traced global shape of the tensor; None for any other node
    (no metadata read gives None). Every rank reads the global shape, as the single-device
    model does."""
    source = node.args[0] if node.args else None
    meta = tensor_meta(source) if isinstance(source, fx.Node) else None
    if meta is None:
        return None
    shape = meta.shape
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return {"shape": shape, "ndim": len(shape)}.get(node.args[1])  # type: ignore[call-overload]
    if node.op == "call_method" and node.target == "size" and not node.kwargs:
        return shape if len(node.args) == 1 else shape[node.args[1]] if isinstance(node.args[1], int) else None
    if node.op == "call_method" and node.target == "dim" and len(node.args) == 1:
        return len(shape)
    return None


def asserts_metadata_only(node: fx.Node) -> bool:
    """An ``aten._assert_tensor_metadata`` (torch.export's record of a ``.to(dtype)``) that checks
    dtype, device or layout only: a shard, or a partial sum, has the whole tensor's, so the check
    runs on what each rank holds; gathering the tensor for it (an all-gather of a whole activation
    before each of Llama's norms) would cost a collective for nothing. One that checks the size or
    strides takes its tensor whole, as any generic node."""
    import torch

    if node.op != "call_function" or node.target is not torch.ops.aten._assert_tensor_metadata.default:
        return False
    positional = list(node.args[1:3])
    return all(value is None for value in positional) and node.kwargs.get("size") is None \
        and node.kwargs.get("stride") is None


def edge_targets(node: fx.Node, strategy: ShardingStrategy | None, mesh: DeviceMesh):
    """(operand name, producer node, element index or None, target layout) for every tensor the
    node takes; a generic node takes each tensor of a tuple-valued producer (split, chunk)
    replicated, as operand ``producer[i]``. An operand the strategy takes as a partial sum is
    wanted partial: a producer's deferred reduction hands it over as it is, a full value is
    zeroed on all but one rank of each group."""
    edges = []
    if strategy is not None:
        for data in strategy.inputs:
            producer = operand_producer(node, data.locator)
            if producer is not None:
                edges.append((data.name, *source_of(producer), operand_layout(strategy, data.name)))
        return edges
    if metadata_read(node) is not None or asserts_metadata_only(node) or tuple_element(node) is not None:
        return edges             # the global shape needs none of the data; an element takes its tensor as laid out
    for producer in node.all_input_nodes:
        shapes = meta_shapes(producer)
        if tuple_element(producer) is not None:
            edges.append((producer.name, *source_of(producer), ShapedLayout.replicated(mesh.shape, shapes)))
            continue
        if isinstance(shapes, list):
            edges += [(f"{producer.name}[{i}]", producer, i, ShapedLayout.replicated(mesh.shape, shape))
                      for i, shape in enumerate(shapes)]
        elif shapes is not None:
            edges.append((producer.name, producer, None, ShapedLayout.replicated(mesh.shape, shapes)))
    return edges


def operand_layout(strategy: ShardingStrategy, name: str) -> ShapedLayout:
    """The layout ``strategy`` takes operand ``name`` in: its spec, partial over the axes of a
    partial-sum input (plans carry no partial max or min)."""
    held = strategy.partial_input(name)
    if held is not None and held.op != "sum":
        raise StrategyError(f"strategy {strategy.name!r} takes {name!r} as a partial {held.op}: plans carry "
                            f"partial sums only")
    return ShapedLayout.of_spec(strategy.get_sharding_spec_by_name(name), held.axes if held is not None else ())


def make_reshard(node: fx.Node, operand: str, producer: fx.Node, source, target: ShapedLayout,
                 mesh: DeviceMesh, index: int | None = None) -> Reshard:
    """The resharding of ``producer``'s output (element ``index`` of a tuple) into ``target``."""
    if index is not None and isinstance(source, list):
        source = source[index]
    if not isinstance(source, ShapedLayout):
        raise StrategyError(f"node {node.name!r}: operand {operand!r} comes from {producer.name!r}, whose "
                            f"output is not a single tensor with a layout")
    steps = plan_reshard(source, target)
    return Reshard(node.name, operand, producer.name, source, target, steps,
                   reshard_cost(mesh, source, steps, _itemsize(producer)))


def replicated_choice(options: list[ShardingStrategy]) -> ShardingStrategy | None:
    """The strategy with every operand replicated and no communication, if there is one."""
    for strategy in options:
        if not strategy.communication_actions and all(not spec.dim_partition for _, spec in strategy.sharding_specs):
            return strategy
    return None
