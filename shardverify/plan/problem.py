"""The planning problem, one object the solver and the plan's assembly both read: each node's
options (a strategy, or none for a node that runs generically, and which AFTER all-reduce axes
it leaves to the resharding), the edges between nodes grouped into classes, and the one cost
function: an option's own declared seconds and an edge's resharding seconds.

An edge's cost depends only on the producer's output layout and on the layout the consumer
wants, so options alike in those are one class: a solver pairs classes, not options, which
keeps a program exact with a fraction of the variables (:class:`EdgeClasses`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from torch import fx

from shardverify.capture.call import tuple_element
from shardverify.capture.meta import tensor_meta
from shardverify.plan.coverage import meta_shapes
from shardverify.plan.device import NOMINAL, DeviceProfile
from shardverify.plan.graph import (deferrable, deferred_saving, edge_targets, make_reshard, metadata_read,
                                    node_layouts, node_options)
from shardverify.plan.model import Reshard
from shardverify.plan.weights import trainable_weights
from shardverify.plan.workload import Workload, repeats
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.layout import ShapedLayout
from shardverify.sharding.strategy import OperationDataType, ShardingStrategy
from shardverify.strategies.generators.common import local_bytes

__all__ = ["Option", "OwnCost", "EdgeClasses", "PlanProblem"]


class Option(NamedTuple):
    """One choice of a node: its strategy (None: it runs generically) and the mesh axes of the
    strategy's AFTER all-reduce left to the resharding that follows (() for none)."""

    strategy: ShardingStrategy | None
    deferred: tuple[int, ...] = ()


class OwnCost(NamedTuple):
    """An option's declared seconds (compute on the device, communication, and the deferred
    all-reduce's seconds that deferring saves) and bytes per device, each counted as many times
    as the node runs or is held (:mod:`shardverify.plan.workload`)."""

    compute: float
    communication: float
    saving: float
    memory: int
    weights: int = 0     # of memory: the weights', with their gradients and optimizer state

    @property
    def seconds(self) -> float:
        return self.compute + self.communication - self.saving


@dataclass(frozen=True)
class EdgeClasses:
    """The edge from ``producer`` into ``consumer`` (node names; ``position``: the consumer's
    index in graph order, ``slot``: the producer's among the consumer's producers), its options
    in classes: ``sources`` the producer's option indices alike in output layout, ``targets`` the
    consumer's alike in what they want of it; ``costs[i][j]`` the resharding seconds of source
    class i into target class j."""

    producer: str
    consumer: str
    position: int
    slot: int
    sources: tuple[tuple[int, ...], ...]
    targets: tuple[tuple[int, ...], ...]
    costs: tuple[tuple[float, ...], ...]

    def cost(self, producer_option: int, consumer_option: int) -> float:
        i = next(i for i, found in enumerate(self.sources) if producer_option in found)
        j = next(j for j, found in enumerate(self.targets) if consumer_option in found)
        return self.costs[i][j]


def _hashable(layout):
    """A node's output layout as a dict key (a tuple-valued node has a list of them)."""
    return tuple(layout) if isinstance(layout, list) else layout


def _classes(keys: list) -> dict:
    """key -> the indices having it, in first-seen order."""
    found: dict = {}
    for index, key in enumerate(keys):
        found.setdefault(key, []).append(index)
    return found


def _variants(strategies, defer: bool) -> tuple[Option, ...]:
    """A node's options: each strategy as declared and, with ``defer``, also with its output left
    partial for the resharding to reduce."""
    if not strategies:
        return (Option(None),)
    found = []
    for strategy in strategies:
        found.append(Option(strategy))
        if defer and deferrable(strategy):
            found.append(Option(strategy, deferrable(strategy)))
    return tuple(found)


def _fed_as_partial(graph_module: fx.GraphModule, options: Mapping[str, list[ShardingStrategy] | None],
                    mesh: DeviceMesh, defer: bool) -> dict[str, list[ShardingStrategy] | None]:
    """The options worth a choice: a strategy taking a partial-sum input only where some producer
    can hand that partial value over as it is (a deferred reduction, :func:`deferrable`). Fed
    from a full value, it zeroes the value on all but one rank and reduces after the op what the
    same layout without the partial input never needed to; left in, such options would multiply
    a solver's choices for nothing. Nodes are taken in graph order (producers first)."""
    partial_out: dict[str, set[ShapedLayout]] = {}
    kept: dict[str, list[ShardingStrategy] | None] = {}
    for node in graph_module.graph.nodes:
        found = options.get(node.name)
        if not found:
            kept[node.name] = found
            continue

        def fed(strategy: ShardingStrategy) -> bool:
            wanted = {operand: (producer.name, target) for operand, producer, _, target
                      in edge_targets(node, strategy, mesh)}
            return any(p.operand in wanted and wanted[p.operand][1] in partial_out.get(wanted[p.operand][0], ())
                       for p in strategy.partial_inputs)

        chosen = [s for s in found if not s.partial_inputs or fed(s)] or list(found)
        kept[node.name] = chosen
        if defer:
            partial_out[node.name] = {node_layouts(node, s, mesh, deferrable(s)) for s in chosen if deferrable(s)}
    return kept


def _is_view(node: fx.Node) -> bool:
    """Does the node's ATen op return a view of an input (its schema aliases the first return)?"""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    returns = getattr(schema, "returns", ())
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


@dataclass(frozen=True)
class PlanProblem:
    """A traced model's planning problem on ``mesh``. ``options``: node name -> the strategies it
    is offered (None: it runs generically; :func:`~shardverify.plan.graph.node_options` when not
    given); ``defer``: whether an option may leave its AFTER all-reduce to the resharding;
    ``device``: what a second and a byte are measured on; ``workload``: how often the repeated block
    runs and what each weight carries. The choices, layouts and edge classes are derived once,
    when first asked for."""

    graph: fx.GraphModule
    mesh: DeviceMesh
    options: Mapping[str, list[ShardingStrategy] | None]
    device: DeviceProfile = NOMINAL
    defer: bool = True
    workload: Workload = Workload()
    _edge_costs: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, graph: fx.GraphModule, mesh: DeviceMesh,
           options: Mapping[str, list[ShardingStrategy] | None] | None = None, device: DeviceProfile = NOMINAL,
           defer: bool = True, workload: Workload = Workload()) -> PlanProblem:
        return cls(graph, mesh, node_options(graph, mesh) if options is None else options, device, defer, workload)

    # -- the one cost function -------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.graph.graph.nodes}

    @cached_property
    def _repeats(self) -> tuple[dict[str, int], dict[str, int]]:
        """(node -> times it runs per step, node -> copies of it held at once)."""
        runs, held, _ = repeats(self.graph, self.workload)
        return runs, held

    @cached_property
    def _weights(self) -> dict[str, str]:
        """get_attr node -> the trainable parameter it reads (a weight carries gradient and state)."""
        return trainable_weights(self.graph)

    @cached_property
    def _second_reads(self) -> frozenset[str]:
        """get_attr nodes of a parameter another node read first (a tied weight is held once)."""
        first: dict[str, str] = {}
        return frozenset(name for name, param in self._weights.items() if first.setdefault(param, name) != name)

    def _held_bytes(self, node: fx.Node, strategy: ShardingStrategy | None) -> tuple[int, int]:
        """(bytes of weights with their gradients and state, bytes of activations) per device that the
        node's output holds; a view of another node's output (a transpose) holds none of its own."""
        if _is_view(node) or node.name in self._second_reads:
            return 0, 0
        if strategy is not None:
            weights = activations = 0
            for data in strategy.operands:   # a weight fed by its own node is that node's to count
                numel = strategy.get_sharding_spec_by_name(data.name).local_numel()
                if node.name in self._weights or data.locator.kind == "param":
                    weights += self.workload.weight_bytes(numel, data.itemsize)
                elif data.type is OperationDataType.OUTPUT or data.locator.kind == "buffer":
                    activations += numel * data.itemsize
            return weights, activations
        if node.op == "output" or tuple_element(node) is not None or metadata_read(node) is not None:
            return 0, 0
        shapes = meta_shapes(node)
        meta = tensor_meta(node)
        if not isinstance(shapes, tuple) or meta is None:
            return 0, 0
        if node.name in self._weights:
            return self.workload.weight_bytes(math.prod(shapes), meta.dtype.itemsize), 0
        return 0, math.prod(shapes) * meta.dtype.itemsize

    def own_cost(self, name: str, option: Option) -> OwnCost:
        """What node ``name``'s option costs by itself, per training step (a generic node: its bytes)."""
        runs, held = self._repeats
        strategy, deferred = option
        weights, activations = self._held_bytes(self._by_name[name], strategy)
        copies = held.get(name, 1)
        memory, weights = (weights + activations) * copies, weights * copies
        if strategy is None:
            return OwnCost(0.0, 0.0, 0.0, memory, weights)
        times = runs.get(name, 1)
        saving = deferred_saving(strategy, deferred, self.mesh) if deferred else 0.0
        traffic = 3 * sum(local_bytes(d, strategy.get_sharding_spec_by_name(d.name))
                          for d in strategy.operands)    # read or written once forward, twice backward
        compute = self.device.seconds(strategy.compute_cost.total, traffic)
        communication = strategy.communication_cost.total
        if self.workload.recompute and name in runs:     # the forward again, in the backward pass
            compute += self.device.seconds(strategy.compute_cost.fwd, traffic / 3)
            communication += strategy.communication_cost.fwd
        return OwnCost(compute * times, communication * times, saving * times, memory, weights)

    def reshard(self, node: fx.Node, operand: str, producer: fx.Node, source, target: ShapedLayout,
                index: int | None = None) -> Reshard:
        """The resharding of ``producer``'s output (element ``index`` of a tuple) into ``target``."""
        return make_reshard(node, operand, producer, source, target, self.mesh, index)

    def edge_cost(self, node: fx.Node, producer: fx.Node, source, wanted: tuple) -> float:
        """The resharding seconds of ``producer``'s output laid out as ``source`` into what
        ``node`` wants of it: ``wanted`` is ((operand, element or None, layout), ...). Many edges
        share a (layout, target, dtype): each is costed once."""
        total = 0.0
        for operand, index, target in wanted:
            picked = source[index] if index is not None and isinstance(source, list) else source
            key = (_hashable(picked), target, getattr(tensor_meta(producer), "dtype", None))
            if key not in self._edge_costs:   # (make_reshard names an output that is no single tensor)
                self._edge_costs[key] = self.reshard(node, operand, producer, source, target, index).cost
            total += self._edge_costs[key]
        return total

    # -- what a solver chooses among ------------------------------------------------------
    @cached_property
    def nodes(self) -> tuple[fx.Node, ...]:
        return tuple(self.graph.graph.nodes)

    @cached_property
    def choices(self) -> dict[str, tuple[Option, ...]]:
        """node name -> its options, in graph order (:func:`_fed_as_partial`, then :func:`_variants`)."""
        kept = _fed_as_partial(self.graph, self.options, self.mesh, self.defer)
        return {n.name: _variants(kept[n.name], self.defer) for n in self.nodes}

    @cached_property
    def layouts(self) -> dict[str, list]:
        """node name -> each option's output layout."""
        return {n.name: [node_layouts(n, strategy, self.mesh, deferred) for strategy, deferred in self.choices[n.name]]
                for n in self.nodes}

    @cached_property
    def edges(self) -> tuple[EdgeClasses, ...]:
        """Every edge in classes, by consumer in graph order, then producer as the consumer meets it."""
        found = []
        for position, node in enumerate(self.nodes):
            options = self.choices[node.name]
            # producer -> what each option of this node wants of its output: ((operand, element, layout), ...)
            wants: dict[str, list[tuple]] = {}
            feeds: dict[str, fx.Node] = {}
            for k, (strategy, _) in enumerate(options):
                for operand, producer, index, target in edge_targets(node, strategy, self.mesh):
                    feeds[producer.name] = producer
                    wanted = wants.setdefault(producer.name, [()] * len(options))
                    wanted[k] += ((operand, index, target),)
            for slot, (name, wanted) in enumerate(wants.items()):
                layouts = self.layouts[name]
                sources = _classes([_hashable(layout) for layout in layouts])
                targets = _classes(wanted)
                times = self.runs(node.name)
                costs = tuple(tuple(times * self.edge_cost(node, feeds[name], layouts[sps[0]], t_key)
                                    for t_key in targets) for sps in sources.values())
                found.append(EdgeClasses(name, node.name, position, slot,
                                         tuple(tuple(s) for s in sources.values()),
                                         tuple(tuple(t) for t in targets.values()), costs))
        return tuple(found)

    def seconds(self, chosen: Mapping[str, int]) -> float:
        """The declared seconds of ``chosen`` (node name -> option index): what a solver minimises."""
        own = sum(self.own_cost(name, self.choices[name][k]).seconds for name, k in chosen.items())
        return own + sum(edge.cost(chosen[edge.producer], chosen[edge.consumer]) for edge in self.edges)

    def memory(self, chosen: Mapping[str, int]) -> int:
        """The declared bytes per device of ``chosen``."""
        return sum(self.own_cost(name, self.choices[name][k]).memory for name, k in chosen.items())

    def least_memory(self, ruled_out: Mapping[str, Collection[int]] | None = None) -> OwnCost:
        """The bytes per device of the choice that holds least (memory couples no two nodes, so it is
        each node's least), with the weights' share of them; ``ruled_out``: node -> option indices
        it may not choose."""
        least = [min((self.own_cost(name, option) for k, option in enumerate(options)
                      if k not in (ruled_out or {}).get(name, ())), key=lambda c: c.memory)
                 for name, options in self.choices.items()]
        return OwnCost(0.0, 0.0, 0.0, sum(c.memory for c in least), sum(c.weights for c in least))

    def runs(self, name: str) -> int:
        """How many times node ``name`` runs per training step."""
        return self._repeats[0].get(name, 1)
