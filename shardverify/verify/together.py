"""The strategy check with every rank of an even layout checked at once, where one thread holds
every rank of the mesh (``backends.stacked.AllRanks``, the simulated mesh).

On an even layout every rank holds blocks of one shape and issues the same collectives, so most
of the check's steps need not run once per rank: each input is one leaf, the ranks' blocks
stacked on a new leading dim (``layout.stacked_shards``); the declared patterns run once on the
stacked tensors (``backends.stacked.RanksAtOnce``: an all-reduce reduces each group's rows in
group order, so every rank's result is bit-identical to the per-rank check's, and every rank's
communicator counts what its rank issued); the backward pass is one call; every rank's output and
gradients are compared with their bounds in one pass (``compare.rows_within_bounds``); the
declared costs are judged once, as the per-rank check judges ranks that measured alike.  The op
itself is called on each rank's row, through the per-rank check's own entry points: the same
kernel on a block of the same shape and strides computes the same values, so the values compared
are the per-rank check's.

This check only passes strategies.  Where anything is not of that kind (ragged blocks, a pattern
other than the all-reduces, partial max/min inputs, post-added operands, index shards, per-rank
arguments, an undefined output) or anything is wrong (an op that raises, a value out of its
bounds, a count or a declared cost), the per-rank check (``rank.ranks_check``) runs instead, from
fresh counts, and decides, naming the rank, the tensor and the error.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import _engine_run_backward

from shardverify.backends.stacked import RanksAtOnce
from shardverify.capture.call import as_outputs
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.sharding.strategy import CommPattern, CommWhere, ShardingStrategy
from shardverify.spec.case import OpCase
from shardverify.verify import rank as _rank
from shardverify.verify.compare import rows_within_bounds
from shardverify.verify.costs import OpMeter
from shardverify.verify.layout import rank_layouts, stacked_shards
from shardverify.verify.memo import case_table, remembered
from shardverify.verify.rank import (RankReport, _call_signature, _counted, _declared_mismatches, _OutputsState,
                                     _private_module, _reference, check_tolerance, rank_blocks)
from shardverify.verify.rank_inputs import stacked_pieces
from shardverify.verify.tolerance import Tolerance

__all__ = ["rank_check", "ranks_check"]

#: the patterns this check runs, each where it may stand: an output's all-reduce after the op (any
#: reduction), an input's or a parameter's all-reduce of its gradient
_RUNS = {(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, CommWhere.AFTER), (CommPattern.IDENTITY_FWD_ALLREDUCE_BWD,
                                                                      CommWhere.BEFORE),
         (CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, CommWhere.HOOK)}


def rank_check(comm, case: OpCase, strategy: ShardingStrategy, dtype: str | None = None,
               tol: Tolerance | None = None) -> RankReport:
    """The check of ``strategy`` on this rank (``rank.rank_check``), for a backend running each
    rank on its own; module level so process workers import it."""
    return _rank.rank_check(comm, case, strategy, dtype, tol)


def ranks_check(ranks, case: OpCase, strategy: ShardingStrategy, dtype: str | None = None,
                tol: Tolerance | None = None) -> list[RankReport]:
    """``rank.ranks_check`` on every rank ``ranks`` holds: at once where the layout is even and
    the check passes, else rank by rank."""
    fresh = len(ranks.comms) > 1 and not any(comm.counts or comm.traffic for comm in ranks.comms)
    found = _together(ranks, case, strategy, dtype, tol) if fresh else None
    if found is not None:
        return found
    if fresh:   # what the batch counted is forgotten: the per-rank check counts from the start
        for comm in ranks.comms:
            comm.counts.clear()
            comm.traffic.clear()
    return _rank.ranks_check(ranks, case, strategy, dtype, tol)


#: the form of the check over every rank at once, which a backend holding them all runs instead
rank_check.all_ranks = ranks_check   # type: ignore[attr-defined]


def _runs_together(strategy: ShardingStrategy) -> bool:
    """Whether the strategy is of the kind this check runs (see the module's docstring)."""
    return (not strategy.local_args and not strategy.index_shards and not strategy.post_add
            and all((a.pattern, a.where) in _RUNS for a in strategy.communication_actions)
            and all(p.op == "sum" for p in strategy.partial_inputs))


def _together(ranks, case: OpCase, strategy: ShardingStrategy, dtype: str | None,
              tol: Tolerance | None) -> list[RankReport] | None:
    """Every rank's report, where the strategy passes checked at once on ``ranks``' fresh
    communicators; None where the per-rank check must run (it was not of the kind, or something
    is wrong)."""
    comms, mesh = ranks.comms, ranks.mesh
    if not _runs_together(strategy):
        return None
    ref = _reference(case, dtype, comms[0].device)
    node = ref.node
    tally = remembered(_TALLY, id(ref), ref, lambda: [0, 0], limit=64)
    if undefined_outputs(node) or (tally[1] >= 3 and tally[1] > tally[0]):
        return None   # (a case whose results mostly leave their bounds, as float32 ones at larger shapes: each
        #             rank's comparison decides them, so computing them at once first is wasted)
    layouts = rank_layouts(strategy, mesh, tuple(comm.rank for comm in comms))
    if not all(layout.holds_largest for layout in layouts) or [c.rank for c in comms] != list(range(mesh.size)):
        return None   # ragged blocks (every rank holds the largest block: one shape), or not the whole mesh in order
    first, size = layouts[0], len(comms)

    # forward: each input one leaf for all ranks and its BEFORE actions, the op on each rank's row, the AFTER actions
    batch, local, leaves = RanksAtOnce(ranks), [{} for _ in comms], {}
    for position, operand in enumerate(first.inputs):
        data = operand.data
        loc = (data.locator.kind, data.locator.key)
        if loc not in ref.values:
            return None
        partial = strategy.partial_input(data.name)
        blocks = stacked_shards(ref.typed(loc), operand.spec) if partial is None else \
            stacked_pieces(ref, operand, position, mesh, partial.axes, partial.op)
        if blocks is None:   # each rank's piece, as it takes it
            blocks = torch.stack(rank_blocks(ref, strategy, [layout.inputs[position] for layout in layouts], position,
                                             mesh, list(range(size)), copies=False))
        leaf = leaves[data.name] = ref.leaves(loc, [blocks])[0]
        seen = _rank.before_op_on_ranks(batch, strategy, data.name, [leaf], [{}])[0]
        for rank_local, row in zip(local, seen.unbind(0)):
            rank_local[loc] = row
    # each rank's call as on the per-rank path (the same kernels on rows of the same shape and strides:
    # the same values), counted once: every rank's signature is alike
    signature = _call_signature(local[0])
    meter, results = OpMeter(ref.flops), []
    try:
        for comm, rank_local in zip(comms, local):
            module = _private_module(ref, comm.rank) if node.op == "call_module" else None
            result = meter.call_signed(signature, _rank.call_op, node, module, rank_local, owned=module is not None)
            results.append([result] if isinstance(result, torch.Tensor) else list(as_outputs(node, result)))
    except Exception:  # noqa: BLE001 - the per-rank check raises it, naming the rank and what reached the op
        return None
    work = meter.work
    if any(len(outs) != len(first.outputs) for outs in results) or any(
            tuple(out.shape) != operand.local_shape for outs in results for out, operand in zip(outs, first.outputs)):
        return None
    outputs = _rank.after_op_on_ranks(batch, strategy, [[torch.stack(rows) for rows in zip(*results)]], [{}])[0]
    traffic_fwd = dict(comms[0].traffic)

    # what each rank's outputs are, as the per-rank check finds them on rank 0 (every rank's alike)
    rows = [out[0] for out in outputs]
    carrying = [(operand.data, out, row) for operand, out, row, g in zip(first.outputs, outputs, rows, ref.grad_outputs)
                if g is not None and out.requires_grad]
    differentiable = [name for name, leaf in leaves.items() if leaf.requires_grad] if carrying else []
    state = _OutputsState([], [], rows, True, [(data, row) for data, _, row in carrying], differentiable,
                          bool(differentiable))
    tolerance = functools.partial(check_tolerance, case=case, tol=tol, narrowest=ref.narrowest_input)
    device = torch.device(comms[0].device).type
    for index, (operand, out) in enumerate(zip(first.outputs, outputs)):
        want = ref.out_dtypes[index]
        if out.dtype != want or out.device.type != device or not rows_within_bounds(
                out, ref.outputs[index], [layout.outputs[index] for layout in layouts], mesh, tolerance(out.dtype)):
            tally[1] += 1
            return None

    if state.backward_ran:
        grad_outs = [stacked_shards(ref.grad_outputs[k], operand.spec).to(out.dtype)
                     for k, (operand, out) in enumerate(zip(first.outputs, outputs))
                     if any(data is operand.data for data, _, _ in carrying)]
        found = _engine_run_backward(tuple(out for _, out, _ in carrying), tuple(grad_outs), False, False,
                                     tuple(leaves[name] for name in differentiable), True, accumulate_grad=False)
        grads = {name: torch.zeros_like(leaves[name]) if g is None else g for name, g in zip(differentiable, found)}
        for action in strategy.communication_actions:
            if action.where is CommWhere.HOOK and action.operand in grads:
                grads[action.operand] = _rank.grad_hook_on_ranks(batch, action, [grads[action.operand]])[0]
        for position, operand in enumerate(first.inputs):
            data = operand.data
            grad = grads.get(data.name)
            if grad is None:
                continue
            loc = (data.locator.kind, data.locator.key)
            full = ref.grads.get(loc)
            if full is None or grad.dtype != ref.dtypes[loc] or grad.device.type != device or \
                    not rows_within_bounds(grad, full, [layout.inputs[position] for layout in layouts], mesh,
                                           tolerance(grad.dtype)):
                tally[1] += 1
                return None

    uses_declared_dtypes = dtype is None or all(decl.dtype == dtype for decl in case.inputs)
    declared, collectives = _declared_mismatches(comms[0], case, strategy, uses_declared_dtypes, first, state, None, None,
                                                 traffic_fwd, {name: leaf[0] for name, leaf in leaves.items()}, work)
    if declared or any(_counted(comm) != _counted(comms[0]) for comm in comms[1:]):
        return None
    tally[0] += 1
    return [RankReport(comm.rank, (), collectives) for comm in comms]


#: id(reference) -> [checks of its case passed at once, checks handed back at a value out of its bounds]
_TALLY: dict = case_table()
