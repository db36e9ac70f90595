"""The numerical check of one sharding strategy, run identically on every rank of any backend.

Every rank rebuilds the same single-device reference (same seed, values rounded to the
check's dtype and computed in float64), takes the local shards its strategy gives it,
executes exactly the strategy's declared communication actions and nothing else, runs the
op locally, and compares its output shard and every gradient shard with the reference
slice. It also counts the collectives it issued and the bytes it holds, so a strategy whose
declared communication or memory cost disagrees with what it really needs fails too.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from shardverify.errors import BackendError, InvalidArgument, RankError, VerificationError
from shardverify.strategy import CommPattern, CommWhere, OperationDataType, ShardingStrategy
from shardverify.verify.case import OpCase
from shardverify.verify.reference import Reference, call_op, reference
from shardverify.verify.report import CheckResult, Mismatch
from shardverify.verify.tolerance import Tolerance, compare, dtype_from_name, tolerance_for

__all__ = ["RankReport", "rank_check", "verify_strategy", "verify_case", "expected_collectives",
           "strategy_problems"]

# Collectives each pattern issues in the forward pass and in the backward pass.
_FWD = {CommPattern.ALLREDUCE_FWD_IDENTITY_BWD: "all_reduce", CommPattern.GATHER_FWD_SPLIT_BWD: "all_gather",
        CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: "all_to_all"}
_BWD = {CommPattern.IDENTITY_FWD_ALLREDUCE_BWD: "all_reduce", CommPattern.SPLIT_FWD_GATHER_BWD: "all_gather",
        CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: "all_to_all"}
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
    output = strategy.operands[-1]
    if output.type is not OperationDataType.OUTPUT:
        problems.append(f"the last operand {output.name!r} is not the output")
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
    return problems


def expected_collectives(strategy: ShardingStrategy, carrying_grad: Iterable[str]) -> Counter:
    """(kind, axes) -> count that the declared actions issue; a backward half only runs on an
    operand in ``carrying_grad`` (the differentiable inputs and parameters, and the output)."""
    differentiable = set(carrying_grad)
    expected: Counter = Counter()
    for action in strategy.communication_actions:
        if action.where is CommWhere.HOOK:
            if action.operand in differentiable:
                expected[("all_reduce", action.axes)] += 1
            continue
        if action.pattern in _FWD:
            expected[(_FWD[action.pattern], action.axes)] += 1
        if action.pattern in _BWD and action.operand in differentiable:
            expected[(_BWD[action.pattern], action.axes)] += 1
    return expected


def _format_counts(counts: Counter) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{n} x {kind} over axes {axes}" for (kind, axes), n in sorted(counts.items()))


# -------------------------------------------------------------------------- rank check

def rank_check(comm, case: OpCase, strategy: ShardingStrategy, dtype: str | None = None,
               tol: Tolerance | None = None) -> RankReport:
    """The SPMD check of ``strategy`` on this rank (module-level so process workers import it)."""
    mesh, rank = comm.mesh, comm.rank
    before = _counted(comm)
    ref = reference(case, dtype_from_name(dtype) if dtype is not None else None, torch.device(comm.device))

    def tolerance(t: torch.dtype) -> Tolerance:
        return tol if tol is not None else tolerance_for(t, case.rtol, case.atol)

    leaves, output = _local_forward(comm, ref, strategy)
    out_name, out_spec = strategy.sharding_specs[-1]
    found = _compare(rank, "output", output, out_spec.local_shard(ref.output, mesh, rank), tolerance)
    shape_ok = tuple(output.shape) == out_spec.local_shape()   # else backward cannot run
    differentiable = [n for n, leaf in leaves.items() if leaf.requires_grad] if output.requires_grad else []
    if differentiable and shape_ok:
        grads = _local_backward(comm, ref, strategy, leaves, differentiable, output)
        for data in strategy.operands[:-1]:
            if data.name in grads:
                spec = strategy.get_sharding_spec_by_name(data.name)
                expected = spec.local_shard(ref.grads[(data.locator.kind, data.locator.key)], mesh, rank)
                found += _compare(rank, f"grad of {data.name}", grads[data.name], expected, tolerance)

    issued = _counted(comm) - before
    if shape_ok:
        expected = expected_collectives(strategy, differentiable + [out_name] if differentiable else [])
        if issued != expected:
            found.append(Mismatch("collectives", rank, "collectives",
                                  detail=f"issued {_format_counts(issued)}; the declared actions "
                                         f"imply {_format_counts(expected)}"))
    found += _memory_mismatches(strategy, rank, leaves, output)
    return RankReport(rank, tuple(found), tuple((kind, axes, n) for (kind, axes), n in sorted(issued.items())))


def _counted(comm) -> Counter:
    return Counter({key: n for key, n in comm.counts.items() if key[0] in _COUNTED and n})


def _local_forward(comm, ref: Reference, strategy: ShardingStrategy) -> tuple[dict, torch.Tensor]:
    """This rank's operand shards as leaves, the BEFORE actions, the op, the AFTER actions."""
    from shardverify.collectives.patterns import apply_comm_action

    node = ref.node
    module = copy.deepcopy(ref.graph_module.get_submodule(node.target)) if node.op == "call_module" else None
    leaves, local = {}, {}
    for data in strategy.operands[:-1]:
        loc = (data.locator.kind, data.locator.key)
        if loc not in ref.values:
            raise VerificationError(f"operand {data.name!r} sits at {loc[0]} {loc[1]!r}, which node "
                                    f"{node.name!r} does not have")
        spec = strategy.get_sharding_spec_by_name(data.name)
        leaf = spec.local_shard(ref.values[loc].to(ref.dtypes[loc]), comm.mesh, comm.rank).clone()
        leaves[data.name] = leaf.requires_grad_() if leaf.is_floating_point() else leaf
        tensor = leaf
        for action in strategy.communication_actions:
            if action.operand == data.name and action.where is CommWhere.BEFORE:
                tensor = apply_comm_action(comm, action, tensor)
        local[loc] = tensor
    output = call_op(node, module, local)
    for action in strategy.communication_actions:
        if action.operand == strategy.operands[-1].name and action.where is CommWhere.AFTER:
            output = apply_comm_action(comm, action, output)
    return leaves, output


def _local_backward(comm, ref: Reference, strategy: ShardingStrategy, leaves: dict,
                    differentiable: list[str], output: torch.Tensor) -> dict:
    """Gradients of the leaves for the reference output gradient (sharded like the output),
    with the HOOK actions applied to the parameter gradients."""
    from shardverify.collectives.patterns import apply_grad_hook

    out_spec = strategy.sharding_specs[-1][1]
    grad_out = out_spec.local_shard(ref.grad_output, comm.mesh, comm.rank).to(output.dtype)
    found = torch.autograd.grad(output, [leaves[n] for n in differentiable], grad_out, allow_unused=True)
    grads = {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(differentiable, found)}
    for action in strategy.communication_actions:
        if action.where is CommWhere.HOOK and action.operand in grads:
            grads[action.operand] = apply_grad_hook(comm, action, grads[action.operand])
    return grads


def _compare(rank: int, label: str, actual: torch.Tensor, expected: torch.Tensor,
             tolerance: Callable[[torch.dtype], Tolerance]) -> list[Mismatch]:
    """[] when ``actual`` matches the reference slice, else the one mismatch found."""
    if tuple(actual.shape) != tuple(expected.shape):
        return [Mismatch("shape", rank, label, actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape))]
    tol = tolerance(actual.dtype)
    found = compare(actual, expected, tol)
    if found.close:
        return []
    return [Mismatch("values", rank, label, actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape),
                     max_abs_err=found.max_abs_err, max_rel_err=found.max_rel_err, rtol=tol.rtol, atol=tol.atol,
                     dtype=str(actual.dtype).removeprefix("torch."))]


def _memory_mismatches(strategy: ShardingStrategy, rank: int, leaves: dict,
                       output: torch.Tensor) -> list[Mismatch]:
    """The declared memory cost against the bytes of the shards this rank really holds:
    forward holds every operand's shard, backward a gradient of each input and parameter."""
    from shardverify.strategy import MemoryCost

    activation = parameter = 0
    for data in strategy.operands[:-1]:
        size = leaves[data.name].numel() * data.itemsize
        if data.is_param:
            parameter += size
        else:
            activation += size
    out_bytes = output.numel() * strategy.operands[-1].itemsize
    fwd = MemoryCost(activation + out_bytes, parameter)
    bwd = MemoryCost(activation, parameter)
    held = (fwd, bwd, fwd + bwd)
    declared = tuple(strategy.memory_cost)
    problems = [f"{phase}: declared {d.activation} activation + {d.parameter} parameter bytes, "
                f"local shards hold {h.activation} + {h.parameter}"
                for phase, d, h in zip(("fwd", "bwd", "total"), declared, held) if d != h]
    if not problems:
        return []
    return [Mismatch("memory", rank, "memory cost", detail="; ".join(problems))]


# ------------------------------------------------------------------------- orchestration

def _backend_name(backend) -> str:
    """"simulated", "gloo", "nccl"... plus the device when it is not the CPU."""
    name = getattr(backend, "name", None) or getattr(backend, "backend", None)
    if not isinstance(name, str):
        name = type(backend).__name__.removesuffix("Backend").lower() or type(backend).__name__
    device = str(getattr(backend, "device", "cpu"))
    return name if device == "cpu" else f"{name}/{device}"


def _error_mismatches(error: BackendError) -> list[Mismatch]:
    ranks = tuple(getattr(error, "ranks", ()) or (getattr(error, "rank", -1),))
    detail = str(error)
    if isinstance(error, RankError) and error.traceback_text:
        tail = [line for line in error.traceback_text.strip().splitlines() if line.strip()][-3:]
        detail += "\n        " + "\n        ".join(tail)
    return [Mismatch("error", int(r), "rank", detail=detail) for r in ranks]


def _run_check(backend, case: OpCase, strategy: ShardingStrategy, dtype: str | None,
               tol: Tolerance | None, timeout: float | None) -> list[Mismatch]:
    try:
        reports = backend.run(rank_check, case, strategy, dtype, tol, timeout=timeout)
    except BackendError as error:
        return _error_mismatches(error)
    return [m for report in reports for m in report.mismatches]


def verify_strategy(backend, case: OpCase, strategy: ShardingStrategy, *, dtype: str | None = None,
                    tol: Tolerance | None = None, timeout: float | None = None) -> CheckResult:
    """Check one strategy on every rank of ``backend``; never raises for a wrong strategy
    (the result says what is wrong), only for a strategy made for another mesh."""
    mesh_shape = tuple(backend.mesh.shape)
    for name, spec in strategy.sharding_specs:
        if tuple(spec.mesh_shape) != mesh_shape:
            raise InvalidArgument(f"strategy {strategy.name!r}: layout of {name!r} is for mesh "
                                  f"{spec.mesh_shape}, the backend's mesh is {mesh_shape}")
    if dtype is not None:
        if not dtype_from_name(dtype).is_floating_point:
            raise InvalidArgument(f"dtype must be a floating dtype to run the check in, got {dtype!r}")
        dtype = str(dtype_from_name(dtype)).removeprefix("torch.")
    shown_dtype = dtype or case.inputs[0].dtype
    start = time.perf_counter()

    def result(mismatches: Sequence[Mismatch], note: str = "") -> CheckResult:
        return CheckResult(op=case.op, case=case.describe(), strategy=strategy.name, mesh_shape=mesh_shape,
                           backend=_backend_name(backend), dtype=shown_dtype, mismatches=tuple(mismatches),
                           seconds=time.perf_counter() - start, note=note)

    problems = strategy_problems(strategy, len(mesh_shape))
    if problems:
        return result([Mismatch("error", -1, "strategy", detail=p) for p in problems])
    mismatches = _run_check(backend, case, strategy, dtype, tol, timeout)
    rounding_suspect = mismatches and all(m.kind == "values" and m.dtype != "float64" for m in mismatches)
    if not rounding_suspect:
        return result(mismatches)
    # Low-precision differences may be reordered sums: the same check in float64 decides.
    recheck = _run_check(backend, case, strategy, "float64", None, timeout)
    worst = max(m.max_abs_err for m in mismatches)
    if not recheck:
        return result([], note=f"{shown_dtype} differences up to {worst:.3g} are rounding: "
                               "the float64 re-check passed")
    worst64 = max((m.max_abs_err or 0.0) for m in recheck)
    return result(mismatches, note=f"not rounding: the float64 re-check fails too (max abs error {worst64:.3g})")


def verify_case(backend, case: OpCase, strategies: Iterable[ShardingStrategy] | None = None, *,
                dtype: str | None = None, tol: Tolerance | None = None, timeout: float | None = None,
                on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Check every strategy (default: all of the op node's strategies on the backend's mesh)."""
    if strategies is None:
        from shardverify.api import strategies_for_node

        graph_module, node_name = case.build()
        strategies = strategies_for_node(graph_module, node_name, backend.mesh)
    strategies = list(strategies)
    if not strategies:
        raise VerificationError(f"{case.op}: no strategy to verify for {case.describe()} on mesh "
                                f"{tuple(backend.mesh.shape)}")
    results = []
    for strategy in strategies:
        results.append(verify_strategy(backend, case, strategy, dtype=dtype, tol=tol, timeout=timeout))
        if on_result is not None:
            on_result(results[-1])
    return results
