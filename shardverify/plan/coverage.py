"""What a plan check covers: for every node of the captured model, whether a handler serves it,
refused it (and why), or is missing, and whether the plan shards it. A node without strategies
runs replicated, which is correct but checks no sharding; a plan check says so, with counts, so
that a pass over a model whose ops fall back is never mistaken for a check of its sharding.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx

from shardverify.capture.meta import output_metas, tensor_meta
from shardverify.capture.uninitialised import is_uninitialised
from shardverify.capture.call import target_name, tuple_element
from shardverify.capture.decompose import not_decomposed, origin, torch_level
from shardverify.errors import ShardVerifyError, StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import ShardingStrategy, first_of_each_layout
from shardverify.strategies.for_node import OnDemand, strategies_for_node
from shardverify.strategies.generators.registry import GeneratorContext
from shardverify.strategies.handlers.base import HandlerDef
from shardverify.strategies.handlers.call_values import resolve_operands, resolve_params
from shardverify.strategies.handlers.serving import handler_for_node
from shardverify.strategies.rules.generator import bound_rule

__all__ = ["NodeStatus", "Coverage", "classify_nodes", "target_name", "shards", "meta_shapes", "STATUSES", "unserved"]

#: a tensor op with strategies / whose handler refused it / that no spec covers / an ATen
#: factory that builds a tensor from constants alone / an allocation of uninitialised memory,
#: never compared; a node that returns no tensor (``x.size(1)``, an assertion) is not an op a
#: strategy could shard
STATUSES = ("handled", "refused", "unhandled", "constant", "not compared", "no tensor output", "element")
ELEMENT = ("one tensor of its producer's tuple (operator.getitem): no op, it moves no data and takes the layout the "
           "producer's strategy gives that tensor")
UNINITIALISED = ("uninitialised memory (empty_like, new_empty): its values are the allocator's leftovers, different "
                 "on every rank and on the single device, so it is never compared; the consumers that write into it "
                 "and read it are")
CONSTANT = ("built from constants alone (no tensor input, or only its dtype, device and shape; not random): every "
            "rank builds the whole tensor, as the single device does, and its consumers take their shards of it "
            "locally")


#: ATen factories that read only the dtype, device and (for ``*_like``) shape of their tensor
#: argument, never its values (``mask.new_ones(...)`` in HF's attention-mask code); the
#: ``empty`` variants are left out: their values are whatever the memory held
_METADATA_ONLY = ("aten::new_ones", "aten::new_zeros", "aten::new_full", "aten::ones_like", "aten::zeros_like",
                  "aten::full_like")


def is_constant(node: fx.Node) -> bool:
    """An ATen factory (``arange``, ``full``, ``zeros``) called with no graph value, or one that
    reads only its tensor argument's dtype, device and shape (``new_ones``, ``zeros_like``), and
    not seeded by the random generator: its value is the same on every rank and on the single
    device."""
    tags = getattr(node.target, "tags", None)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or tags is None \
            or torch.Tag.nondeterministic_seeded in tags:
        return False
    return not node.all_input_nodes or node.target.name() in _METADATA_ONLY


@dataclass(frozen=True)
class NodeStatus:
    node: str
    target: str
    status: str
    reason: str = ""
    partial: int = 0    # strategies left out: they take a partial max or min input
    uninitialised: bool = False   # allocates memory without values (empty_like): never compared
    origin: tuple[str, str] | None = None   # (node, target) of the model node it was decomposed from

    @property
    def source(self) -> str:
        """Where the node came from, said: " (decomposed from 'lstm': aten.lstm.input)", or ""."""
        return f" (decomposed from {self.origin[0]!r}: {self.origin[1]})" if self.origin else ""


def meta_shapes(node: fx.Node) -> tuple[int, ...] | list[tuple[int, ...]] | None:
    """The node's output shape, a list of them for a tuple of tensors, None for a non-tensor."""
    single = tensor_meta(node)
    if single is not None:
        return tuple(single.shape)
    metas = output_metas(node)
    if metas is not None and None not in metas:
        return [tuple(m.shape) for m in metas]
    return None


def unserved(node: fx.Node, graph_module: fx.GraphModule) -> bool:
    """An ATen op node, or an fx graph's torch-level call (a function or a tensor method), that
    returns a tensor and that no handler serves (nor is it a constant or uninitialised memory),
    or an ATen op whose handler's rule does not describe the call (``aten.einsum`` of a diagonal,
    ``"bii->bi"``, or of three operands): what
    :func:`shardverify.capture.decompose.decompose_unserved` decomposes."""
    aten = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    if not (aten or torch_level(node) is not None) or is_uninitialised(node) or meta_shapes(node) in (None, []) \
            or is_constant(node):
        return False
    handler = handler_for_node(node, graph_module)
    return handler is None or (aten and not _describes(handler, node, graph_module))


def _describes(handler: HandlerDef, node: fx.Node, graph_module: fx.GraphModule) -> bool:
    """Does a rules handler's rule bind to the call's operands and parameters (no mesh needed)?
    Any other refusal (a parameter computed in the graph) is the handler's to say, at the plan."""
    if handler.generator != "rules":
        return True
    try:
        bound_rule(GeneratorContext(node=node, graph_module=graph_module, mesh=DeviceMesh((1,)),
                                    operands=resolve_operands(handler, node, graph_module),
                                    params=resolve_params(handler, node, graph_module),
                                    handler_name=handler.name, handler=handler))
    except StrategyError:
        return False
    except ShardVerifyError:
        pass
    return True


def _no_handler(node: fx.Node, name: str) -> str:
    """Why a node has no strategies: no spec, and why it was not decomposed."""
    aten = isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    opaque = not aten and node.target is not operator.getitem and torch_level(node) is None
    why = not_decomposed(node) or ("a module's or the user's own call, kept whole (decomposition works on "
                                   "ATen ops and torch's own calls: capture with export to trace into it)"
                                   if opaque else "")
    return f"no spec has target {name}" + (f"; not decomposed: {why}" if why else "")


def classify_nodes(graph_module: fx.GraphModule, mesh: DeviceMesh, on_demand: OnDemand | None = None
                   ) -> tuple[dict[str, list[ShardingStrategy] | None], tuple[NodeStatus, ...]]:
    """(node name -> its strategies or None for a node that runs generically, the status of every
    op node): the plan's options and the account of the ones that fall back, from one pass. A
    call outside its spec's grid is served through ``on_demand`` (its strategies that verified
    at the call), refused without."""
    options: dict[str, list[ShardingStrategy] | None] = {}
    statuses: list[NodeStatus] = []
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            options[node.name] = None
            continue
        name = target_name(node)
        if is_uninitialised(node):   # its consumers are compared, never its leftover memory
            options[node.name] = None
            statuses.append(NodeStatus(node.name, name, "not compared", UNINITIALISED, uninitialised=True,
                                       origin=origin(node)))
            continue
        if tuple_element(node) is not None:   # a tuple's tensor: laid out as its producer's strategy gives it
            options[node.name] = None
            statuses.append(NodeStatus(node.name, name, "element", ELEMENT, origin=origin(node)))
            continue
        if meta_shapes(node) in (None, []):   # no tensor, or an empty tuple of them (a 0-d tensor is one)
            options[node.name] = None
            statuses.append(NodeStatus(node.name, name, "no tensor output", origin=origin(node)))
            continue
        if handler_for_node(node, graph_module) is None:
            options[node.name] = None
            statuses.append(NodeStatus(node.name, name, "constant", CONSTANT, origin=origin(node)) if is_constant(node)
                            else NodeStatus(node.name, name, "unhandled", _no_handler(node, name), origin=origin(node)))
            continue
        try:
            found = list(strategies_for_node(graph_module, node.name, mesh, on_demand=on_demand))
        except ShardVerifyError as error:
            options[node.name] = None
            # a factory of constants its spec's rule does not describe (mask.new_ones(()) of a 4-d mask):
            # built whole on every rank, as without a spec
            statuses.append(NodeStatus(node.name, name, "constant", CONSTANT, origin=origin(node)) if is_constant(node)
                            else NodeStatus(node.name, name, "refused", str(error).splitlines()[0], origin=origin(node)))
            continue
        # a plan carries partial sums between nodes (a deferred reduction, a zeroed copy), not
        # partial max/min: a strategy taking one is verified on its own but left out, and counted
        kept = [s for s in found if all(p.op == "sum" for p in s.partial_inputs)]
        # strategies alike but in name (a following op's, one per predecessor strategy) are one option
        kept = first_of_each_layout(kept)
        options[node.name] = kept or None
        statuses.append(NodeStatus(node.name, name, "handled", partial=len(found) - len(kept), origin=origin(node))
                        if kept else NodeStatus(node.name, name, "refused", "its spec offers no strategy for this call",
                                                origin=origin(node)))
    return options, tuple(statuses)


def shards(strategy: ShardingStrategy | None) -> bool:
    """Does the strategy split a tensor or communicate (a partial result)?"""
    return strategy is not None and (any(spec.dim_partition for _, spec in strategy.sharding_specs)
                                     or bool(strategy.communication_actions))


@dataclass(frozen=True)
class Coverage:
    """The statuses of a plan's op nodes and the nodes its plan shards."""

    statuses: tuple[NodeStatus, ...]
    sharded: tuple[str, ...]        # op nodes whose chosen strategy lays out a tensor sharded
    #: calls outside their spec's grid verified where they were met (OnDemandVerifier's summary
    #: and lines); None when the plan served the grid's calls only (verified_only)
    on_demand: dict | None = None
    on_demand_lines: tuple[str, ...] = ()

    @classmethod
    def of(cls, statuses: tuple[NodeStatus, ...], plan, on_demand=None) -> Coverage:
        """``on_demand``: the OnDemandVerifier that served the plan's calls outside their grid."""
        chosen = {item.node: item.strategy for item in plan.nodes}
        return cls(statuses, tuple(s.node for s in statuses if s.status == "handled" and shards(chosen.get(s.node))),
                   None if on_demand is None else on_demand.summary(),
                   () if on_demand is None else tuple(on_demand.lines()))

    def count(self, status: str) -> int:
        return sum(1 for s in self.statuses if s.status == status)

    @property
    def tensor_ops(self) -> int:
        """Nodes that return a tensor: the ops a plan could shard, and the constants (a tuple's
        element is its producer's tensor, counted there)."""
        return sum(1 for s in self.statuses if s.status not in ("no tensor output", "element"))

    @property
    def fallbacks(self) -> tuple[NodeStatus, ...]:
        """Tensor ops that run replicated because no strategy serves them."""
        return tuple(s for s in self.statuses if s.status in ("refused", "unhandled"))

    @property
    def uninitialised(self) -> tuple[str, ...]:
        """Nodes of uninitialised memory (empty_like, new_empty): the plan check never compares their
        values, which are the allocator's leftovers; it compares their consumers'."""
        return tuple(s.node for s in self.statuses if s.uninitialised)

    def decompositions(self) -> dict[tuple[str, str], Counter]:
        """(model node, its target) -> the targets of the nodes it was decomposed into, counted."""
        found: dict[tuple[str, str], Counter] = {}
        for s in self.statuses:
            if s.origin is not None:
                found.setdefault(s.origin, Counter())[s.target] += 1
        return found

    @property
    def not_decomposed(self) -> tuple[NodeStatus, ...]:
        """Nodes without a handler that could not be decomposed either (the reason says why)."""
        return tuple(s for s in self.statuses if s.status == "unhandled" and "not decomposed:" in s.reason)

    def decomposition_lines(self, show: int = 12) -> list[str]:
        found = self.decompositions()
        if not found:
            return []
        lines = [f"  decomposed: {len(found)} node(s) into {sum(sum(c.values()) for c in found.values())} node(s) "
                 "with PyTorch's decompositions, or shardverify's of a library's custom op (no spec serves them "
                 "as they are)"]
        for (node, target), pieces in list(found.items())[:show]:
            lines.append(f"    {node!r} {target} -> {sum(pieces.values())} nodes: "
                         + ", ".join(f"{t} x{n}" for t, n in pieces.most_common(8))
                         + (f", ... {len(pieces) - 8} more target(s)" if len(pieces) > 8 else ""))
        if len(found) > show:
            lines.append(f"    ... {len(found) - show} more decomposed node(s)")
        return lines

    def unhandled_targets(self) -> Counter:
        return Counter(s.target for s in self.statuses if s.status == "unhandled")

    def headline(self) -> str:
        handled, empty = self.count("handled"), self.count("not compared")
        return (f"{self.tensor_ops} tensor op(s): {handled} with sharding strategies ({len(self.sharded)} sharded "
                f"by the plan, {handled - len(self.sharded)} replicated), {self.count('refused')} refused by their "
                f"spec, {self.count('unhandled')} no spec covers, {self.count('constant')} built from constants"
                + (f", {empty} not compared (uninitialised memory)" if empty else "")
                + f"; {self.count('no tensor output')} other node(s)"
                + (f", {self.count('element')} tuple element(s) laid out by their producer"
                   if self.count("element") else "")
                + (f"; {len(self.decompositions())} node(s) decomposed" if self.decompositions() else ""))

    def lines(self, show: int = 12) -> list[str]:
        lines = [f"coverage: {self.headline()}"]
        targets = self.unhandled_targets()
        if targets:
            lines.append("  no spec covers: " + ", ".join(f"{t} x{n}" for t, n in targets.most_common(show))
                         + (f", ... {len(targets) - show} more target(s)" if len(targets) > show else ""))
        partial = [s for s in self.statuses if s.partial]
        if partial:
            lines.append(f"  not considered: {sum(s.partial for s in partial)} layout(s) of {len(partial)} op(s) that "
                         f"would take a max or min left unfinished across devices by the op before; a plan passes "
                         f"values between ops whole, split or as partial sums, so this narrows the plans "
                         f"considered (one might have cost less) and never what is checked")
        lines += self.decomposition_lines(show)
        undone = Counter((s.target, s.reason.split("not decomposed: ", 1)[1]) for s in self.not_decomposed)
        if undone:
            lines.append(f"  not decomposed: {len(self.not_decomposed)} op(s) no spec covers: "
                         + "; ".join(f"{t} x{n} ({why})" for (t, why), n in undone.most_common(show))
                         + (f"; ... {len(undone) - show} more" if len(undone) > show else ""))
        lines += [f"  {line}" for line in self.on_demand_lines]
        empty = [s for s in self.statuses if s.uninitialised]
        if empty:
            lines.append(f"  not compared: {len(empty)} node(s) of uninitialised memory ("
                         + ", ".join(f"{s.node!r}: {s.target}" for s in empty[:show])
                         + (", ..." if len(empty) > show else "") + "): their values are the allocator's "
                         "leftovers; the consumers that write into them and read them are compared")
        refused = [s for s in self.statuses if s.status == "refused"]
        lines += [f"  refused: node {s.node!r} ({s.target}){s.source}: {s.reason}" for s in refused[:show]]
        if len(refused) > show:
            lines.append(f"  ... {len(refused) - show} more refused node(s)")
        return lines

    def to_json(self) -> dict:
        return {"tensor_ops": self.tensor_ops, **{s.replace(" ", "_"): self.count(s) for s in STATUSES},
                "sharded": len(self.sharded), "unhandled_targets": dict(self.unhandled_targets()),
                "partial_extremum_strategies_left_out": sum(s.partial for s in self.statuses),
                "on_demand": self.on_demand,
                "decomposed": [{"node": node, "target": target, "nodes": sum(pieces.values()), "into": dict(pieces)}
                               for (node, target), pieces in self.decompositions().items()],
                "not_decomposed": [{"node": s.node, "target": s.target,
                                    "reason": s.reason.split("not decomposed: ", 1)[1]} for s in self.not_decomposed],
                "uninitialised_not_compared": list(self.uninitialised),
                "refused": [{"node": s.node, "target": s.target, "reason": s.reason, "decomposed_from": s.origin}
                            for s in self.statuses if s.status == "refused"]}
