"""Run a whole model sharded by a plan on one rank, forward and backward, and compare every
node's output, every output gradient, the input gradients and every parameter gradient with
the single-device model (all in float64, so any difference is a bug, not rounding).

Each node with a strategy: its inputs are resharded as the plan says, the strategy's BEFORE
actions run, post-added operands are held back (zeros passed), the op runs on local shards,
then the AFTER actions and the post-adds; parameters are local shards whose gradient passes
through the strategy's HOOK actions. Generic nodes run on full (replicated) tensors.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import fx

from shardverify.capture.call import as_outputs, call_op, called_module, operand_nodes
from shardverify.capture.randomness import generator_state
from shardverify.collectives.patterns import after_op, apply_grad_hook, before_op
from shardverify.collectives.reshard import apply_reshard
from shardverify.errors import VerificationError
from shardverify.plan.blame import blame_owner, tapped_edges
from shardverify.plan.compare import compare_value, expected_shard, precisions
from shardverify.verify.report import Mismatch
from shardverify.plan.graph import (element_layout, metadata_read, node_layouts, operand_layout, operand_producer,
                                    parameter_names, source_of)
from shardverify.plan.model import Plan
from shardverify.plan.recipe import ModelRecipe
from shardverify.plan.reference import grad_seed, loss_output, shared_reference
from shardverify.sharding.layout import ShapedLayout
from shardverify.sharding.reshard_plan import plan_reshard
from shardverify.sharding.strategy import CommWhere
from shardverify.verify.engine import local_arguments

__all__ = ["NodeFailure", "failed_node", "sharded_forward", "rank_run_plan"]


def _summed(comm, layout, value):
    """A partial local tensor summed over its partial axes (for comparison only)."""
    if isinstance(layout, ShapedLayout) and layout.partial and isinstance(value, torch.Tensor):
        return comm.all_reduce(value.detach().contiguous(), layout.partial, "sum")
    return value


class NodeFailure(VerificationError):
    """A node raised while a rank ran it: the message names the node, its step and its strategy,
    so the report blames it (:func:`failed_node` reads them back from another process's text)."""

    def __init__(self, node: str, order: int, strategy: str, cause: BaseException) -> None:
        self.node, self.order = node, order
        super().__init__(f"node {node!r} (step {order}, {strategy}) raised {type(cause).__name__}: {cause}")


def failed_node(message: str) -> tuple[str, int] | None:
    """(node, step) a :class:`NodeFailure` message names, or None."""
    found = re.search(r"node '([^']+)' \(step (\d+), ", message)
    return (found.group(1), int(found.group(2))) if found else None


def sharded_forward(comm, gm: fx.GraphModule, recipe: ModelRecipe, plan: Plan, on_node=None,
                    unobserved: frozenset[str] = frozenset(), taps: dict | None = None):
    """This rank's forward pass under ``plan``; ``on_node(order, node, out, layout)`` sees each
    op node's local output but those of ``unobserved`` (whose gradients are not kept either);
    ``taps``: (user, producer) edges whose value the user takes as a view of its own, its
    gradient kept (filled in). Returns (env, layouts, param leaves, input leaves, result)."""
    mesh = comm.mesh
    by_name = {n.name: n for n in gm.graph.nodes}
    params = parameter_names(gm)
    env: dict[str, object] = {}
    layouts: dict[str, object] = {}
    # param name -> leaf, layout, order, node
    leaves: dict[str, tuple[torch.Tensor, ShapedLayout | None, int, str]] = {}
    input_leaves = []
    result = None
    for order, item in enumerate(plan.nodes):
        node = by_name[item.node]
        strategy = item.strategy
        steps = {(r.operand, r.producer): r.steps for r in item.reshards}

        def fetch(operand: str, producer: fx.Node, value=None, node=node):
            if value is None:
                value = env[producer.name]
                if taps is not None and (node.name, producer.name) in taps and value.requires_grad:
                    value = taps[(node.name, producer.name)] = value.view_as(value)
                    value.retain_grad()
            return apply_reshard(comm, steps.get((operand, source_of(producer)[0].name), ()), value)

        if node.op == "placeholder" and len(input_leaves) == len(recipe.inputs):
            env[node.name], layouts[node.name] = node.args[0] if node.args else None, None   # an omitted argument's default
            continue
        if node.op == "placeholder":
            leaf = recipe.inputs[len(input_leaves)].detach().clone()
            leaf.requires_grad_(leaf.is_floating_point())
            input_leaves.append(leaf)
            env[node.name], layouts[node.name] = leaf, ShapedLayout.replicated(mesh.shape, tuple(leaf.shape))
            continue
        if node.op == "output":
            def gather(a):
                return fetch(a.name, a) if isinstance(env.get(a.name), torch.Tensor) else env[a.name]
            result = fx.node.map_arg(node.args[0], gather)
            continue
        try:
            if strategy is not None and node.op == "get_attr":   # a weight held in a layout of its own
                layout = node_layouts(node, strategy, mesh)
                name = params[str(node.target)]
                out = _param_leaf(comm, name, gm.get_parameter(name), layout, leaves, order, node.name)
            elif strategy is None:
                out = _run_generic(comm, gm, node, env, fetch, params, leaves, order)
                layout = (ShapedLayout.replicated(mesh.shape, tuple(out.shape)) if isinstance(out, torch.Tensor)
                          else [ShapedLayout.replicated(mesh.shape, tuple(t.shape)) if isinstance(t, torch.Tensor)
                                else None for t in out] if isinstance(out, (tuple, list)) else None)
                element = element_layout(node, layouts)   # a tuple's tensor: as its producer laid it out
                layout = element if element is not None else layout
            else:
                out = _run_strategy(comm, gm, node, strategy, env, fetch, params, leaves, order, item.deferred)
                specs = [ShapedLayout.of_spec(strategy.get_sharding_spec_by_name(d.name), item.deferred)
                         for d in strategy.outputs]
                layout = specs[0] if len(specs) == 1 else specs
        except Exception as exc:  # noqa: BLE001 - any failure is this node's, said with its name
            raise NodeFailure(node.name, order, item.strategy_name, exc) from exc
        env[node.name], layouts[node.name] = out, layout
        if node.name in unobserved:
            continue
        for tensor in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.retain_grad()
        if on_node is not None:
            on_node(order, node, out, layout)
    return env, layouts, leaves, input_leaves, result


def rank_run_plan(comm, recipe: ModelRecipe, plan: Plan) -> list[Mismatch]:
    """The SPMD run of ``plan`` on this rank (module-level so process workers import it)."""
    mesh, rank = comm.mesh, comm.rank
    # torch.fx tracing patches nn.Module.__call__ process-wide: simulated ranks (threads) trace
    # one at a time and start running only when every rank has finished tracing.
    gm, ref_values, ref_grads, ref_input_grads, ref_param_grads, unobserved = shared_reference(recipe)
    comm.barrier()
    found: list[Mismatch] = []
    tolerances = precisions(gm)
    back = tolerances.backward

    def check(order, node, out, layout):
        expected = ref_values[node.name]
        if isinstance(out, torch.Tensor):
            compare_value(found, "forward", order, node.name, "output", rank, _summed(comm, layout, out),
                 expected_shard(layout, expected, mesh, rank), tolerances.of(node.name))
        elif isinstance(out, (tuple, list)):
            for i, (o, lay) in enumerate(zip(out, layout or [None] * len(out))):
                if isinstance(o, torch.Tensor):
                    compare_value(found, "forward", order, node.name, f"output {i}", rank, o,
                         expected_shard(lay, expected[i], mesh, rank), tolerances.of(node.name))

    taps: dict = dict.fromkeys(tapped_edges(gm, unobserved))
    env, layouts, leaves, input_leaves, result = sharded_forward(comm, gm, recipe, plan, check, unobserved, taps)
    # backward would only repeat the forward divergence; every rank skips it or none does (a rank
    # alone in backward would wait in its collectives for the ranks that diverged)
    diverged = comm.all_reduce(torch.tensor([float(bool(found))], dtype=torch.float64), tuple(range(mesh.ndim)))
    if diverged.item() > 0:
        return found
    blamed = _weight_consumers(gm, plan)
    checked: set[str] = set()
    weights = {}   # parameter name -> (order, node blamed, this rank's expected gradient)
    for name, (leaf, layout, order, node_name) in leaves.items():
        expected = ref_param_grads.get(name)
        weights[name] = (*blamed.get(node_name, (order, node_name)),
                         expected_shard(layout, expected, mesh, rank) if expected is not None else None)
        if leaf.requires_grad:
            leaf.register_post_accumulate_grad_hook(functools.partial(
                _check_weight_grad, found, checked, rank, back, name, *weights[name]))
    out_t = loss_output(result)
    if out_t is not None:
        out_t.backward(grad_seed(out_t.shape, recipe.seed, 0))
    by_name = {n.name: n for n in gm.graph.nodes}
    for order, item in enumerate(plan.nodes):
        value = env.get(item.node)
        if by_name[item.node].op == "get_attr":
            continue   # a weight: its gradient is checked below, blamed on the op that reduces it
        if isinstance(value, torch.Tensor) and value.requires_grad and item.node in ref_grads:
            compare_value(found, "backward", order, item.node, "output gradient", rank, value.grad,
                 expected_shard(layouts[item.node], ref_grads[item.node], mesh, rank), back)
    blame_owner(found, gm, plan, taps, layouts, ref_grads, comm, back)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]   # export puts the weights first
    for name, leaf, expected in zip(placeholders, input_leaves, ref_input_grads):
        compare_value(found, "grad", 0, name, f"grad of input {name}", rank, leaf.grad, expected, back)
    for name, (leaf, *_) in leaves.items():
        if name not in checked:    # no gradient reached it (or none was wanted)
            order, node_name, expected = weights[name]
            compare_value(found, "grad", order, node_name, f"grad of {name}", rank, leaf.grad, expected, back)
    return found


def _check_weight_grad(found: list, checked: set, rank: int, tolerance, name: str, order: int, node: str,
                       expected, leaf: torch.Tensor) -> None:
    """Weight ``name``'s gradient compared as soon as backward has summed it (autograd accumulates
    a leaf once per backward, every use included), then freed: the ranks' gradients of a whole
    model are never all held at once, only the one being compared."""
    compare_value(found, "grad", order, node, f"grad of {name}", rank, leaf.grad, expected, tolerance)
    checked.add(name)
    leaf.grad = None


def _weight_consumers(gm: fx.GraphModule, plan: Plan) -> dict[str, tuple[int, str]]:
    """get_attr node -> (order, name) of the first op with a strategy that takes it: the node whose
    declared gradient reduction a wrong weight gradient points at (the get_attr itself runs
    generically and declares nothing)."""
    order = {item.node: i for i, item in enumerate(plan.nodes)}
    chosen = {item.node for item in plan.nodes if item.strategy is not None}
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            users = [u for u in node.users if u.name in chosen]
            if users:
                first = min(users, key=lambda u: order[u.name])
                found[node.name] = (order[first.name], first.name)
    return found


def _param_leaf(comm, qualname: str, full: torch.Tensor, layout: ShapedLayout | None, leaves: dict, order: int,
                node: str) -> torch.Tensor:
    """The rank's leaf of parameter ``qualname`` laid out as ``layout`` (None: whole), one per
    parameter however many nodes take it."""
    if layout is not None and not layout.spec.dim_partition and not layout.partial:
        layout = None          # replicated is whole: the same leaf as a get_attr's
    if qualname in leaves:
        if leaves[qualname][1] != layout:
            raise VerificationError(f"parameter {qualname!r} is used by node {leaves[qualname][3]!r} laid out as "
                                    f"{leaves[qualname][1]} and by node {node!r} as {layout}; shared parameters "
                                    "need one layout")
        return leaves[qualname][0]
    local = full.detach() if layout is None else layout.spec.local_shard(full.detach(), comm.mesh, comm.rank)
    # a view of the shared graph's weight, not a copy: a leaf of its own (its gradient is this
    # rank's) over values no rank writes (an in-place op on a weight that needs a gradient raises)
    leaf = local.detach().requires_grad_(full.requires_grad and full.is_floating_point())
    leaves[qualname] = (leaf, layout, order, node)
    return leaf


def _run_strategy(comm, gm, node, strategy, env, fetch, params, leaves, order, deferred=()):
    module = called_module(gm, node)
    values, late = {}, {}
    for data in strategy.inputs:
        loc = (data.locator.kind, data.locator.key)
        layout = operand_layout(strategy, data.name)
        if data.locator.kind in ("param", "buffer"):
            qualname = f"{node.target}.{data.locator.key}"
            qualname = params.get(qualname, qualname)
            full = gm.get_parameter(qualname) if qualname in params else gm.get_buffer(qualname)
            # a weight is held full; taken as a partial sum, it is zeroed on all but one rank of each group
            whole = ShapedLayout.of_spec(layout.spec)
            tensor = _param_leaf(comm, qualname, full, whole, leaves, order, node.name)
            if layout.partial:
                tensor = apply_reshard(comm, plan_reshard(whole, layout), tensor)
        else:
            tensor = fetch(data.name, operand_producer(node, data.locator))
        # a weight's declared gradient reduction acts on this op's own contribution to its gradient,
        # so it hooks an alias the op alone takes: a weight used twice (GPT-2's tied embedding and
        # LM head) sums two reduced contributions, instead of reducing the sum once per use
        hooks = [a for a in strategy.communication_actions if a.operand == data.name and a.where is CommWhere.HOOK]
        if hooks and tensor.requires_grad:
            tensor = tensor.view_as(tensor)
            for action in hooks:
                tensor.register_hook(lambda g, action=action: apply_grad_hook(comm, action, g))
        values[loc] = before_op(comm, strategy, data.name, tensor, late)
    for loc, arg in operand_nodes(node).items():   # non-tensor graph values (x.shape[0]) as computed
        if loc not in values and not isinstance(env.get(arg.name), torch.Tensor):
            values[loc] = env.get(arg.name)
    values.update(local_arguments(strategy, comm.rank))   # a view's local shape in place of the global one
    outputs = list(as_outputs(node, call_op(node, module, values)))
    # a deferred partial output is reduced by the plan's resharding after this node
    outputs = after_op(comm, strategy, outputs, late, keep_partial=deferred or None)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _run_generic(comm, gm, node, env, fetch, params, leaves, order):
    shape = metadata_read(node)
    if shape is not None:
        return shape                             # x.shape: the global shape, whatever x's layout

    def value(a):
        held = env.get(a.name)
        if isinstance(held, torch.Tensor):
            return fetch(a.name, a)
        if isinstance(held, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in held):
            return type(held)(fetch(f"{a.name}[{i}]", a, t) if isinstance(t, torch.Tensor) else t
                              for i, t in enumerate(held))
        return held

    args = fx.node.map_arg(node.args, value)
    kwargs = fx.node.map_arg(node.kwargs, value)
    if node.op == "get_attr":
        if node.target in params:   # a parameter: one leaf per parameter, whatever name reaches it
            name = params[node.target]
            return _param_leaf(comm, name, gm.get_parameter(name), None, leaves, order, node.name)
        return functools.reduce(getattr, str(node.target).split("."), gm)
    module = called_module(gm, node)
    with generator_state(node, module, args, kwargs):   # as the reference draws
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        tensors = {}
        for name, p in module.named_parameters():
            qualname = f"{node.target}.{name}"
            tensors[name] = _param_leaf(comm, params.get(qualname, qualname), p, None, leaves, order, node.name)
        tensors.update(dict(module.named_buffers()))
        return torch.func.functional_call(module, tensors, args, kwargs)
