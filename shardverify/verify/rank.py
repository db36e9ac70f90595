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
import functools
import math
import threading
from collections import Counter
from dataclasses import dataclass

import torch
from torch.autograd.graph import _engine_run_backward

from shardverify.errors import VerificationError
from shardverify.sharding.pieces import partial_pieces
from shardverify.sharding.strategy import CommWhere, OperationDataType, ShardingStrategy
from shardverify.spec.case import OpCase
from shardverify.verify.compare import compare_all, kind_mismatch
from shardverify.verify.costs import (OpMeter, OpWork, communication_mismatches, compute_mismatches,
                                      memory_mismatches)
from shardverify.verify.layout import LocalOperand, RankLayout, rank_layout
from shardverify.verify.memo import remembered
from shardverify.capture.call import as_outputs, call_op
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.verify.reference import Reference, reference
from shardverify.verify.report import Mismatch
from shardverify.spec.fields import dtype_from_name
from shardverify.verify.tolerance import Tolerance, tolerance_for

__all__ = ["RankReport", "OpCallError", "rank_check", "strategy_problems", "local_arguments"]

_EXACT = Tolerance(0.0, 0.0)
_COUNTED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


@dataclass(frozen=True)
class RankReport:
    """What one rank found: its mismatches and the collectives it issued (kind, axes, count)."""

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
        what = f"{action.pattern.name} on {action.operand!r} over mesh axes {action.axes}"
        if any(not 0 <= a < mesh_ndim for a in action.axes):
            problems.append(f"{what}: mesh axes out of range for a {mesh_ndim}-D mesh")
        if action.where is CommWhere.AFTER and data.type is not OperationDataType.OUTPUT:
            problems.append(f"{what}: AFTER applies to the output, {action.operand!r} is an input")
        if action.where is CommWhere.BEFORE and data.type is OperationDataType.OUTPUT:
            problems.append(f"{what}: BEFORE applies to an input, {action.operand!r} is the output")
        if action.where is CommWhere.HOOK and data.type is not OperationDataType.PARAM:
            problems.append(f"{what}: a gradient HOOK applies to a parameter, {action.operand!r} is not one")
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


def _format_counts(counts: Counter) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{n} x {kind} over axes {axes}" for (kind, axes), n in sorted(counts.items()))


# -------------------------------------------------------------------------- rank check

def rank_check(comm, case: OpCase, strategy: ShardingStrategy, dtype: str | None = None,
               tol: Tolerance | None = None) -> RankReport:
    """The SPMD check of ``strategy`` on this rank (module-level so process workers import it)."""
    mesh, rank = comm.mesh, comm.rank
    before = _counted(comm) if comm.counts else None   # a fresh communicator has issued nothing
    ref = _reference(case, dtype, comm.device)
    layout = rank_layout(strategy, mesh, rank)

    def tolerance(t: torch.dtype) -> Tolerance:   # integers and bools exactly, whatever a spec or caller says
        exact = not (t.is_floating_point or t.is_complex)
        return _EXACT if exact else tol if tol is not None else _tolerance_for(t, case.rtol, case.atol)

    traffic_start = Counter(comm.traffic) if comm.traffic else None
    leaves, outputs, work = _local_forward(comm, ref, strategy, layout)
    traffic_fwd = Counter(comm.traffic)
    out_data = layout.outputs
    found: list[Mismatch] = []
    if len(outputs) != len(out_data):
        found.append(Mismatch("shape", rank, "outputs",
                              detail=f"the op returned {len(outputs)} tensor(s), the strategy lays out "
                                     f"{len(out_data)}"))
        outputs = outputs[:len(out_data)]
    shape_ok = len(outputs) == len(out_data)   # else backward cannot run
    checks: list = []   # each output and gradient: a wrong dtype, or what to compare (compare_all)
    for index, (operand, output) in enumerate(zip(out_data, outputs)):
        if index in undefined_outputs(ref.node):
            continue   # no result of the call: never compared (capture/uninitialised.py)
        label = "output" if len(out_data) == 1 else f"output {index} ({operand.data.name})"
        checks.append(kind_mismatch(rank, label, output, ref.out_dtypes[index], comm.device) or
                      (label, output, ref.outputs[index], operand, None))
        shape_ok = shape_ok and tuple(output.shape) == operand.local_shape
    carrying = [(operand.data, out) for operand, out, g in zip(out_data, outputs, ref.grad_outputs)
                if g is not None and out.requires_grad]
    differentiable = [n for n, leaf in leaves.items() if leaf.requires_grad] if carrying else []
    backward_ran = bool(differentiable and shape_ok)
    if backward_ran:
        grads = _local_backward(comm, ref, strategy, layout, leaves, differentiable, carrying)
        for position, operand in enumerate(layout.inputs):
            data = operand.data
            if data.name in grads:
                loc = (data.locator.kind, data.locator.key)
                label = f"grad of {data.name}"
                checks.append(kind_mismatch(rank, label, grads[data.name], ref.dtypes[loc], comm.device) or
                              (label, grads[data.name], ref.grads[loc], operand,
                               _extremum_holder(strategy, ref, operand, position, mesh, rank)))
    found += compare_all(rank, checks, mesh, tolerance)
    issued = _counted(comm) if before is None else _counted(comm) - before
    if shape_ok:
        expected = layout.expected_collectives(tuple(differentiable + [d.name for d, _ in carrying])
                                               if differentiable else ())
        if issued != expected:
            found.append(Mismatch("collectives", rank, "collectives",
                                  detail=f"issued {_format_counts(issued)}; the declared actions "
                                         f"imply {_format_counts(expected)}"))
        elif dtype is None or all(decl.dtype == dtype for decl in case.inputs):
            # the declared actions ran as declared, on the declared dtypes: their price is the cost
            found += communication_mismatches(strategy, mesh, rank,
                                              traffic_fwd if traffic_start is None else traffic_fwd - traffic_start,
                                              Counter(comm.traffic) - traffic_fwd if backward_ran else None,
                                              layout.holds_largest)
        found += compute_mismatches(strategy, rank, work, layout.holds_largest)
    found += memory_mismatches(strategy, rank, leaves, outputs, case, layout)
    return RankReport(rank, tuple(found), tuple((kind, axes, n) for (kind, axes), n in sorted(issued.items())))


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


@functools.lru_cache(maxsize=256)
def _tolerance_for(dtype: torch.dtype, rtol: float | None, atol: float | None) -> Tolerance:
    return tolerance_for(dtype, rtol, atol)


def _counted(comm) -> Counter:
    return Counter({key: n for key, n in comm.counts.items() if key[0] in _COUNTED and n})


def _local_forward(comm, ref: Reference, strategy: ShardingStrategy,
                   layout: RankLayout) -> tuple[dict, tuple, OpWork | None]:
    """This rank's operand shards as leaves, the BEFORE actions, the op (post-added operands
    replaced by zeros; its work measured), the AFTER actions, then the post-added operands."""
    from shardverify.collectives.patterns import after_op, before_op

    node = ref.node
    module = _private_module(ref) if node.op == "call_module" else None
    leaves, local, late = {}, {}, {}
    for position, operand in enumerate(layout.inputs):
        data = operand.data
        loc = (data.locator.kind, data.locator.key)
        if loc not in ref.values:
            raise VerificationError(f"operand {data.name!r} sits at {loc[0]} {loc[1]!r}, which node "
                                    f"{node.name!r} does not have")
        partial = strategy.partial_input(data.name)
        leaf = operand.shard(ref.typed(loc), comm.mesh, comm.rank).clone() if partial is None else \
            _shared_piece(ref.values[loc], operand, comm.mesh, comm.rank, partial.axes, position,
                          partial.op).to(ref.dtypes[loc], copy=True)
        leaves[data.name] = ref.leaf(loc, leaf)
        local[loc] = before_op(comm, strategy, data.name, leaf, late)
    local.update(local_arguments(strategy, comm.rank))
    meter = OpMeter(node, _call_signature(local))
    try:
        outputs = list(as_outputs(node, meter.call(call_op, node, module, local, owned=module is not None)))
    except Exception as exc:  # noqa: BLE001 - re-raised with what reached the op
        raise OpCallError(_op_context(comm, node, strategy, leaves, local, exc)) from exc
    # an output the op leaves undefined stands as zeros of the local shape its layout gives (the meta
    # kernel's, which the strategy is derived from), so its actions and costs run as declared
    for index in undefined_outputs(ref.node):
        if index < min(len(outputs), len(layout.outputs)):
            outputs[index] = torch.zeros(layout.outputs[index].local_shape, dtype=outputs[index].dtype,
                                         device=outputs[index].device)
    return leaves, tuple(after_op(comm, strategy, outputs, late)), meter.work


def _call_signature(local: dict) -> tuple:
    """Besides the node (its op and recorded non-tensor arguments), what the op's FLOP count
    depends on: grad mode, the shape, stride, dtype, device and grad requirement of every
    tensor reaching it, and the non-tensor arguments a strategy passes instead (a view's local
    shape)."""
    return (torch.is_grad_enabled(),
            tuple((loc, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
                  else (loc, _hashable(t)) for loc, t in local.items()))


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


_PIECES: dict = {}


def _shared_piece(full: torch.Tensor, operand: LocalOperand, mesh, rank: int, axes: tuple[int, ...], seed: int,
                  op: str) -> torch.Tensor:
    """This rank's piece of its block of the reference tensor ``full`` held as a partial value
    over mesh ``axes`` (the pieces reduce by ``op``; every rank of the group makes the same
    pieces from the same block and seed and keeps the one at its position).  The group's pieces
    are made once per (tensor, block, mesh, axes, seed, op) and shared by every rank of the group
    and every strategy of the case laying the tensor out alike (the same pieces each would make;
    read only: callers copy)."""
    block = tuple((s.start, s.stop, s.step) for s in operand.slices)
    pieces = remembered(_PIECES, (id(full), block, tuple(mesh.shape), axes, seed, op), full,
                        lambda: partial_pieces(operand.shard(full, mesh, rank),
                                               math.prod(mesh.shape[a] for a in axes), seed, op), limit=1024)
    return pieces[mesh.group_index(rank, axes)]


def _extremum_holder(strategy: ShardingStrategy, ref: Reference, operand, position: int, mesh,
                     rank: int) -> torch.Tensor | None:
    """Where this rank's piece of a partial max/min input is the value itself (the elements
    whose gradient it receives), or None for any other input."""
    data = operand.data
    partial = strategy.partial_input(data.name)
    if partial is None or partial.op == "sum":
        return None
    full = ref.values[(data.locator.kind, data.locator.key)]
    return _shared_piece(full, operand, mesh, rank, partial.axes, position, partial.op) == \
        operand.shard(full, mesh, rank).to(torch.float64)


def local_arguments(strategy: ShardingStrategy, rank: int) -> dict:
    """Locator -> value of the non-tensor arguments ``rank`` passes in place of the recorded
    ones (a view's local shape, its own where blocks are uneven), in the form ``call_op`` takes."""
    return {(arg.locator.kind, arg.locator.key): arg.value_on(rank) for arg in strategy.local_args}


_OWN = threading.local()


def _private_module(ref: Reference) -> torch.nn.Module:
    """This thread's own copy of the op's module (one per reference and thread, reused by every
    strategy): ``call_op`` swaps the rank's shards into it, so no two ranks may share one."""
    cache = getattr(_OWN, "modules", None)
    if cache is None:
        cache = _OWN.modules = {}
    return remembered(cache, id(ref), ref, lambda: copy.deepcopy(ref.graph_module.get_submodule(ref.node.target)),
                      limit=8)


class OpCallError(VerificationError):
    """The op raised on a rank; the message says what each operand looked like when it got there."""


def _op_context(comm, node, strategy: ShardingStrategy, leaves: dict, local: dict, exc: Exception) -> str:
    """The op's error, then for each operand: its layout, the local shard it gave this rank,
    the BEFORE actions applied, and the shape and dtype that reached the op."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    every = _fails_on_shapes(node, strategy, local)
    lines = [f"{OP_FAILED} on rank {comm.rank}: {type(exc).__name__}: {reason}"
             + (f"\n{EVERY_RANK}" if every else "")]
    lines += [f"local argument {arg.locator.kind} {arg.locator.key!r}: {arg.value_on(comm.rank)!r}"
              for arg in strategy.local_args]
    for data in strategy.inputs:
        spec = strategy.get_sharding_spec_by_name(data.name)
        actions = [f"{a.pattern.name} over mesh axes {a.axes}" + (f" on dims {a.dims}" if a.dims else "")
                   for a in strategy.communication_actions if a.operand == data.name and a.where is CommWhere.BEFORE]
        reached = local.get((data.locator.kind, data.locator.key))
        leaf = leaves.get(data.name)
        got = "not passed" if reached is None else f"{tuple(reached.shape)} {str(reached.dtype).removeprefix('torch.')}"
        if strategy.post_added(data.name) is not None:
            got += " (zeros: added after the op)"
        if strategy.partial_axes(data.name):
            got += f" (a piece of a partial {strategy.partial_input(data.name).op} over mesh axes " \
                   f"{strategy.partial_axes(data.name)})"
        lines.append(f"{data.name}: layout {spec} of {tuple(data.shape)} -> local shard "
                     f"{tuple(leaf.shape) if leaf is not None else '?'}"
                     + (f", then {', then '.join(actions)}" if actions else ", no actions")
                     + f" -> reached the op as {got}")
    return "\n".join(lines)


OP_FAILED = "the op raised"
EVERY_RANK = ("it fails on shapes alone (meta tensors), and every rank's operands reach the op with "
              "the same shapes, so every rank fails alike")


def _fails_on_shapes(node, strategy: ShardingStrategy, local: dict) -> bool:
    """Whether the op also fails on meta tensors of the same shapes and dtypes, when every rank
    passes the same shapes (even layouts: the actions are the same on every rank too), so a
    shape-only failure is every rank's; a value-dependent one (an index out of range), or one
    on uneven blocks (each rank has its own shapes), is only known for this rank."""
    if not all(spec.is_even for _, spec in strategy.sharding_specs) or \
            any(arg.per_rank for arg in strategy.local_args):
        return False
    meta = {loc: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
            for loc, t in local.items()}
    module = None
    if node.op == "call_module":
        module = copy.deepcopy(node.graph.owning_module.get_submodule(node.target)).to("meta")
    try:
        call_op(node, module, meta)
    except Exception:  # noqa: BLE001 - any failure on meta tensors is a shape failure
        return True
    return False


def _local_backward(comm, ref: Reference, strategy: ShardingStrategy, layout: RankLayout, leaves: dict,
                    differentiable: list[str], carrying: list) -> dict:
    """Gradients of the leaves for the reference output gradients (sharded like the outputs),
    with the HOOK actions applied to the parameter gradients."""
    from shardverify.collectives.patterns import apply_grad_hook

    index = {operand.data.name: i for i, operand in enumerate(layout.outputs)}
    grad_outs = []
    for data, output in carrying:
        i = index[data.name]
        grad_outs.append(_grad_output(ref.grad_outputs[i], layout.outputs[i], comm.mesh, comm.rank, output.dtype))
    # autograd.grad less its Python checks (a third of its cost on a small op): the gradients are
    # plain tensors of the outputs' dtypes, and the engine still refuses one of the wrong shape
    found = _engine_run_backward(tuple(out for _, out in carrying), tuple(grad_outs), False, False,
                                 tuple(leaves[n] for n in differentiable), True, accumulate_grad=False)
    grads = {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(differentiable, found)}
    for action in strategy.communication_actions:
        if action.where is CommWhere.HOOK and action.operand in grads:
            grads[action.operand] = apply_grad_hook(comm, action, grads[action.operand])
    return grads


_GRAD_OUTPUTS: dict = {}


def _grad_output(full: torch.Tensor, operand: LocalOperand, mesh, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of the reference output gradient ``full`` laid out as ``operand``, in
    ``dtype``: remembered per (tensor, layout, rank, dtype), so the strategies of a case laying
    an output out alike share one slice and cast (read only: autograd never writes to it)."""
    return remembered(_GRAD_OUTPUTS, (id(full), operand.spec, rank, dtype), full,
                      lambda: operand.shard(full, mesh, rank).to(dtype), limit=8192)
