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

The op is measured on what it sees, not on the blocks the layouts give: a rank's operands after
their BEFORE actions (gathered, split, exchanged or reduced over every rank's blocks, by the same
collectives the check runs: collectives.patterns.before_op_on_ranks over backends.stacked's
AllRanks), zeros for an operand added after the op, ids shifted into the rank's index shard (and
the outputs of ids it does not hold zeroed, as the check does after the op). Its error is
measured against the same numbers widened, so the rounding of a reduction before the op is the
strategy's, bounded by BUDGET_FACTOR like one after it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from shardverify.backends.stacked import AllRanks
from shardverify.capture.call import as_outputs, call_op, called_module
from shardverify.capture.randomness import may_draw
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.collectives.patterns import before_op_on_ranks, zero_outside_index_shards
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import CommWhere, ShardingStrategy
from shardverify.spec.case import OpCase, cached
from shardverify.verify.layout import RankLayout, rank_layout
from shardverify.verify.rank import local_arguments
from shardverify.verify.rank_inputs import rank_blocks
from shardverify.verify.reference import Reference, reference
from shardverify.verify.report import output_label
from shardverify.verify.tolerance import own_error

__all__ = ["rank_local_errors"]

_LOCK = threading.Lock()
_ERRORS: dict = {}


def rank_local_errors(case: OpCase, strategy: ShardingStrategy, dtype: torch.dtype,
                      enough: Callable[[dict[str, float]], bool] | None = None,
                      labels: frozenset[str] | None = None) -> dict[str, float] | None:
    """{label ("output", "grad of weight"): the largest own error (tolerance.own_error), over the
    ranks, of the op run in ``dtype`` on what a rank's op sees (module docstring) against the same call
    on those numbers in float64}; None for a strategy whose local call raises (no rank would pass).
    ``enough``: said of the errors so far, ends the ranks early (a check they already cover is
    covered by the errors of all: each rank only raises them); ``labels``: only these measured
    (None: all), a check's tensors over the single-device budget."""
    mesh = DeviceMesh(strategy.output_sharding_spec.mesh_shape)
    ref = reference(case, dtype, torch.device("cpu"))
    errors: dict[str, float] = {}
    views: dict = {}   # every rank's view of each input, made once per call when a rank is measured
    before = tuple(a for a in strategy.communication_actions if a.where is CommWhere.BEFORE)
    for rank in range(math.prod(mesh.shape)):
        layout = rank_layout(strategy, mesh, rank)
        key = (case, dtype, rank, tuple((o.spec, strategy.partial_input(o.data.name),
                                         strategy.post_added(o.data.name) is not None) for o in layout.inputs),
               tuple(o.spec for o in layout.outputs), before, strategy.index_shards,
               tuple((a.locator, repr(a.value_on(rank))) for a in strategy.local_args), labels)
        with _LOCK:
            found = cached(_ERRORS, key, lambda: _measure(ref, strategy, layout, labels, views))
        if found is None:
            return None
        for label, error in found.items():
            errors[label] = max(errors.get(label, 0.0), error)
        if enough is not None and enough(errors):
            break
    return errors


def _seen(ref: Reference, strategy: ShardingStrategy, mesh: DeviceMesh, position: int,
          views: dict) -> tuple[list[torch.Tensor], list[dict]]:
    """Every rank's view of input ``position`` as its op receives it (module docstring), and what
    each rank's BEFORE step kept for after the op (the index shard's mask), made once per call."""
    if position not in views:
        ranks = range(math.prod(mesh.shape))
        operands = [rank_layout(strategy, mesh, rank).inputs[position] for rank in ranks]
        blocks = rank_blocks(ref, strategy, operands, position, mesh, list(ranks))
        lates: list[dict] = [{} for _ in ranks]
        with torch.no_grad():
            seen = before_op_on_ranks(AllRanks(mesh), strategy, operands[0].data.name, blocks, lates)
        views[position] = ([t.detach() for t in seen], lates)
    return views[position]


def _operands(ref: Reference, strategy: ShardingStrategy, layout: RankLayout,
              views: dict) -> tuple[dict, dict, dict]:
    """The rank's operands as its op receives them, in the check's dtypes and the same numbers in
    float64 (non-floating ones alike in both), each a leaf where the op gives a gradient, and what
    its BEFORE steps kept for after the op."""
    mesh, rank = layout.mesh, layout.rank
    low, high, late = {}, {}, {}
    for position, operand in enumerate(layout.inputs):
        data = operand.data
        loc = (data.locator.kind, data.locator.key)
        seen, lates = _seen(ref, strategy, mesh, position, views)
        block = seen[rank].clone()
        late.update(lates[rank])
        wide = block.to(torch.complex128 if block.is_complex() else torch.float64, copy=True) \
            if block.is_floating_point() or block.is_complex() else block
        low[loc], high[loc] = ref.leaf(loc, block), ref.leaf(loc, wide)
    args = local_arguments(strategy, rank)
    low.update(args)
    high.update(args)
    return low, high, late


def _masked(strategy: ShardingStrategy, outputs: tuple, late: dict) -> list:
    """The op's outputs with those of ids outside the rank's index shard zeroed, as the check
    zeroes them after the op."""
    outputs = list(outputs)
    zero_outside_index_shards(strategy, outputs, late)
    return outputs


def _measure(ref: Reference, strategy: ShardingStrategy, layout: RankLayout,
             labels: frozenset[str] | None, views: dict) -> dict[str, float] | None:
    node = ref.node
    module = called_module(ref.graph_module, node)
    if may_draw(node, module):   # float64 draws other numbers: no rounding of its own to measure
        return None
    try:
        low, high, late = _operands(ref, strategy, layout, views)
        outs_low = _masked(strategy, as_outputs(node, call_op(node, module, low)), late)
        outs_high = _masked(strategy, as_outputs(node, call_op(node, module, high)), late)
    except Exception:  # noqa: BLE001 - a call the rank cannot make either: nothing measured here (the
        return None    # single-device budget alone judges)
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
