"""The numerical check of one sharding strategy on one rank, run identically on every rank of
any backend.

Every rank rebuilds the same single-device reference (same seed, values rounded to the
check's dtype and computed in float64), takes the local shards its strategy gives it,
executes exactly the strategy's declared communication actions and nothing else, runs the
op locally, and compares its output shard and every gradient shard with the reference
slice. It also counts the collectives it issued and the bytes it holds, so a strategy whose
declared communication or memory cost disagrees with what it really needs fails too.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
from typing import NamedTuple

import torch
from torch.autograd.graph import _engine_run_backward

from shardverify.errors import VerificationError
from shardverify.sharding.strategy import CommPattern, CommWhere, OperationDataType, ShardingStrategy
from shardverify.spec.case import OpCase
from shardverify.verify.compare import compare_ranks, kind_mismatch
from shardverify.collectives.patterns import (OneRank, after_op_on_ranks, before_op_on_ranks,
                                             grad_hook_on_ranks)
from shardverify.verify.costs import (OpMeter, OpWork, communication_mismatches, compute_mismatches,
                                      memory_mismatches)
from shardverify.verify.layout import LocalOperand, RankLayout, rank_layouts
from shardverify.verify.rank_inputs import extremum_holder, rank_blocks
from shardverify.verify.memo import case_table, recalled, remembered
from shardverify.verify.op_error import OpCallError, op_context
from shardverify.capture.call import as_outputs, call_op
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.verify.reference import Reference, _differentiable, reference
from shardverify.verify.report import Mismatch, output_label
from shardverify.spec.fields import dtype_from_name
from shardverify.verify.tolerance import Tolerance, tolerance_for

__all__ = ["RankReport", "rank_check", "ranks_check", "rank_blocks", "strategy_problems", "local_arguments",
           "check_tolerance"]

_EXACT = Tolerance(0.0, 0.0)
_COUNTED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


class RankReport(NamedTuple):
    """What one rank found: its mismatches and the collectives it issued (kind, axes, count).
    (A named tuple: one per rank of every check, and a frozen dataclass costs 5x as much to make.)"""

    rank: int
    mismatches: tuple[Mismatch, ...]
    collectives: tuple[tuple[str, tuple[int, ...], int], ...]


# ------------------------------------------------------------------ strategy consistency

def strategy_problems(strategy: ShardingStrategy, mesh_ndim: int) -> list[str]:
    """Reasons a strategy cannot even be run (checked once, before any rank starts)."""
    problems = []
    if strategy.operands[-1].type is not OperationDataType.OUTPUT:
        problems.append(f"the last operand {strategy.operands[-1].name!r} is not the output")
    for action in strategy.communication_actions:
        data = strategy.get_op_data_by_name(action.operand)
        found = []
        if any(not 0 <= a < mesh_ndim for a in action.axes):
            found.append(f"mesh axes out of range for a {mesh_ndim}-D mesh")
        if action.where is CommWhere.AFTER and data.type is not OperationDataType.OUTPUT:
            found.append(f"AFTER applies to the output, {action.operand!r} is an input")
        if action.where is CommWhere.BEFORE and data.type is OperationDataType.OUTPUT:
            found.append(f"BEFORE applies to an input, {action.operand!r} is the output")
        if action.where is CommWhere.HOOK and data.type is not OperationDataType.PARAM:
            found.append(f"a gradient HOOK applies to a parameter, {action.operand!r} is not one")
        problems += [f"{action.pattern.name} on {action.operand!r} over mesh axes {action.axes}: {problem}"
                     for problem in found]   # named only when wrong: every check asks
    outputs = strategy.outputs
    for shard in strategy.index_shards:
        table = strategy.get_sharding_spec_by_name(shard.table)
        held = dict(table.dim_partition).get(shard.dim, ())
        if tuple(held) != shard.axes:
            problems.append(f"index shard of {shard.index!r}: {shard.table!r} is laid out {table}, which shards "
                            f"dim {shard.dim} over mesh axes {tuple(held)}, not {shard.axes}")
        if shard.output >= len(outputs):
            problems.append(f"index shard of {shard.index!r} masks output {shard.output}; the op has {len(outputs)}")
    for add in strategy.post_add:
        if not 0 <= add.output < len(outputs):
            problems.append(f"post-add of {add.operand!r} targets output {add.output}; the op has {len(outputs)}")
            continue
        out_rank = len(outputs[add.output].shape)
        if any(d >= out_rank for d in add.dims):
            problems.append(f"post-add of {add.operand!r}: output dims {add.dims} out of range for a "
                            f"{out_rank}-D output")
    return problems


def _format_counts(counts: dict) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{n} x {kind} over axes {axes}" for (kind, axes), n in sorted(counts.items()))


# -------------------------------------------------------------------------- rank check

def rank_check(comm, case: OpCase, strategy: ShardingStrategy, dtype: str | None = None,
               tol: Tolerance | None = None) -> RankReport:
    """The SPMD check of ``strategy`` on this rank (module-level so process workers import it)."""
    return ranks_check(OneRank(comm), case, strategy, dtype, tol)[0]


def ranks_check(ranks, case: OpCase, strategy: ShardingStrategy, dtype: str | None = None,
                tol: Tolerance | None = None) -> list[RankReport]:
    """:func:`rank_check` on every rank ``ranks`` holds: one (a rank thread's or a process's
    communicator, ``OneRank``) or every rank of the mesh in one thread
    (``backends.stacked.AllRanks``): the same steps for each rank, their collectives over all
    of them at once, one backward pass for all."""
    comms, mesh = ranks.comms, ranks.mesh
    befores = [_counted(comm) if comm.counts else None for comm in comms]   # a fresh communicator has issued nothing
    ref = _reference(case, dtype, comms[0].device)
    layouts = rank_layouts(strategy, mesh, tuple(comm.rank for comm in comms))

    tolerance = functools.partial(check_tolerance, case=case, tol=tol, narrowest=ref.narrowest_input)

    traffic_starts = [dict(comm.traffic) if comm.traffic else None for comm in comms]
    leaves, outputs, works = _local_forward(ranks, ref, strategy, layouts)
    traffic_fwds = [dict(comm.traffic) for comm in comms]   # snapshots: plain dicts copy 10x faster than Counters
    undefined = undefined_outputs(ref.node)
    # what each output is checked against, the same on every rank: (index, label, dtype, reference)
    compared_outputs = [(index, output_label(index, len(layouts[0].outputs), operand.data.name), ref.out_dtypes[index],
                         ref.outputs[index]) for index, operand in enumerate(layouts[0].outputs) if index not in undefined]
    states = [_outputs_state(comm, ref, layout, rank_leaves, rank_outputs, compared_outputs)
              for comm, layout, rank_leaves, rank_outputs in zip(comms, layouts, leaves, outputs)]
    running = [i for i, state in enumerate(states) if state.backward_ran]
    if running:
        grads = _local_backward(ranks, ref, strategy, layouts, leaves, states, running)
        # what each gradient is checked against, the same on every rank
        wanted = [(position, operand.data.name, f"grad of {operand.data.name}", ref.dtypes[loc], ref.grads.get(loc),
                   strategy.partial_input(operand.data.name))
                  for position, operand in enumerate(layouts[0].inputs)
                  for loc in [(operand.data.locator.kind, operand.data.locator.key)]]
        for i in running:
            comm, layout, checks, found = comms[i], layouts[i], states[i].checks, grads[i]
            for position, name, label, want_dtype, full, partial in wanted:
                grad = found.get(name)
                if grad is None:
                    continue
                operand = layout.inputs[position]
                holds = None if partial is None or partial.op == "sum" else \
                    extremum_holder(strategy, ref, operand, position, mesh, comm.rank)
                checks.append(_entry(comm, label, grad, want_dtype, full, operand, holds))
    compared = compare_ranks([comm.rank for comm in comms], [state.checks for state in states], mesh, tolerance)
    uses_declared_dtypes = dtype is None or all(decl.dtype == dtype for decl in case.inputs)
    reports: list[RankReport] = []
    seen: list[tuple] = []   # (figures, declared mismatches, collectives) of the ranks reported so far
    for comm, layout, state, before, traffic_start, traffic_fwd, rank_leaves, work, found in zip(
            comms, layouts, states, befores, traffic_starts, traffic_fwds, leaves, works, compared):
        # ranks that measured alike (every rank of an even layout) get the same verdict on what the
        # strategy declares: worked out for the first of them (the figures compare as plain tuples,
        # dicts and named tuples, without a Python-level __eq__)
        figures = None if before is not None or traffic_start is not None else \
            (comm.counts, comm.traffic, traffic_fwd, work, layout.holds_largest, state.shape_ok, state.backward_ran,
             state.differentiable, [d.name for d, _ in state.carrying],
             [t.numel() for t in rank_leaves.values()], [t.numel() for t in state.outputs])
        alike = next((entry for entry in seen if entry[0] == figures), None) if figures else None
        if alike is None:
            declared, collectives = _declared_mismatches(comm, case, strategy, uses_declared_dtypes, layout, state,
                                                         before, traffic_start, traffic_fwd, rank_leaves, work)
            if figures:
                seen.append((figures, declared, collectives))
        else:
            declared = [dataclasses.replace(m, rank=comm.rank) for m in alike[1]]
            collectives = alike[2]
        reports.append(RankReport(comm.rank, tuple(state.found + found + declared), collectives))
    return reports


#: the form of the check over every rank at once, which a backend holding them all runs instead
rank_check.all_ranks = ranks_check   # type: ignore[attr-defined]


class _OutputsState(NamedTuple):
    """A rank's outputs as the check found them: what is wrong so far, what to compare, and
    what its backward pass takes.  (A named tuple: one per rank of every check.)"""

    found: list
    checks: list
    outputs: list
    shape_ok: bool
    carrying: list
    differentiable: list
    backward_ran: bool


def _outputs_state(comm, ref: Reference, layout: RankLayout, leaves: dict, outputs: list,
                   compared_outputs: list[tuple]) -> _OutputsState:
    """``compared_outputs``: (index, label, dtype, reference) of each output the call defines."""
    rank, out_data = comm.rank, layout.outputs
    found: list[Mismatch] = []
    if len(outputs) != len(out_data):
        found.append(Mismatch("shape", rank, "outputs",
                              detail=f"the op returned {len(outputs)} tensor(s), the strategy lays out "
                                     f"{len(out_data)}"))
        outputs = outputs[:len(out_data)]
    shape_ok = len(outputs) == len(out_data)   # else backward cannot run
    checks: list = []   # each output and gradient: a wrong dtype, or what to compare (compare_ranks)
    for index, label, want_dtype, full in compared_outputs:   # an undefined output is never compared
        if index >= len(outputs):
            break
        output, operand = outputs[index], out_data[index]
        checks.append(_entry(comm, label, output, want_dtype, full, operand, None))
        shape_ok = shape_ok and output.shape == operand.local_shape
    carrying = [(operand.data, out) for operand, out, g in zip(out_data, outputs, ref.grad_outputs)
                if g is not None and out.requires_grad]
    differentiable = [n for n, leaf in leaves.items() if leaf.requires_grad] if carrying else []
    return _OutputsState(found, checks, outputs, shape_ok, carrying, differentiable,
                         bool(differentiable and shape_ok))


def _entry(comm, label: str, actual: torch.Tensor, want_dtype: torch.dtype, full, operand: LocalOperand,
           holds) -> tuple | list[Mismatch]:
    """What compare_ranks takes of one output or gradient: its wrong dtype or device
    (kind_mismatch), else what to compare, ``(label, actual, full, operand, holds)`` (the common
    case tested first: kind_mismatch formats what it finds)."""
    if actual.dtype == want_dtype and actual.device == comm.device:   # else kind_mismatch compares device types
        return label, actual, full, operand, holds
    return kind_mismatch(comm.rank, label, actual, want_dtype, comm.device) or (label, actual, full, operand, holds)


def _declared_mismatches(comm, case: OpCase, strategy: ShardingStrategy, uses_declared_dtypes: bool,
                         layout: RankLayout, state: _OutputsState, before: dict | None,
                         traffic_start: dict | None, traffic_fwd: dict, leaves: dict,
                         work: OpWork | None) -> tuple[list[Mismatch], tuple]:
    """The rank's collectives, communication, compute and memory against what the strategy
    declares (the communication cost only where the check ran in the declared dtypes), and the
    collectives it issued ((kind, axes, count), sorted)."""
    rank, found = comm.rank, []
    issued = _counted(comm) if before is None else _since(_counted(comm), before)
    if state.shape_ok:
        differentiable = state.differentiable
        expected = layout.expected_collectives(tuple(differentiable + [d.name for d, _ in state.carrying])
                                               if differentiable else ())
        if issued != expected:
            found.append(Mismatch("collectives", rank, "collectives",
                                  detail=f"issued {_format_counts(issued)}; the declared actions "
                                         f"imply {_format_counts(expected)}"))
        elif uses_declared_dtypes:
            # the declared actions ran as declared, on the declared dtypes: their price is the cost
            backward = _backward_traffic(comm, state, traffic_fwd)
            found += communication_mismatches(strategy, comm.mesh, rank,
                                              traffic_fwd if traffic_start is None else _since(traffic_fwd, traffic_start),
                                              backward, layout.holds_largest)
            if backward == {} and not state.backward_ran:
                found += _inert_gradient_syncs(strategy, rank)
        found += compute_mismatches(strategy, rank, work, layout.holds_largest)
    found += memory_mismatches(strategy, rank, leaves, state.outputs, case, layout)
    return found, tuple((kind, axes, n) for (kind, axes), n in sorted(issued.items()))


def _backward_traffic(comm, state: _OutputsState, traffic_fwd: dict) -> dict | None:
    """What the rank issued in the backward pass; none at all where no output can carry a gradient
    (a comparison's bool), so a strategy declaring a backward cost there is wrong; None (not
    checked) where this check took no gradient of an op that has one (inputs drawn without one)."""
    if state.backward_ran:
        return _since(comm.traffic, traffic_fwd)
    if not any(_differentiable(out.dtype) for out in state.outputs):
        return {}
    return None


def _inert_gradient_syncs(strategy: ShardingStrategy, rank: int) -> list[Mismatch]:
    """A declared all-reduce of a gradient where the op gives none: it never runs, so a plan that
    prices or schedules it is wrong about the strategy."""
    names = [a.operand for a in strategy.communication_actions if a.pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD]
    if not names:
        return []
    return [Mismatch("collectives", rank, "collectives",
                     detail=f"strategy {strategy.name!r} declares a backward all-reduce of the gradient of "
                            f"{', '.join(map(repr, names))}, but no output of the op carries a gradient "
                            f"(none can run)")]


_LAST_REFERENCE = threading.local()


def _reference(case: OpCase, dtype: str | None, device: torch.device) -> Reference:
    """``reference(case, dtype, device)``, with this thread's last answer reused while the
    same case object asks again (every strategy of a batch does): looking it up hashes the
    whole frozen case, which costs more than slicing its values."""
    last = getattr(_LAST_REFERENCE, "entry", None)
    if last is not None and last[0] is case and last[1] == dtype and last[2] == device:
        return last[3]
    ref = reference(case, dtype_from_name(dtype) if dtype is not None else None, torch.device(device))
    _LAST_REFERENCE.entry = (case, dtype, device, ref)
    return ref


def check_tolerance(t: torch.dtype, case: OpCase, tol: Tolerance | None, narrowest: torch.dtype | None) -> Tolerance:
    """The tolerance a result of dtype ``t`` is compared at: integers and bools exactly, whatever a
    spec or caller says; else ``tol``, or the case's, or the default for the precision it is
    computed in (:func:`_computed_in`, ``narrowest``: the case's least precise real input)."""
    if not (t.is_floating_point or t.is_complex):
        return _EXACT
    return tol if tol is not None else _tolerance_for(_computed_in(t, narrowest), case.rtol, case.atol)


def _computed_in(result: torch.dtype, narrowest: torch.dtype | None) -> torch.dtype:
    """The precision a real floating result is computed in: its own, or a less precise input's
    (torch.cov with float32 weights gives float64 computed partly in float32), whose tolerance
    its comparison then takes."""
    if narrowest is None or not result.is_floating_point or torch.finfo(narrowest).eps <= torch.finfo(result).eps:
        return result
    return narrowest


@functools.lru_cache(maxsize=256)
def _tolerance_for(dtype: torch.dtype, rtol: float | None, atol: float | None) -> Tolerance:
    return tolerance_for(dtype, rtol, atol)


def _since(now: dict, then: dict) -> dict:
    """What was issued between two snapshots of a count (as ``Counter`` subtraction: positive counts only)."""
    return {key: n - then.get(key, 0) for key, n in now.items() if n > then.get(key, 0)}


def _counted(comm) -> dict:
    """(kind, axes) -> number of the collectives ``comm`` issued (a plain dict: the check takes
    two per rank, and a Counter costs several times as much to build)."""
    return {key: n for key, n in comm.counts.items() if n and key[0] in _COUNTED}


def _local_forward(ranks, ref: Reference, strategy: ShardingStrategy,
                   layouts: list[RankLayout]) -> tuple[list[dict], list[list], list[OpWork | None]]:
    """Each rank's operand shards as leaves, the BEFORE actions, the op (post-added operands
    replaced by zeros; its work measured), the AFTER actions, then the post-added operands."""
    comms, node = ranks.comms, ref.node
    modules = [_private_module(ref, comm.rank) if node.op == "call_module" else None for comm in comms]
    leaves: list[dict] = [{} for _ in comms]
    local: list[dict] = [{} for _ in comms]
    late: list[dict] = [{} for _ in comms]
    for position, first in enumerate(layouts[0].inputs):
        data = first.data
        loc = (data.locator.kind, data.locator.key)
        if loc not in ref.values:
            raise VerificationError(f"operand {data.name!r} sits at {loc[0]} {loc[1]!r}, which node "
                                    f"{node.name!r} does not have")
        blocks = rank_blocks(ref, strategy, [layout.inputs[position] for layout in layouts], position, ranks.mesh,
                             [comm.rank for comm in comms])
        for rank_leaves, leaf in zip(leaves, ref.leaves(loc, blocks)):
            rank_leaves[data.name] = leaf
        seen = before_op_on_ranks(ranks, strategy, data.name, [rank_leaves[data.name] for rank_leaves in leaves], late)
        for rank_local, tensor in zip(local, seen):
            rank_local[loc] = tensor
    outputs, works = [], []
    undefined = undefined_outputs(node)
    meter = OpMeter(ref.flops)
    for comm, layout, rank_leaves, rank_local, module in zip(comms, layouts, leaves, local, modules):
        if strategy.local_args:
            rank_local.update(local_arguments(strategy, comm.rank))
        try:
            result = meter.call_signed(_call_signature(rank_local), call_op, node, module, rank_local,
                                       owned=module is not None)
            rank_outputs = [result] if isinstance(result, torch.Tensor) else list(as_outputs(node, result))
        except Exception as exc:  # noqa: BLE001 - re-raised with what reached the op
            raise OpCallError(op_context(comm, node, strategy, rank_leaves, rank_local, exc), comm.rank) from exc
        # an output the op leaves undefined stands as zeros of the local shape its layout gives (the meta
        # kernel's, which the strategy is derived from), so its actions and costs run as declared
        for index in undefined:
            if index < min(len(rank_outputs), len(layout.outputs)):
                rank_outputs[index] = torch.zeros(layout.outputs[index].local_shape, dtype=rank_outputs[index].dtype,
                                                  device=rank_outputs[index].device)
        outputs.append(rank_outputs)
        works.append(meter.work)
    return leaves, after_op_on_ranks(ranks, strategy, outputs, late), works


def _call_signature(local: dict) -> tuple:
    """Besides the node (its op and recorded non-tensor arguments), what the op's FLOP count
    depends on: grad mode, the shape, stride, dtype, device and grad requirement of every
    tensor reaching it, and the non-tensor arguments a strategy passes instead (a view's local
    shape)."""
    return (torch.is_grad_enabled(),
            tuple([(loc, t.shape, t.stride(), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
                   else (loc, _hashable(t)) for loc, t in local.items()]))


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def local_arguments(strategy: ShardingStrategy, rank: int) -> dict:
    """Locator -> value of the non-tensor arguments ``rank`` passes in place of the recorded
    ones (a view's local shape, its own where blocks are uneven), in the form ``call_op`` takes."""
    return {(arg.locator.kind, arg.locator.key): arg.value_on(rank) for arg in strategy.local_args}


_OWN = threading.local()


def _private_module(ref: Reference, rank: int) -> torch.nn.Module:
    """This thread's own copy of the op's module for ``rank`` (one per reference, thread and
    rank, reused by every strategy): ``call_op`` swaps the rank's shards into it, so no two
    ranks may share one.  A case table of this thread's (memo.py), emptied when the others are."""
    cache = getattr(_OWN, "modules", None)
    if cache is None:
        cache = _OWN.modules = case_table()
    return remembered(cache, (id(ref), rank), ref,
                      lambda: copy.deepcopy(ref.graph_module.get_submodule(ref.node.target)), limit=64)


def _local_backward(ranks, ref: Reference, strategy: ShardingStrategy, layouts: list[RankLayout],
                    leaves: list[dict], states: list[_OutputsState], running: list[int]) -> dict[int, dict]:
    """Gradients of the leaves of each rank in ``running`` for the reference output gradients
    (sharded like the outputs), in one backward pass, with the HOOK actions applied to the
    parameter gradients: {rank index: {operand name: gradient}}."""
    comms = ranks.comms
    outs, grad_outs, wanted = [], [], []
    index = {operand.data.name: k for k, operand in enumerate(layouts[0].outputs)}   # every rank's alike
    for i in running:
        comm, layout, state = comms[i], layouts[i], states[i]
        for data, output in state.carrying:
            k = index[data.name]
            outs.append(output)
            grad_outs.append(_grad_output(ref.grad_outputs[k], layout.outputs[k], comm.mesh, comm.rank, output.dtype))
        wanted += [(i, n) for n in state.differentiable]
    # autograd.grad less its Python checks (a third of its cost on a small op): the gradients are
    # plain tensors of the outputs' dtypes, and the engine still refuses one of the wrong shape
    found = _engine_run_backward(tuple(outs), tuple(grad_outs), False, False,
                                 tuple(leaves[i][n] for i, n in wanted), True, accumulate_grad=False)
    grads: dict[int, dict] = {i: {} for i in running}
    for (i, n), g in zip(wanted, found):
        grads[i][n] = torch.zeros_like(leaves[i][n]) if g is None else g
    for action in strategy.communication_actions:
        if action.where is CommWhere.HOOK and all(action.operand in grads[i] for i in running):
            hooked = grad_hook_on_ranks(ranks, action, [grads[i][action.operand] for i in running]) \
                if len(running) == len(comms) else None
            if hooked is None:
                raise VerificationError(f"{action.pattern.name} on {action.operand!r}: the gradient hook needs "
                                        f"every rank's backward pass, ranks {[comms[i].rank for i in running]} ran it")
            for i, g in zip(running, hooked):
                grads[i][action.operand] = g
    return grads


_GRAD_OUTPUTS: dict = case_table()


def _grad_output(full: torch.Tensor, operand: LocalOperand, mesh, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of the reference output gradient ``full`` laid out as ``operand``, in
    ``dtype``: remembered per (tensor, layout, rank, dtype), so the strategies of a case laying
    an output out alike share one slice and cast (read only: autograd never writes to it)."""
    key = (id(full), operand.spec.key, rank, dtype)
    found = recalled(_GRAD_OUTPUTS, key, full)
    if found is None:
        found = remembered(_GRAD_OUTPUTS, key, full, lambda: operand.shard(full, mesh, rank).to(dtype), limit=8192)
    return found
