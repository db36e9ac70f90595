"""What a plan check runs: a model and its example inputs as a picklable recipe, captured in
float64 by fx or export, and the graph the plan was made on: ranks in this process run that very
graph (the model is captured once); a worker process, to which an exported graph does not pickle
(its ATen targets), captures the model again and refuses a graph whose nodes are not the planned
graph's, so the graph planned is always the graph checked."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch
from torch import fx

from shardverify.capture.decompose import decompose_unserved
from shardverify.capture.export import export_graph
from shardverify.capture.fx import forward_names, trace
from shardverify.errors import InvalidArgument, VerificationError
from shardverify.plan.coverage import unserved

__all__ = ["CAPTURES", "ModelRecipe", "as_float64", "traced", "float64_copy", "TRACE_LOCK"]

#: torch.fx tracing patches nn.Module.__call__ process-wide: one capture at a time
TRACE_LOCK = threading.Lock()


#: how a model is captured: torch.export's ATen graph, or torch.fx symbolic tracing (torch-level
#: calls, the reference strategy names of the seed ops)
CAPTURES = ("export", "fx")


@dataclass(frozen=True)
class ModelRecipe:
    """The model and example inputs (picklable: sent to worker processes). Floating inputs run
    in float64; other inputs (token ids) keep their dtype. Rank code only reads it (it runs a
    float64 copy of the module and clones of the inputs), so the simulated ranks share one
    (``ranks_only_read``) and with it one single-device reference (:func:`shared_reference`)."""

    ranks_only_read = True    # a class attribute, not a field

    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    seed: int = 0
    capture: str = "fx"
    #: the float64 graph the plan was made on (capture_model's), run as it is in this process
    graph: fx.GraphModule | None = field(default=None, compare=False, repr=False)
    #: its node names, in order: what a worker's own capture must give
    nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.capture not in CAPTURES:
            raise InvalidArgument(f"capture must be one of {', '.join(CAPTURES)}, got {self.capture!r}")
        if self.graph is not None and not self.nodes:
            object.__setattr__(self, "nodes", tuple(node.name for node in self.graph.graph.nodes))

    def __reduce__(self):
        """To a worker without the planned graph (it captures the model again, checked against
        ``nodes``). A GraphModule model travels as its graph and the attributes its nodes name:
        pickling a GraphModule itself regenerates it from its code, which drops unused nodes and
        can rename the others."""
        if isinstance(self.module, fx.GraphModule):
            return _graph_recipe, (_graph_attributes(self.module), self.module.graph, self.inputs, self.seed,
                                   self.capture, self.nodes)
        return _recipe, (self.module, self.inputs, self.seed, self.capture, self.nodes)


def _recipe(module, inputs, seed: int, capture: str, nodes: tuple[str, ...]) -> ModelRecipe:
    return ModelRecipe(module, inputs, seed, capture, None, nodes)


def _graph_attributes(graph_module: fx.GraphModule) -> dict[str, object]:
    """Every submodule, parameter or buffer a node of the graph names, by its qualified name."""
    found: dict[str, object] = {}
    for node in graph_module.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            owner, _, attr = target.rpartition(".")
            found[target] = getattr(graph_module.get_submodule(owner) if owner else graph_module, attr)
    return found


def _graph_recipe(attributes: dict, graph: fx.Graph, inputs, seed: int, capture: str,
                  nodes: tuple[str, ...] = ()) -> ModelRecipe:
    return ModelRecipe(fx.GraphModule(attributes, graph), inputs, seed, capture, None, nodes)


def as_float64(x: torch.Tensor) -> torch.Tensor:
    """A floating input in float64 (the plan check compares in float64); any other as it is."""
    return x.to(torch.float64) if x.is_floating_point() else x


def traced(recipe: ModelRecipe) -> fx.GraphModule:
    """The recipe's float64 graph: the planned graph itself, or the module captured now (and then,
    when the recipe names the planned graph's nodes, refused unless it has those nodes)."""
    if recipe.graph is not None:
        return recipe.graph
    module = float64_copy(recipe.module)
    inputs = [as_float64(x) for x in recipe.inputs]
    if recipe.capture == "export":
        graph = export_graph(module, inputs)
    else:
        graph = trace(module, dict(zip(forward_names(module, len(inputs)), inputs)))
    graph = decompose_unserved(graph, lambda node: unserved(node, graph))   # into ops that are served
    names = tuple(node.name for node in graph.graph.nodes)
    if recipe.nodes and names != recipe.nodes:
        other = sorted(set(recipe.nodes) ^ set(names))[:5]
        raise VerificationError(f"this rank's {recipe.capture} capture of {type(recipe.module).__name__} is not the "
                                f"graph the plan was made on ({len(names)} nodes against {len(recipe.nodes)}; "
                                f"differing: {other or 'their order'})")
    return graph


def float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with floating parameters and buffers in float64, each copied once straight
    into float64 (``deepcopy(m).double()`` holds a float32 copy of the whole model first)."""
    memo: dict[int, object] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in memo:
            continue
        value = tensor.detach().to(torch.float64, copy=True) if tensor.is_floating_point() else tensor.detach().clone()
        memo[id(tensor)] = torch.nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) \
            else value
    return copy.deepcopy(module, memo).double()

