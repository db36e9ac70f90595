"""A plan: one strategy per node of a traced model, and the resharding between nodes.

Nodes that have a handler choose among ``strategies_for_node``; every other node
(placeholders, attributes, the output, ops without a handler such as ``getitem``) runs
*generically*: its tensor inputs are resharded to replicated and it runs unchanged on full
tensors, so any model can be planned, however few of its ops have handlers. A read of a
tensor's metadata (``x.shape``, ``x.size(1)``, ``x.dim()``) is answered from the traced global
shape: it moves no data, so it costs no resharding whatever the tensor's layout.
Everything here is frozen, picklable data, so a plan travels to worker processes as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from shardverify.strategies.for_node import strategies_for_node
from shardverify.errors import ShardVerifyError, StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.reshard_plan import Layout, ReshardStep, plan_reshard, reshard_cost
from shardverify.sharding.strategy import CommPattern, CommWhere, OperandLocator, ShardingStrategy

__all__ = ["deferrable", "deferred_saving", "GENERIC", "FLOP_RATE", "Reshard", "NodePlan", "Plan", "PlanCost",
           "node_options", "build_plan", "operand_producer", "node_layouts", "replicated_choice", "metadata_read"]

GENERIC = "replicated (no handler)"
FLOP_RATE = 1e10   # multiplies per second: turns declared compute (multiply counts) into seconds


@dataclass(frozen=True)
class Reshard:
    """The conversion of ``producer``'s output into the layout ``node`` expects for ``operand``."""

    node: str
    operand: str
    producer: str
    source: Layout
    target: Layout
    steps: tuple[ReshardStep, ...]
    cost: float

    def __str__(self) -> str:
        how = ", ".join(map(str, self.steps)) if self.steps else "no communication"
        return f"{self.producer} {self.source} -> {self.operand}@{self.node} {self.target}: {how}"


@dataclass(frozen=True)
class PlanCost:
    """Declared seconds per training step (forward + backward), and bytes per device."""

    compute: float
    communication: float
    resharding: float
    memory: int

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.resharding


@dataclass(frozen=True)
class NodePlan:
    """One node: its strategy (None: generic replicated pass-through) and the resharding of its inputs."""

    node: str
    strategy: ShardingStrategy | None
    reshards: tuple[Reshard, ...] = ()
    deferred: tuple[int, ...] = ()   # mesh axes of the output's AFTER all-reduce left to the resharding

    @property
    def strategy_name(self) -> str:
        if self.strategy is None:
            return GENERIC
        return self.strategy.name + (f" (all-reduce over {self.deferred} deferred)" if self.deferred else "")


@dataclass(frozen=True)
class Plan:
    mesh_shape: tuple[int, ...]
    nodes: tuple[NodePlan, ...]     # graph order
    cost: PlanCost
    flop_rate: float = FLOP_RATE

    def node(self, name: str) -> NodePlan:
        for item in self.nodes:
            if item.node == name:
                return item
        raise StrategyError(f"the plan has no node {name!r}; nodes are {[n.node for n in self.nodes]}")

    def choices(self) -> dict[str, str]:
        """node name -> strategy name, for the nodes that have strategies (a user plan file's content)."""
        return {n.node: ({"strategy": n.strategy.name, "defer": True} if n.deferred else n.strategy.name)
                for n in self.nodes if n.strategy is not None}

    def replace_node(self, name: str, **changes) -> Plan:
        """A copy with one node's strategy or reshards replaced (tests plant mistakes this way)."""
        import dataclasses

        self.node(name)
        nodes = tuple(dataclasses.replace(n, **changes) if n.node == name else n for n in self.nodes)
        return dataclasses.replace(self, nodes=nodes)


def node_options(graph_module: fx.GraphModule, mesh: DeviceMesh) -> dict[str, list[ShardingStrategy] | None]:
    """node name -> its strategies, or None for a node that runs generically."""
    options: dict[str, list[ShardingStrategy] | None] = {}
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            options[node.name] = None
            continue
        try:
            found = list(strategies_for_node(graph_module, node.name, mesh))
        except ShardVerifyError:
            found = []
        options[node.name] = found or None
    return options


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


def _meta_shapes(node: fx.Node):
    meta = node.meta.get("tensor_meta")
    if meta is None:
        return None
    if hasattr(meta, "shape"):
        return tuple(meta.shape)
    if isinstance(meta, (list, tuple)) and all(hasattr(m, "shape") for m in meta):
        return [tuple(m.shape) for m in meta]
    return None


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
    """The node's output layout: a Layout, a list of them for a tuple, or None (not a tensor)."""
    if strategy is not None:
        layouts = [Layout(strategy.get_sharding_spec_by_name(d.name), deferred) for d in strategy.outputs]
        return layouts[0] if len(layouts) == 1 else layouts
    shapes = _meta_shapes(node)
    if shapes is None:
        return None
    if isinstance(shapes, list):
        return [Layout.replicated(mesh.shape, s) for s in shapes]
    return Layout.replicated(mesh.shape, shapes)


def _itemsize(node: fx.Node) -> int:
    meta = node.meta.get("tensor_meta")
    dtype = getattr(meta, "dtype", None)
    import torch

    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 4


def metadata_read(node: fx.Node) -> object | None:
    """What a read of a tensor's metadata (``x.shape``, ``x.size()``, ``x.size(d)``, ``x.dim()``,
    ``x.ndim``) gives, from the traced global shape of the tensor; None for any other node
    (no metadata read gives None). Every rank reads the global shape, as the single-device
    model does."""
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node) or not hasattr(source.meta.get("tensor_meta"), "shape"):
        return None
    shape = source.meta["tensor_meta"].shape
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return {"shape": shape, "ndim": len(shape)}.get(node.args[1])  # type: ignore[call-overload]
    if node.op == "call_method" and node.target == "size" and not node.kwargs:
        return shape if len(node.args) == 1 else shape[node.args[1]] if isinstance(node.args[1], int) else None
    if node.op == "call_method" and node.target == "dim" and len(node.args) == 1:
        return len(shape)
    return None


def edge_targets(node: fx.Node, strategy: ShardingStrategy | None, mesh: DeviceMesh):
    """(operand name, producer node, element index or None, target layout) for every tensor the
    node takes; a generic node takes each tensor of a tuple-valued producer (split, chunk)
    replicated, as operand ``producer[i]``."""
    edges = []
    if strategy is not None:
        for data in strategy.inputs:
            producer = operand_producer(node, data.locator)
            if producer is not None:
                edges.append((data.name, producer, None, Layout(strategy.get_sharding_spec_by_name(data.name))))
        return edges
    if metadata_read(node) is not None:
        return edges                                 # the global shape needs none of the data
    for producer in node.all_input_nodes:
        shapes = _meta_shapes(producer)
        if isinstance(shapes, list):
            edges += [(f"{producer.name}[{i}]", producer, i, Layout.replicated(mesh.shape, shape))
                      for i, shape in enumerate(shapes)]
        elif shapes is not None:
            edges.append((producer.name, producer, None, Layout.replicated(mesh.shape, shapes)))
    return edges


def make_reshard(node: fx.Node, operand: str, producer: fx.Node, source, target: Layout,
                 mesh: DeviceMesh, index: int | None = None) -> Reshard:
    """The resharding of ``producer``'s output (element ``index`` of a tuple) into ``target``."""
    if index is not None and isinstance(source, list):
        source = source[index]
    if not isinstance(source, Layout):
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


def _parse_choice(value, node: str, where: str) -> tuple[str, bool]:
    """A plan entry: a strategy name, or ``{strategy: NAME, defer: true}`` to leave the
    strategy's AFTER all-reduce to the resharding that follows."""
    if isinstance(value, str):
        return value, False
    if isinstance(value, Mapping) and set(value) <= {"strategy", "defer"} and isinstance(value.get("strategy"), str):
        return value["strategy"], bool(value.get("defer", False))
    raise StrategyError(f"{where}: node {node!r}: expected a strategy name or {{strategy: NAME, defer: BOOL}}, "
                        f"got {value!r}")


def build_plan(graph_module: fx.GraphModule, mesh: DeviceMesh, choice: Mapping[str, object],
               options: Mapping[str, list[ShardingStrategy] | None] | None = None,
               flop_rate: float = FLOP_RATE, where: str = "plan") -> Plan:
    """The plan for ``choice`` (node name -> strategy name). A node with strategies that
    ``choice`` omits takes its fully replicated strategy."""
    options = node_options(graph_module, mesh) if options is None else options
    known = set(options)
    unknown = sorted(set(choice) - known)
    if unknown:
        raise StrategyError(f"{where}: no node named {unknown}; nodes are {sorted(known)}")
    chosen: dict[str, ShardingStrategy | None] = {}
    for node in graph_module.graph.nodes:
        found = options[node.name]
        if node.name in choice:
            if found is None:
                raise StrategyError(f"{where}: node {node.name!r} has no strategies (it runs replicated); "
                                    f"leave it out of the plan")
            wanted, defer = _parse_choice(choice[node.name], node.name, where)
            names = [s.name for s in found]
            if wanted not in names:
                raise StrategyError(f"{where}: node {node.name!r} has no strategy {wanted!r}; "
                                    f"its strategies are {names}")
            strategy = found[names.index(wanted)]
            if defer and not deferrable(strategy):
                raise StrategyError(f"{where}: node {node.name!r}: strategy {wanted!r} has no AFTER sum "
                                    f"all-reduce of its output to defer")
            chosen[node.name] = (strategy, deferrable(strategy) if defer else ())
        elif found is not None:
            chosen[node.name] = (replicated_choice(found), ())
            if chosen[node.name][0] is None:
                raise StrategyError(f"{where}: node {node.name!r} is not in the plan and has no fully "
                                    f"replicated strategy to default to; pick one of {[s.name for s in found]}")
        else:
            chosen[node.name] = (None, ())
    return assemble_plan(graph_module, mesh, chosen, flop_rate)


def assemble_plan(graph_module: fx.GraphModule, mesh: DeviceMesh,
                  chosen: Mapping[str, tuple[ShardingStrategy | None, tuple[int, ...]]],
                  flop_rate: float = FLOP_RATE) -> Plan:
    """The plan for ``chosen``: node name -> (strategy or None, deferred all-reduce axes)."""
    layouts = {}
    nodes = []
    compute = communication = resharding = 0.0
    memory = 0
    for node in graph_module.graph.nodes:
        strategy, deferred = chosen[node.name]
        reshards = tuple(make_reshard(node, operand, producer, layouts[producer.name], target, mesh, index)
                         for operand, producer, index, target in edge_targets(node, strategy, mesh))
        layouts[node.name] = node_layouts(node, strategy, mesh, deferred)
        nodes.append(NodePlan(node.name, strategy, reshards, deferred))
        resharding += sum(r.cost for r in reshards)
        if strategy is not None:
            compute += strategy.compute_cost.total / flop_rate
            communication += strategy.communication_cost.total
            if deferred:
                communication -= deferred_saving(strategy, deferred, mesh)
            memory += strategy.memory_cost.total.total
    return Plan(tuple(mesh.shape), tuple(nodes), PlanCost(compute, communication, resharding, memory), flop_rate)
