"""The op's own low-precision error at the shapes each rank computes it.

A float32 kernel's accumulation order depends on the shapes it is given: on this CPU (MKL) a
(32768 x 32)^T x (32768 x 16) product is summed in blocks, its 32768 x 8 half of the same
product sequentially, with 13x the error (exactly the error of a plain running sum). A strategy
that shards the other dim hands each rank the narrow product, so the single-device op at the
full shapes is no yardstick for it: the rank's op is as correct, only ordered otherwise. So a
check over the single-device budget is held to the worse of that and the error of the op run,
on one device, on each rank's own operands (its block, its piece of a partial input, zeros for
an operand added after the op, its local arguments) against the same call in float64: the
precision the op computes in at the shapes the strategy computes it. What the strategy adds
after the op (its partial results rounded and reduced, in whatever dtype it reduces them) is
not in it, and is what BUDGET_FACTOR bounds.

Ranks whose operands reach the op through a collective (a BEFORE action that gathers, reduces,
splits or exchanges; one that only all-reduces the gradient in backward leaves the op's view as
is) or shifted into an index shard see other blocks than their layouts give; for those
strategies nothing is measured here and the single-device budget alone applies.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from shardverify.capture.call import as_outputs, call_op
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import CommPattern, CommWhere, ShardingStrategy
from shardverify.spec.case import OpCase, cached
from shardverify.verify.layout import RankLayout, rank_layout
from shardverify.verify.rank import local_arguments, rank_block
from shardverify.verify.reference import Reference, reference
from shardverify.verify.report import output_label
from shardverify.verify.tolerance import own_error

__all__ = ["rank_local_errors", "measurable"]

_LOCK = threading.Lock()
_ERRORS: dict = {}


def measurable(strategy: ShardingStrategy) -> bool:
    """Whether every rank's op sees its operands as their layouts give them (no BEFORE action but
    one whose forward half is the identity, no index shard), so the op can be run on them alone."""
    return not strategy.index_shards and all(a.where is not CommWhere.BEFORE or
                                             a.pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD
                                             for a in strategy.communication_actions)


def rank_local_errors(case: OpCase, strategy: ShardingStrategy, dtype: torch.dtype,
                      enough: Callable[[dict[str, float]], bool] | None = None,
                      labels: frozenset[str] | None = None) -> dict[str, float] | None:
    """{label ("output", "grad of weight"): the largest own error (tolerance.own_error), over the
    ranks, of the op run in ``dtype`` on a rank's own operands against the same call in float64}; None for a
    strategy that is not :func:`measurable`, or whose local call raises (no rank would pass).
    ``enough``: said of the errors so far, ends the ranks early (a check they already cover is
    covered by the errors of all: each rank only raises them); ``labels``: only these measured
    (None: all), a check's tensors over the single-device budget."""
    if not measurable(strategy):
        return None
    mesh = DeviceMesh(strategy.output_sharding_spec.mesh_shape)
    ref = reference(case, dtype, torch.device("cpu"))
    errors: dict[str, float] = {}
    for rank in range(math.prod(mesh.shape)):
        layout = rank_layout(strategy, mesh, rank)
        key = (case, dtype, rank, tuple((o.spec, strategy.partial_input(o.data.name),
                                         strategy.post_added(o.data.name) is not None) for o in layout.inputs),
               tuple(o.spec for o in layout.outputs),
               tuple((a.locator, repr(a.value_on(rank))) for a in strategy.local_args), labels)
        with _LOCK:
            found = cached(_ERRORS, key, lambda: _measure(ref, strategy, layout, labels))
        if found is None:
            return None
        for label, error in found.items():
            errors[label] = max(errors.get(label, 0.0), error)
        if enough is not None and enough(errors):
            break
    return errors


def _operands(ref: Reference, strategy: ShardingStrategy, layout: RankLayout) -> tuple[dict, dict]:
    """The rank's operands as its op receives them, in the check's dtypes and the same numbers in
    float64 (non-floating ones alike in both), each a leaf where the op gives a gradient."""
    mesh, rank = layout.mesh, layout.rank
    low, high = {}, {}
    for position, operand in enumerate(layout.inputs):
        data = operand.data
        loc = (data.locator.kind, data.locator.key)
        block = rank_block(ref, strategy, operand, position, mesh, rank)   # what the check's rank holds
        if strategy.post_added(data.name) is not None:   # added after the op: the op sees zeros
            block = torch.zeros_like(block)
        wide = block.to(torch.complex128 if block.is_complex() else torch.float64, copy=True) \
            if block.is_floating_point() or block.is_complex() else block
        low[loc], high[loc] = ref.leaf(loc, block), ref.leaf(loc, wide)
    args = local_arguments(strategy, rank)
    low.update(args)
    high.update(args)
    return low, high


def _measure(ref: Reference, strategy: ShardingStrategy, layout: RankLayout,
             labels: frozenset[str] | None) -> dict[str, float] | None:
    node = ref.node
    module = ref.graph_module.get_submodule(node.target) if node.op == "call_module" else None
    try:
        low, high = _operands(ref, strategy, layout)
        outs_low = as_outputs(node, call_op(node, module, low))
        outs_high = as_outputs(node, call_op(node, module, high))
    except Exception:  # noqa: BLE001 - a call the rank cannot make either: nothing measured here (the
        return None    # single-device budget alone judges, as for a strategy not measurable)
    outputs = layout.outputs
    undefined = undefined_outputs(node)
    found = {}
    for index, (operand, a, b) in enumerate(zip(outputs, outs_low, outs_high)):
        label = output_label(index, len(outputs), operand.data.name)
        if index not in undefined and (labels is None or label in labels):
            found[label] = own_error(a, b)
    grads = []   # (low output, high output, the rank's slice of the output gradient) per carrying output
    for index, (operand, a, b, g) in enumerate(zip(outputs, outs_low, outs_high, ref.grad_outputs)):
        if g is None or index in undefined or not (a.requires_grad and b.requires_grad):
            continue
        g = operand.shard(g, layout.mesh, layout.rank)
        if tuple(g.shape) != tuple(a.shape):
            return found   # an output of another shape than its layout's: no gradient to measure
        grads.append((a, b, g))
    wanted = [(o.data, loc) for o in layout.inputs
              for loc in [(o.data.locator.kind, o.data.locator.key)]
              if low[loc].requires_grad and (labels is None or f"grad of {o.data.name}" in labels)]
    if not grads or not wanted:
        return found
    got_low = torch.autograd.grad([a for a, _, _ in grads], [low[loc] for _, loc in wanted],
                                  [g.to(a.dtype) for a, _, g in grads], allow_unused=True)
    got_high = torch.autograd.grad([b for _, b, _ in grads], [high[loc] for _, loc in wanted],
                                   [g.to(b.dtype) for _, b, g in grads], allow_unused=True)
    for (data, loc), a, b in zip(wanted, got_low, got_high):
        if a is not None and b is not None:
            found[f"grad of {data.name}"] = own_error(a, b)
    return found
