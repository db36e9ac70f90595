"""A solved plan as a PyTorch parallelize plan: one ParallelStyle per layer, read from the strategies the
plan chose for the nodes that take that layer's weights, or, where no style says what the plan does, the
node and the reason (never a guess).

The mesh's axes are read apart. An axis that splits some weight is the tensor-parallel axis (one only:
a weight split over two axes has no ParallelStyle); an axis that splits no weight and only the batch
(dim 0) of the activations is data parallel (the batch split, the weights whole); an axis that splits
nothing is unused. On the tensor-parallel axis, ``parallelize_module`` hands plain local tensors from
layer to layer, and the ops between layers run on them as they are: so the export follows, node by node
in graph order, the layout each value arrives in (a model input whole, a layer's output as its style's
``output_layouts`` gives it, a plain op's output as the plan lays it out) and holds every node to it: a
plain op the plan gives another layout than the one arriving, or a collective of its own, or sizes of
the whole tensor while it runs on a shard, is not expressible."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from shardverify.plan.coverage import shards
from shardverify.plan.export_facts import EMBEDDING, LINEAR, NORM, NodeFacts
from shardverify.plan.model import NodePlan, Plan, Reshard
from shardverify.sharding.layout import ShapedLayout

__all__ = ["AxisLayout", "ModuleStyle", "Inexpressible", "ParallelizeExport", "export_parallelize"]


@dataclass(frozen=True)
class AxisLayout:
    """A tensor's layout along one mesh axis: ``R`` whole, ``S`` dim ``dim`` split, ``P`` partial sums."""

    kind: str
    dim: int = 0

    def __str__(self) -> str:
        return {"R": "Replicate()", "P": "Partial()"}.get(self.kind, f"Shard({int(self.dim)})")


WHOLE = AxisLayout("R")


@dataclass(frozen=True)
class ModuleStyle:
    """One entry of the parallelize plan: ``style`` colwise, rowwise or sequence on module ``module``,
    the layout its input arrives in and the one it hands on (the plan's nodes it stands for)."""

    module: str
    style: str
    input_layout: AxisLayout
    output_layout: AxisLayout
    nodes: tuple[str, ...]
    sequence_dim: int = 1


@dataclass(frozen=True)
class Inexpressible:
    """A node (or a module, or a mesh axis) whose chosen layout no ParallelStyle gives, and why."""

    where: str
    reason: str


@dataclass(frozen=True)
class ParallelizeExport:
    """The plan as ParallelStyles on ``tp_axis`` and data parallelism over ``data_parallel_axes``."""

    mesh_shape: tuple[int, ...]
    tp_axis: int | None
    data_parallel_axes: tuple[int, ...]
    styles: tuple[ModuleStyle, ...]
    inexpressible: tuple[Inexpressible, ...]

    def to_json(self) -> dict:
        return {"mesh": list(self.mesh_shape), "tensor_parallel_axis": self.tp_axis,
                "data_parallel_axes": list(self.data_parallel_axes),
                "styles": [{"module": s.module, "style": s.style, "input_layouts": str(s.input_layout),
                            "output_layouts": str(s.output_layout), "nodes": list(s.nodes)} for s in self.styles],
                "not_expressible": [{"where": i.where, "reason": i.reason} for i in self.inexpressible]}


def axis_layout(layout: ShapedLayout, axis: int) -> AxisLayout | None:
    """``layout`` along ``axis``; None when a dim is split over this axis and another together."""
    if axis in layout.partial:
        return AxisLayout("P")
    for dim, axes in layout.spec.dim_partition:
        if axis in axes:
            return AxisLayout("S", dim) if len(axes) == 1 else None
    return WHOLE


@dataclass(frozen=True)
class _Use:
    """A node's operand that is a weight: the parameter's name and the layout the strategy takes it in."""

    node: str
    param: str
    layout: ShapedLayout


def _weight_uses(plan: Plan, facts: dict[str, NodeFacts]) -> dict[str, tuple[_Use, ...]]:
    found: dict[str, tuple[_Use, ...]] = {}
    for item in plan.nodes:
        fact, strategy = facts[item.node], item.strategy
        if strategy is None or not fact.params:
            continue
        uses = tuple(_Use(item.node, name, ShapedLayout.of_spec(strategy.get_sharding_spec_by_name(d.name)))
                     for d in strategy.inputs if (name := fact.param(d.locator.kind, d.locator.key)))
        if uses:
            found[item.node] = uses
    return found


def _activation_layouts(plan: Plan, weights: set[str]) -> list[tuple[str, ShapedLayout]]:
    """Every layout an activation takes in the plan: each edge's source and target, weights left out."""
    return [(r.node, layout) for item in plan.nodes for r in item.reshards if r.producer not in weights
            for layout in (r.source, r.target)]


def _axes(plan: Plan, uses: dict[str, tuple[_Use, ...]], weights: set[str]):
    """(tensor-parallel axis or None, data-parallel axes, what no style expresses)."""
    split = Counter(axis for node_uses in uses.values() for use in node_uses for axis in use.layout.spec.sharded_axes())
    tp = split.most_common(1)[0][0] if split else None
    activations = _activation_layouts(plan, weights)
    data, problems = [], []
    for axis in range(len(plan.mesh_shape)):
        if axis in split:
            continue
        seen = [(node, axis_layout(layout, axis), layout) for node, layout in activations]
        other = next(((node, layout) for node, found, layout in seen if found not in (WHOLE, AxisLayout("S", 0))), None)
        if other is not None:
            problems.append(Inexpressible(f"mesh axis {axis}", f"splits no weight, but node {other[0]!r} takes a "
                                          f"value laid out {other[1]}: data parallelism over one axis splits only "
                                          "the batch (dim 0), over that axis alone"))
        elif any(found != WHOLE for _, found, _ in seen):
            data.append(axis)
    return tp, tuple(data), problems


def export_parallelize(plan: Plan, facts: tuple[NodeFacts, ...]) -> ParallelizeExport:
    """The ParallelStyles that do what ``plan`` does, and the nodes where none does (see the module)."""
    by_name = {f.name: f for f in facts}
    weights = {f.name for f in facts if f.kind == "weight"}
    uses = _weight_uses(plan, by_name)
    tp, data, problems = _axes(plan, uses, weights)
    gathered = {r.producer for item in plan.nodes for r in item.reshards if r.steps}
    problems += [Inexpressible(item.node, f"the plan holds this weight sharded ({item.strategy.name}) and gathers it "
                               "where an op takes it otherwise (ZeRO-3); the export writes no fully_shard, which "
                               "shards a whole module's parameters on dim 0")
                 for item in plan.nodes if item.node in weights and shards(item.strategy) and item.node in gathered]
    styles: list[ModuleStyle] = []
    if tp is not None:
        flow = _Flow(plan, by_name, uses, weights, tp)
        styles, more = flow.run()
        problems += more
    return ParallelizeExport(tuple(plan.mesh_shape), tp, data, tuple(styles), tuple(problems))


class _Flow:
    """The layout each value arrives in along the tensor-parallel axis, node by node (module docstring)."""

    def __init__(self, plan: Plan, facts: dict[str, NodeFacts], uses, weights: set[str], tp: int) -> None:
        self.plan, self.facts, self.uses, self.weights, self.tp = plan, facts, uses, weights, tp
        self.arrives: dict[str, AxisLayout] = {}
        self.consumers: dict[str, list[Reshard]] = defaultdict(list)
        for item in plan.nodes:
            for r in item.reshards:
                self.consumers[r.producer].append(r)
        self.problems: list[Inexpressible] = []
        self.styles: dict[str, ModuleStyle] = {}

    def run(self) -> tuple[list[ModuleStyle], list[Inexpressible]]:
        for item in self.plan.nodes:
            fact = self.facts[item.node]
            if fact.kind in ("input", "constant"):
                self.arrives[item.node] = WHOLE
            elif fact.kind == "output":
                self._plain(item, fact)
            elif fact.kind == "call":
                self._call(item, fact)
        bad = {p.where for p in self.problems}
        return [s for s in self.styles.values() if s.module not in bad], self.problems

    def _along(self, layout: ShapedLayout) -> AxisLayout | None:
        return axis_layout(layout, self.tp)

    def _planned(self, item: NodePlan) -> AxisLayout:
        """The node's own output along the axis as the plan lays it out."""
        sources = [r.source for r in self.consumers[item.node]]
        found = self._along(sources[0]) if sources else WHOLE
        return found or WHOLE

    def _not(self, where: str, reason: str) -> None:
        self.problems.append(Inexpressible(where, reason))

    def _activation_edges(self, item: NodePlan) -> list[Reshard]:
        return [r for r in item.reshards if r.producer not in self.weights]

    def _call(self, item: NodePlan, fact: NodeFacts) -> None:
        own = self.uses.get(item.node, ())
        split = [u for u in own if u.layout.spec.sharded_axes()]
        sharded_in = any(self._along(r.target) != WHOLE for r in self._activation_edges(item))
        if split:
            self._weighted(item, fact, own)
        elif own and sharded_in and fact.op == NORM and fact.module_kind == NORM:
            self._sequence(item, fact)
        elif own and sharded_in:
            self._not(item.node, f"its weights ({', '.join(sorted({u.param for u in own}))}) stay whole while it runs "
                                 "on a split input: each rank's weight gradient is a part, and no ParallelStyle "
                                 f"but SequenceParallel (a norm over the last dims) sums it")
            self.arrives[item.node] = self._planned(item)
        else:
            self._plain(item, fact)

    def _plain(self, item: NodePlan, fact: NodeFacts) -> None:
        """An op between layers: it runs on the local tensors as they arrive."""
        for r in self._activation_edges(item):
            wanted, arrives = self._along(r.target), self.arrives.get(r.producer, WHOLE)
            if wanted != arrives:
                what = "the model's output" if fact.kind == "output" else f"operand {r.operand!r}"
                self._not(item.node, f"the plan takes {what} as {wanted or 'split over two axes'} but it arrives as "
                                     f"{arrives} (no ParallelStyle reshards between plain ops)")
        strategy = item.strategy
        if strategy is not None and any(self.tp in a.axes for a in strategy.communication_actions):
            self._not(item.node, f"its strategy {strategy.name!r} runs a collective of its own over mesh axis "
                                 f"{self.tp}; a plain op between ParallelStyles runs none")
        layouts = [self._along(r.target) for r in self._activation_edges(item)]
        if fact.shape_args and any(found != WHOLE for found in layouts):
            self._not(item.node, f"{fact.target} takes sizes of the whole tensor while it runs on a split one "
                                 "(the plan gives each rank its own sizes; a plain op keeps the traced ones)")
        self.arrives[item.node] = self._planned(item) if fact.kind == "call" else WHOLE

    def _hands_on(self, item: NodePlan, styled: bool = False) -> AxisLayout | None:
        """The one layout every consumer takes the node's output in; None when they differ. ``styled``:
        leave out the consumers that are layers split over the axis (their style takes any layout)."""
        wanted = {self._along(r.target) for r in self.consumers[item.node]
                  if not (styled and self._split_layer(r.node))}
        return wanted.pop() if len(wanted) == 1 else (self._planned(item) if not wanted else None)

    def _split_layer(self, node: str) -> bool:
        fact = self.facts[node]
        return fact.op in (LINEAR, EMBEDDING) and any(self.tp in u.layout.spec.sharded_axes()
                                                      for u in self.uses.get(node, ()))

    def _add(self, style: ModuleStyle) -> None:
        before = self.styles.get(style.module)
        if before is not None and (before.style, before.input_layout, before.output_layout) != \
                (style.style, style.input_layout, style.output_layout):
            self._not(style.module, f"called by nodes {before.nodes[0]!r} and {style.nodes[0]!r} in different "
                                    "layouts: a module takes one ParallelStyle")
            return
        nodes = (before.nodes if before else ()) + style.nodes
        self.styles[style.module] = ModuleStyle(style.module, style.style, style.input_layout, style.output_layout,
                                                nodes, style.sequence_dim)
        self.arrives[nodes[-1]] = style.output_layout

    def _weighted(self, item: NodePlan, fact: NodeFacts, own: tuple[_Use, ...]) -> None:
        """A node that takes a weight split over the axis: colwise or rowwise on its layer, or why not."""
        self.arrives[item.node] = self._planned(item)
        where = fact.module or item.node
        if fact.op not in (LINEAR, EMBEDDING) or fact.module_kind != fact.op:
            self._not(where, f"{fact.target} (in a {fact.module_type or 'module'}) takes a split weight; "
                             "ColwiseParallel and RowwiseParallel shard only nn.Linear and nn.Embedding")
            return
        weight = next((u for u in own if u.param.endswith(".weight") or u.param == "weight"), own[0])
        if weight.param in fact.tied:
            self._not(where, f"weight {weight.param} is shared with another module (tied): a ParallelStyle on one "
                             "of them replaces the parameter and unties it")
            return
        other = weight.layout.spec.sharded_axes() - {self.tp}
        if other:
            axes = sorted(weight.layout.spec.sharded_axes())
            self._not(where, f"weight {weight.param} is split over mesh axes {axes}: "
                             "a ParallelStyle splits a weight over one axis")
            return
        dim = self._along(weight.layout)
        edges = self._activation_edges(item)
        if dim is None or dim.kind != "S" or len(edges) != 1:
            self._not(where, f"weight {weight.param} laid out {dim} with {len(edges)} activation input(s)")
            return
        colwise = dim.dim == (0 if fact.op == LINEAR else 1)
        self._styled(item, fact, own, weight, edges[0], colwise)

    def _styled(self, item: NodePlan, fact: NodeFacts, own, weight: _Use, edge: Reshard, colwise: bool) -> None:
        where, strategy = fact.module, item.strategy
        wanted_in = self._along(edge.target)
        out = self._along(ShapedLayout.of_spec(strategy.get_sharding_spec_by_name(strategy.outputs[0].name)))
        ndim = len(edge.target.spec.tensor_shape)
        desired = WHOLE if colwise or fact.op == EMBEDDING else AxisLayout("S", ndim - 1)
        out_ndim = len(strategy.get_sharding_spec_by_name(strategy.outputs[0].name).tensor_shape)
        gives = AxisLayout("S", out_ndim - 1) if colwise else WHOLE
        bias_wanted = AxisLayout("S", 0) if colwise else WHOLE
        bias = [u for u in own if u is not weight and self._along(u.layout) != bias_wanted]
        arrives, hands_on = self.arrives.get(edge.producer, WHOLE), self._hands_on(item)
        style = "colwise" if colwise else "rowwise"
        if wanted_in != desired or out != gives or bias:
            self._not(where, f"node {item.node!r} ({strategy.name}) takes its input {wanted_in} and gives {out}: "
                             f"{style} parallel takes {desired} and gives {gives}"
                             + (f", with its bias {'split' if colwise else 'whole'}" if bias else ""))
        elif arrives.kind == "P" or hands_on is None or hands_on.kind == "P":
            self._not(where, f"node {item.node!r}: its input arrives as {arrives} and its consumers take "
                             f"{hands_on or 'different layouts'}: a ParallelStyle takes and hands on whole or split "
                             "tensors, never partial sums")
        else:
            self._add(ModuleStyle(where, style, arrives, hands_on, (item.node,)))

    def _sequence(self, item: NodePlan, fact: NodeFacts) -> None:
        """A norm whose input is split along a dim it does not normalize: SequenceParallel on its layer."""
        edges = self._activation_edges(item)
        wanted = self._along(edges[0].target) if len(edges) == 1 else None
        arrives = self.arrives.get(edges[0].producer, WHOLE) if edges else WHOLE
        ndim = len(edges[0].target.spec.tensor_shape) if edges else 0
        hands_on = self._hands_on(item, styled=True)
        self.arrives[item.node] = self._planned(item)
        if wanted is None or wanted.kind != "S" or wanted.dim >= ndim - fact.normalized or arrives != wanted \
                or hands_on != wanted or self._planned(item) != wanted:
            self._not(fact.module, f"norm node {item.node!r} runs on a split input ({wanted}, arriving as {arrives}, "
                                   f"handed on as {hands_on}): SequenceParallel takes and hands on the same split of "
                                   "a dim the norm does not normalize")
            return
        self._add(ModuleStyle(fact.module, "sequence", wanted, wanted, (item.node,), wanted.dim))
