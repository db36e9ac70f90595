"""What a low-precision check may lose: the single-device op's own error in that dtype.

A sharded run in float16 cannot be held to float64 tolerances, and a fixed rtol either
fails correct strategies (partial sums rounded before they are reduced) or passes sloppy
ones. So, as PyTorch's own tests do for half precision (a decomposition's error against a
float64 reference is compared with the original op's error), each output and gradient gets
a budget: the error of the op run on one device in the check's dtype against the float64
reference, never less than rounding the largest reference value once into the dtype (a 0-d
result's measured error is one draw of that rounding, which may fall near zero). A strategy
fails when its sharded error exceeds ``BUDGET_FACTOR`` times that budget (plus the dtype's
atol). The factor covers what sharding legitimately adds: each
partial result rounded once more, and the reduction of the partials in the dtype.

The single-device error is one kernel's, at the full shapes, and a kernel's accumulation order
depends on the shapes it gets (a blocked sum at one shape, a plain running sum, with sqrt(n)
times less luck over n terms, at another). A rank runs the op at its own shapes, so a check over
the single-device budget is judged again against the worse of it and the op's own error on what
each rank's op sees, after its BEFORE actions (verify/local_errors.py): still the precision the
op computes in, at the shapes the strategy computes it; the factor still bounds all the strategy
adds before and after the op (a reduction's or a cast's rounding). A check
passes by that second budget only once the float64 re-check (run for every check over the first)
finds it exact, so the larger budget never lets wrong maths through unchecked.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from shardverify.sharding.strategy import ShardingStrategy
from shardverify.spec.case import OpCase, cached
from shardverify.capture.call import as_outputs, call_op, called_module
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.verify.reference import Reference, reference
from shardverify.verify.local_errors import rank_local_errors
from shardverify.verify.report import Mismatch, output_label
from shardverify.verify.tolerance import own_error

__all__ = ["BUDGET_FACTOR", "single_device_errors", "error_budgets", "Judged", "judge"]

#: A sharded low-precision result may be this many times as far from the float64
#: reference as the single-device op in the same dtype (documented in specs/README.md).
BUDGET_FACTOR = 8.0

_LOCK = threading.Lock()
_ERRORS: dict = {}


def single_device_errors(case: OpCase, dtype: torch.dtype) -> tuple[tuple[float, ...], dict]:
    """(max abs error of each output, {operand locator: max abs error of its gradient}) of
    the op run on one CPU device in ``dtype``, against the float64 reference of that dtype."""
    with _LOCK:
        return cached(_ERRORS, (case, dtype), lambda: _measure(reference(case, dtype, torch.device("cpu"))))


def _measure(ref: Reference) -> tuple[tuple[float, ...], dict]:
    node = ref.node
    module = called_module(ref.graph_module, node)
    leaves = {}
    for loc, value in ref.values.items():
        leaf = value.to(ref.dtypes[loc])
        leaves[loc] = ref.leaf(loc, leaf)
    outputs = as_outputs(node, call_op(node, module, leaves))
    undefined = undefined_outputs(node)   # no result, of another shape in another dtype's kernel: no budget
    out_errors = tuple(0.0 if i in undefined else own_error(out, want)
                       for i, (out, want) in enumerate(zip(outputs, ref.outputs)))
    carrying = [(out, g) for out, g in zip(outputs, ref.grad_outputs) if g is not None and out.requires_grad]
    wanted = [loc for loc in ref.grads if leaves[loc].requires_grad]
    grad_errors = {}
    if carrying and wanted:
        found = torch.autograd.grad([out for out, _ in carrying], [leaves[loc] for loc in wanted],
                                    [g.to(out.dtype) for out, g in carrying], allow_unused=True)
        grad_errors = {loc: own_error(torch.zeros_like(leaves[loc]) if g is None else g, ref.grads[loc])
                       for loc, g in zip(wanted, found)}
    return out_errors, grad_errors


def error_budgets(case: OpCase, strategy: ShardingStrategy, dtype: torch.dtype, *,
                  at_rank_shapes: bool = False) -> dict[str, float]:
    """Single-device error by the tensor labels a check reports ("output", "grad of weight");
    ``at_rank_shapes``: the worse of it and the op's own error at the shapes each rank computes
    (verify/local_errors.py), for a check over the first."""
    out_errors, grad_errors = single_device_errors(case, dtype)
    outputs = strategy.outputs
    budgets = {}
    for index, data in enumerate(outputs):
        label = output_label(index, len(outputs), data.name)
        if index < len(out_errors):
            budgets[label] = out_errors[index]
    for data in strategy.inputs:
        loc = (data.locator.kind, data.locator.key)
        if loc in grad_errors:
            budgets[f"grad of {data.name}"] = grad_errors[loc]
    return _worse(budgets, rank_local_errors(case, strategy, dtype) or {}) if at_rank_shapes else budgets


def _worse(budgets: dict[str, float], local: dict[str, float]) -> dict[str, float]:
    """Each label's budget raised to its error at the ranks' shapes where that is larger."""
    return {label: max(budget, local.get(label, 0.0)) for label, budget in budgets.items()}


class Judged(NamedTuple):
    """A low-precision check's value mismatches against its budgets. ``over``: those beyond
    BUDGET_FACTOR x the single-device error (+ atol), each restated against its budget (any
    such check is re-checked in float64); ``worst``: the worst error/budget ratio.
    ``at_ranks``/``worst_at_ranks``: the same against the budget at the ranks' shapes, for a
    check over the first (None: within it, or a strategy whose local call raises on a rank)."""

    over: list[Mismatch]
    worst: float
    at_ranks: list[Mismatch] | None = None
    worst_at_ranks: float = 0.0


def judge(case: OpCase, strategy: ShardingStrategy, dtype: torch.dtype, mismatches: Sequence[Mismatch]) -> Judged:
    """``mismatches`` (low-precision values only) against the single-device budget, and a check
    over it against the budget at the ranks' shapes (the worse of the two, label by label)."""
    single = error_budgets(case, strategy, dtype)
    over, worst = _judged(mismatches, single, "the single-device op's own {dtype} error")
    if not over:
        return Judged(over, worst)
    # the ranks measured until their errors cover the check (the same verdict as all of them)
    local = rank_local_errors(case, strategy, dtype, enough=lambda errors: not _judged(
        mismatches, _worse(single, errors), "")[0], labels=frozenset(m.tensor for m in over))
    if local is None:   # not measured: the op raises on what a rank's op sees (the check fails anyway)
        return Judged(over, worst)
    at_ranks, worst_at_ranks = _judged(mismatches, _worse(single, local),
                                       "the op's own {dtype} error on one device, at the full shapes or a rank's")
    return Judged(over, worst, at_ranks, worst_at_ranks)


def _judged(mismatches: Sequence[Mismatch], budgets: dict[str, float], whose: str) -> tuple[list[Mismatch], float]:
    over, worst = [], 0.0
    for m in mismatches:
        budget = budgets.get(m.tensor, 0.0)
        allowed = BUDGET_FACTOR * budget + (m.atol or 0.0)
        worst = max(worst, m.max_abs_err / allowed if allowed > 0 else float("inf"))
        if m.max_abs_err > allowed:
            over.append(dataclasses.replace(m, detail=(
                f"max abs error {m.max_abs_err:.3g} exceeds {BUDGET_FACTOR:g} x {budget:.3g} "
                f"({whose.format(dtype=m.dtype)}) + atol {m.atol or 0.0:.3g}")))
    return over, worst
