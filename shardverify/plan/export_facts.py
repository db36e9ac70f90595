"""What a plan's export to PyTorch ParallelStyles needs to know of the captured graph, as frozen data
kept with the plan's result: which node is a model input, a weight or an op; which of an op's operands
is which parameter of the model (by its own name, as ``parallelize_module`` names modules); what kind
of layer owns it (only ``nn.Linear`` and ``nn.Embedding`` take ColwiseParallel and RowwiseParallel, a
norm SequenceParallel); and whether the op takes shape arguments (a plain tensor op keeps the global
sizes the graph recorded, which a rank's local shard does not have)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

__all__ = ["NodeFacts", "facts_of", "LINEAR", "EMBEDDING", "NORM", "OTHER"]

LINEAR, EMBEDDING, NORM, OTHER = "linear", "embedding", "norm", "other"

_FUNCTIONS = {LINEAR: ("aten.linear.default", "torch._C._nn.linear", "torch.nn.functional.linear"),
              EMBEDDING: ("aten.embedding.default", "torch.nn.functional.embedding"),
              NORM: ("aten.layer_norm.default", "aten.rms_norm.default", "torch.nn.functional.layer_norm",
                     "torch.nn.functional.rms_norm")}


@dataclass(frozen=True)
class NodeFacts:
    """One node of the captured graph. ``kind``: input, weight, constant, call or output; ``op``: the
    layer kind of the call (linear, embedding, norm, other); ``params``: (operand locator kind, key,
    parameter name in the model) for each operand that is a parameter; ``module``/``module_kind``: the
    layer owning those parameters and its kind (by its class: an ``F.linear`` in a custom module is
    ``other``); ``normalized``: a norm's trailing normalized dims."""

    name: str
    kind: str
    op: str = OTHER
    target: str = ""
    params: tuple[tuple[str, object, str], ...] = ()
    module: str = ""
    module_kind: str = ""
    module_type: str = ""
    shape_args: bool = False
    normalized: int = 0
    tied: tuple[str, ...] = ()     # its parameters that the model holds under another name too

    def param(self, kind: str, key: object) -> str:
        """The model's name of the parameter at an operand locator, or ""."""
        return next((name for k, found, name in self.params if k == kind and found == key), "")


def _module_kind(module: nn.Module | None) -> str:
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return NORM
    return OTHER


def _target_text(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', str(target))}"


def _shape_args(node: fx.Node) -> bool:
    """The call takes sizes: a list of ints, or a value read from a tensor's metadata (no tensor)."""
    def walk(value, nested: bool) -> bool:
        if isinstance(value, fx.Node):
            return "tensor_meta" not in value.meta and value.op != "get_attr"
        if isinstance(value, (list, tuple)):
            return any(walk(item, True) for item in value)
        if isinstance(value, dict):
            return any(walk(item, True) for item in value.values())
        return nested and isinstance(value, int) and not isinstance(value, bool)

    return any(walk(arg, False) for arg in (*node.args, *node.kwargs.values()))


def facts_of(graph: fx.GraphModule, model: nn.Module) -> tuple[NodeFacts, ...]:
    """Every node of ``graph`` (captured from ``model``, or from it wrapped to take keyword inputs)."""
    from shardverify.plan.inputs import KeywordInputs

    prefix = "model." if isinstance(model, KeywordInputs) else ""
    root = model.model if isinstance(model, KeywordInputs) else model
    named = list(graph.named_parameters(remove_duplicate=False))
    params = {name for name, _ in named}
    shared = Counter(id(p) for _, p in named)

    def own(name: str) -> str:
        return name[len(prefix):] if prefix and name.startswith(prefix) else name

    def owner(name: str) -> tuple[str, nn.Module | None]:
        fqn = own(name).rpartition(".")[0]
        try:
            return fqn, root.get_submodule(fqn)
        except AttributeError:
            return fqn, None

    tied = {own(name) for name, p in named if shared[id(p)] > 1}
    found = []
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            found.append(NodeFacts(node.name, "input" if node.op == "placeholder" else "output"))
            continue
        if node.op == "get_attr":
            found.append(NodeFacts(node.name, "weight" if node.target in params else "constant",
                                   target=own(str(node.target))))
            continue
        facts = _call_facts(node, graph, params, own, owner)
        found.append(replace(facts, tied=tuple(name for _, _, name in facts.params if name in tied)))
    return tuple(found)


def _call_facts(node: fx.Node, graph: fx.GraphModule, params: set[str], own, owner) -> NodeFacts:
    """A call node: its parameters by operand locator, their layer and the layer kind of the call."""
    located: list[tuple[str, object, str]] = []
    normalized = 0
    if node.op == "call_module":
        module = graph.get_submodule(str(node.target))
        located = [("param", key, own(f"{node.target}.{key}")) for key, _ in module.named_parameters(recurse=False)]
        op = _module_kind(module)
        if op == NORM:
            normalized = len(module.normalized_shape)
    else:
        for index, arg in enumerate(node.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in params:
                located.append(("arg", index, own(str(arg.target))))
        text = _target_text(node)
        op = next((kind for kind, names in _FUNCTIONS.items() if text in names), OTHER)
        if op == NORM and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
            normalized = len(node.args[1])
    module_name, module_kind, module_type = "", "", ""
    if located:
        module_name, module = owner(located[0][2])
        module_kind, module_type = _module_kind(module), type(module).__name__ if module is not None else ""
    return NodeFacts(node.name, "call", op, _target_text(node), tuple(located), module_name, module_kind,
                     module_type, _shape_args(node), normalized)
