"""The single-device reference of a plan check: every node's value and gradient, the input and
parameter gradients, in float64, run once per process and recipe and shared by its ranks."""

from __future__ import annotations

import weakref

import torch
from torch import fx

from shardverify.capture.call import called_module
from shardverify.capture.randomness import generator_state
from shardverify.capture.uninitialised import uninitialised_nodes
from shardverify.plan.blame import tapped_edges
from shardverify.plan.recipe import TRACE_LOCK, ModelRecipe, as_float64, traced

__all__ = ["grad_seed", "weights_only", "reference_run", "shared_reference", "loss_output"]


def grad_seed(shape, seed: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + index)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def weights_only(gm: fx.GraphModule) -> frozenset[str]:
    """Nodes whose value depends on no model input: the weights (get_attr) and what is computed
    from them and constants alone (a transposed weight, ``arange``). Neither their values nor
    their gradients are compared node by node: a weight is its own value on every rank, its
    gradient is compared at the weight, and a wrong layout of a transposed weight shows at the
    first node that takes it. Recording them would hold a copy of every weight and, on every
    rank, of every weight gradient again (half the memory of an exported model's check)."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op in ("call_function", "call_method", "call_module")
                                     and all(a.name in found for a in node.all_input_nodes)):
            found.add(node.name)
    return frozenset(found)


def reference_run(recipe: ModelRecipe):
    """Single-device values and gradients of every node (but :func:`weights_only` and the nodes of
    uninitialised memory, whose values are the allocator's leftovers: returned last so the ranks
    skip the same nodes), the inputs and the parameters."""
    gm = traced(recipe)
    for parameter in gm.parameters():   # a planned graph may have run before: its gradients are this run's
        parameter.grad = None
    inputs = [as_float64(x.detach()).clone().requires_grad_(x.is_floating_point()) for x in recipe.inputs]
    values: dict[str, object] = {}
    skipped = weights_only(gm) | uninitialised_nodes(gm)

    tensors: dict[str, torch.Tensor] = {}
    edges = tapped_edges(gm, skipped)
    taps: dict[tuple[str, str], torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def fetch_args_kwargs_from_env(self, n):
            def get(a):
                value = self.env[a]
                if (n.name, a.name) in edges and isinstance(value, torch.Tensor) and value.requires_grad:
                    value = taps[(n.name, a.name)] = value.view_as(value)   # this user's term of a's gradient
                    value.retain_grad()
                return value
            return fx.node.map_arg(n.args, get), fx.node.map_arg(n.kwargs, get)

        def run_node(self, n):
            module = called_module(gm, n)
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: self.env[a])
            with generator_state(n, module, args, kwargs):   # the state every rank's call draws from
                out = super().run_node(n)
            if n.name in skipped:
                return out
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.retain_grad()
                tensors[n.name] = out
            # a copy: a later in-place op (ResNet's `x += residual`, ReLU(inplace=True)) must not
            # change the value this node is compared with
            values[n.name] = _snapshot(out)
            return out

    initial = {name: b.clone() for name, b in gm.named_buffers()}   # batch norm's statistics move
    out_t = loss_output(Recorder(gm).run(*inputs))
    if out_t is not None:
        out_t.backward(grad_seed(out_t.shape, recipe.seed, 0))
    grads: dict = {name: v.grad for name, v in tensors.items() if v.grad is not None}
    grads.update({edge: v.grad for edge, v in taps.items() if v.grad is not None})   # (user, producer) -> term
    params = {name: p.grad for name, p in gm.named_parameters()}
    with torch.no_grad():       # the ranks start from the buffers the reference started from
        for name, b in gm.named_buffers():
            b.copy_(initial[name])
    return gm, values, grads, [x.grad for x in inputs], params, skipped


_SHARED: dict[int, tuple] = {}   # id(recipe) -> (recipe's weak reference, reference_run's result)


def shared_reference(recipe: ModelRecipe) -> tuple:
    """:func:`reference_run` once per process and recipe: the simulated ranks (threads of one
    process, given one recipe) share one single-device run and one traced graph, which each rank
    only reads (its weights are its own leaves, cut from the graph's), instead of a copy each; a
    worker process has its own. Dropped with the recipe."""
    with TRACE_LOCK:   # torch.fx tracing patches nn.Module.__call__ process-wide: one at a time
        key = id(recipe)
        found = _SHARED.get(key)
        if found is None or found[0]() is not recipe:
            found = _SHARED[key] = (weakref.ref(recipe), reference_run(recipe))
            weakref.finalize(recipe, _SHARED.pop, key, None)
        return found[1]


def _snapshot(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    return value


def loss_output(result) -> torch.Tensor | None:
    """The model output backward starts from: its first floating output that needs a gradient
    (a bool mask or integer ids beside it, or as the only output, are compared, never
    differentiated); None when no output has a gradient."""
    items = [result] if isinstance(result, torch.Tensor) else \
        [t for t in (result.values() if isinstance(result, dict) else result) if isinstance(t, torch.Tensor)] \
        if isinstance(result, (tuple, list, dict)) else []
    return next((t for t in items if t.is_floating_point() and t.requires_grad), None)
