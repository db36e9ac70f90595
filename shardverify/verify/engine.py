"""Verifying strategies on a backend: each strategy's :func:`~shardverify.verify.rank.rank_check`
run on every rank of the mesh, the ranks' reports turned into one verdict per strategy (with the
low-precision budget and the rank errors a backend reports), and the checks counted."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence

from shardverify.capture.meta import output_metas
from shardverify.backends.registry import backend_label, batch_runner, take_notices
from shardverify.errors import BackendError, InvalidArgument, RankError, VerificationError
from shardverify.sharding.strategy import ShardingStrategy
from shardverify.spec.case import OpCase
from shardverify.spec.fields import dtype_from_name
from shardverify.verify.distinct import distinguishing_seeds
from shardverify.verify.error_map import error_maps_kept
from shardverify.verify.isolated import needs_isolation, remember_deaths, verify_isolated
from shardverify.verify.layout import expected_collectives
from shardverify.verify.memory import check_case_memory
from shardverify.verify.op_error import EVERY_RANK, OP_FAILED, OpCallError
from shardverify.verify.precision import BUDGET_FACTOR, Judged, judge
from shardverify.verify.rank import (  # noqa: F401  (re-exported: the engine's API)
    RankReport, local_arguments, strategy_problems)
from shardverify.verify.together import rank_check
from shardverify.verify.report import CheckResult, Mismatch
from shardverify.verify.tolerance import Tolerance

__all__ = ["RankReport", "OpCallError", "rank_check", "verify_strategy", "verify_case", "expected_collectives",
           "strategy_problems", "local_arguments"]


# ------------------------------------------------------------------------- orchestration

def _error_mismatches(error: BackendError, mesh_ranks: Sequence[int] = ()) -> list[Mismatch]:
    """One "error" mismatch per failing rank: every rank the backend names (and each failure
    it carries, when it reports several), with the op's context for a failure inside the op
    or the last lines of the traceback otherwise."""
    failures = [e for e in getattr(error, "failures", ()) if isinstance(e, BackendError)] or [error]
    found, seen = [], set()
    for failure in failures:
        ranks = tuple(getattr(failure, "ranks", ()) or (getattr(failure, "rank", -1),))
        detail = str(failure)
        if EVERY_RANK in detail and mesh_ranks:
            ranks = tuple(mesh_ranks)
        traceback_text = getattr(failure, "traceback_text", "") if isinstance(failure, RankError) else ""
        if traceback_text and OP_FAILED not in detail:
            tail = [line for line in traceback_text.strip().splitlines() if line.strip()][-3:]
            detail += "\n        " + "\n        ".join(tail)
        detail = detail.replace("\n", "\n        ")
        first = None
        for rank in ranks:
            if int(rank) not in seen:
                seen.add(int(rank))
                shown = detail if first is None else f"the same failure as rank {first}"
                found.append(Mismatch("error", int(rank), "rank", detail=shown))
                first = int(rank) if first is None else first
    return found


def _run_check(backend, case: OpCase, strategy: ShardingStrategy, dtype: str | None,
               tol: Tolerance | None, timeout: float | None) -> list[Mismatch]:
    try:
        reports = backend.run(rank_check, case, strategy, dtype, tol, timeout=timeout)
    except BackendError as error:
        remember_deaths(case.op, error)   # a rank killed by the op's kernel: isolated from now on
        return _error_mismatches(error, backend.mesh.ranks)
    return [m for report in reports for m in report.mismatches]


def _run_checks(backend, case: OpCase, strategies: Sequence[ShardingStrategy], dtype: str | None,
                tol: Tolerance | None, timeout: float | None) -> list[list[Mismatch]]:
    """The mismatches of each strategy: one batch (one hand-over to the ranks) where the
    backend has ``run_batch``, each failure still its own strategy's, each check still under
    its own timeout."""
    run_batch = batch_runner(backend)
    if run_batch is None or len(strategies) < 2:
        return [_run_check(backend, case, s, dtype, tol, timeout) for s in strategies]
    outcomes = run_batch(rank_check, [(case, s, dtype, tol) for s in strategies], timeout=timeout)
    for outcome in outcomes:
        if isinstance(outcome, BackendError):
            remember_deaths(case.op, outcome)   # a rank killed by the op's kernel: isolated from now on
    return [_error_mismatches(outcome, backend.mesh.ranks) if isinstance(outcome, BackendError)
            else [m for report in outcome for m in report.mismatches] for outcome in outcomes]


def _checked_dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    if not dtype_from_name(dtype).is_floating_point:
        raise InvalidArgument(f"dtype must be a floating dtype to run the check in, got {dtype!r}")
    return str(dtype_from_name(dtype)).removeprefix("torch.")


def _first_dtype(case) -> str:
    """The dtype a case's check is shown in: its first input's, else (a call on module state
    alone: a slice of a buffer) its result's."""
    if case.inputs:
        return case.inputs[0].dtype
    graph_module, node_name = case.build()
    meta = output_metas(next(n for n in graph_module.graph.nodes if n.name == node_name))[0]
    return str(meta.dtype).removeprefix("torch.")


def _check_mesh(backend, strategy: ShardingStrategy) -> None:
    mesh_shape = tuple(backend.mesh.shape)
    for name, spec in strategy.sharding_specs:
        if tuple(spec.mesh_shape) != mesh_shape:
            raise InvalidArgument(f"strategy {strategy.name!r}: layout of {name!r} is for mesh "
                                  f"{spec.mesh_shape}, the backend's mesh is {mesh_shape}")


def _rounding_suspect(mismatches: Sequence[Mismatch]) -> bool:
    """Only low-precision value differences, none of them about inf/NaN (those are compared exactly)."""
    return bool(mismatches) and all(m.kind == "values" and m.dtype != "float64" and not m.detail
                                    for m in mismatches)


def _verdict(mismatches: list[Mismatch], budget: Judged | None, recheck: list[Mismatch] | None,
             shown_dtype: str) -> tuple[list, str]:
    """Mismatches and note of a check. ``budget``: for a check whose only differences were
    low-precision values, how they stand against the budgets (precision.judge); ``recheck``: the
    float64 re-check of a check over the single-device budget, which tells wrong maths from
    rounding: a check within the budget at the ranks' shapes passes only when exact in float64."""
    if budget is None:
        return mismatches, ""
    if not budget.over:
        return [], (f"{shown_dtype} differences are within {BUDGET_FACTOR:g} x the single-device "
                    f"op's own {shown_dtype} error (worst ratio {budget.worst:.2g})")
    if recheck:
        worst64 = max((m.max_abs_err or 0.0) for m in recheck)
        return budget.over, f"wrong maths: the float64 re-check fails too (max abs error {worst64:.3g})"
    if budget.at_ranks is None:
        return budget.over, (f"too much rounding: exact in float64, but the sharded {shown_dtype} error exceeds "
                             f"{BUDGET_FACTOR:g} x the single-device op's own {shown_dtype} error")
    if not budget.at_ranks:
        return [], (f"exact in float64, and the {shown_dtype} differences are within {BUDGET_FACTOR:g} x the "
                    f"op's own {shown_dtype} error at the full shapes or a rank's (worst ratio "
                    f"{budget.worst_at_ranks:.2g}; {budget.worst:.2g} to the single-device op's, whose kernel "
                    f"summed in another order)")
    return budget.at_ranks, (f"too much rounding: exact in float64, but the sharded {shown_dtype} error exceeds "
                             f"{BUDGET_FACTOR:g} x the op's own {shown_dtype} error on one device, at the full "
                             f"shapes or a rank's")


def verify_strategy(backend, case: OpCase, strategy: ShardingStrategy, *, dtype: str | None = None,
                    tol: Tolerance | None = None, timeout: float | None = None) -> CheckResult:
    """Check one strategy on every rank of ``backend``; never raises for a wrong strategy
    (the result says what is wrong), only for a strategy made for another mesh."""
    return verify_case(backend, case, [strategy], dtype=dtype, tol=tol, timeout=timeout)[0]


def verify_case(backend, case: OpCase, strategies: Iterable[ShardingStrategy] | None = None, *,
                dtype: str | None = None, tol: Tolerance | None = None, timeout: float | None = None,
                on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Check every strategy (default: all of the op node's strategies on the backend's mesh),
    the runnable ones dispatched to the ranks as one batch (strategies alike but in name are
    checked once: _checked_once); on the simulated backend, a case whose op's kernel may crash
    is checked in a child process (verify/isolated.py). A case whose check is estimated over
    MAX_CASE_BYTES is refused (VerificationError) before anything of it is allocated."""
    check_case_memory(case, tuple(backend.mesh.shape))
    if strategies is None:
        from shardverify.strategies.for_node import strategies_for_node

        graph_module, node_name = case.build()
        strategies = strategies_for_node(graph_module, node_name, backend.mesh)
    strategies = list(strategies)
    if not strategies:
        raise VerificationError(f"{case.op}: no strategy to verify for {case.describe()} on mesh "
                                f"{tuple(backend.mesh.shape)}")
    for strategy in strategies:
        _check_mesh(backend, strategy)
    firsts: dict[tuple, int] = {}
    same = [firsts.setdefault(s.layout_key(), i) for i, s in enumerate(strategies)]
    if len(firsts) < len(strategies):   # strategies alike but in name (a following op's, one per predecessor)
        return _checked_once(backend, case, strategies, same, dtype=dtype, tol=tol, timeout=timeout,
                             on_result=on_result)
    dtype = _checked_dtype(dtype)
    shown_dtype = dtype or _first_dtype(case)
    if needs_isolation(case, backend):   # its kernel may end the process it runs in: checked in a child
        results = verify_isolated(verify_case, backend, case, strategies, shown_dtype=shown_dtype,
                                  backend_name=backend_label(backend), dtype=dtype, tol=tol, timeout=timeout)
        for result in results:
            if on_result is not None:
                on_result(result)
        _log_checks(len(results))
        return results
    mesh_shape = tuple(backend.mesh.shape)
    start = time.perf_counter()
    problems = [strategy_problems(s, len(mesh_shape)) for s in strategies]
    runnable = [i for i, p in enumerate(problems) if not p]
    found = _run_checks(backend, case, [strategies[i] for i in runnable], dtype, tol, timeout)
    mismatches = [[Mismatch("error", -1, "strategy", detail=text) for text in p] for p in problems]
    for i, found_i in zip(runnable, found):
        mismatches[i] = found_i
    # data that cannot tell two blocks apart on one seed gets more seeds (verify/distinct.py):
    # a strategy that passed is checked again under each, and fails under the first that shows it
    seeds = distinguishing_seeds(case, mesh_shape)
    checked = _other_seeds(backend, case, strategies, runnable, mismatches, seeds.seeds[1:], dtype, tol, timeout)
    budgets, rechecks = _rounding_rechecks(backend, strategies, checked, mismatches, problems, timeout)
    seconds = (time.perf_counter() - start) / len(strategies)   # a batch's time, shared evenly
    # what happened to the backend outside any check (a worker found dead and replaced): said,
    # on the first result, without failing anything
    incidents = take_notices(backend)
    results = []
    described: dict[int, str] = {}   # each seed's case described once, not per strategy
    for variant in checked:
        if id(variant) not in described:
            described[id(variant)] = variant.describe()
    backend_name, seeds_note = backend_label(backend), seeds.note()
    kept = error_maps_kept()
    for i, strategy in enumerate(strategies):
        final, note = _verdict(mismatches[i], budgets.get(i), rechecks.get(i), shown_dtype)
        note = "; ".join(part for part in ("; ".join(incidents) if i == 0 else "", seeds_note, note) if part)
        results.append(CheckResult(op=case.op, case=described[id(checked[i])], strategy=strategy.name,
                                   mesh_shape=mesh_shape, backend=backend_name, dtype=shown_dtype,
                                   mismatches=tuple(final), seconds=seconds, note=note,
                                   checked=strategy if final and kept else None))
        if on_result is not None:
            on_result(results[-1])
    _log_checks(len(results))
    return results


def _other_seeds(backend, case: OpCase, strategies: list[ShardingStrategy], runnable: list[int],
                 mismatches: list, seeds, dtype: str | None, tol: Tolerance | None, timeout: float | None) -> list:
    """Each runnable strategy that passed checked again under each further seed, its mismatches
    replaced by the first seed's that shows any; the case (variant) each strategy's verdict is of."""
    checked = [case] * len(strategies)
    for seed in seeds:
        variant, passed = dataclasses.replace(case, seed=seed), [i for i in runnable if not mismatches[i]]
        for i, found_i in zip(passed, _run_checks(backend, variant, [strategies[i] for i in passed], dtype, tol,
                                                  timeout)):
            mismatches[i], checked[i] = (found_i, variant) if found_i else (mismatches[i], checked[i])
    return checked


def _rounding_rechecks(backend, strategies: list[ShardingStrategy], checked: list, mismatches: list,
                       problems: list, timeout: float | None) -> tuple[dict, dict[int, list[Mismatch]]]:
    """(index -> the low-precision budget of each failure that may be rounding, index -> its float64
    re-check's mismatches for those over their budget).

    Below float64 the budget is the single-device op's own error in that dtype, and for a check
    over it the op's own error at the ranks' shapes (precision.judge); the float64 re-check (one
    batch per seed) tells wrong maths from rounding."""
    suspects = [i for i, (m, p) in enumerate(zip(mismatches, problems)) if not p and _rounding_suspect(m)]
    # the dtype the check ran in: a complex64 output's is float32
    budgets = {i: judge(checked[i], strategies[i], dtype_from_name(mismatches[i][0].dtype).to_real(), mismatches[i])
               for i in suspects}
    over = [i for i in suspects if budgets[i].over]   # re-checked in float64
    rechecks: dict[int, list[Mismatch]] = {}
    for variant in dict.fromkeys(checked[i] for i in over):   # one batch per seed the failures showed under
        group = [i for i in over if checked[i] is variant]
        rechecks.update(zip(group, _run_checks(backend, variant, [strategies[i] for i in group], "float64", None,
                                               timeout)))
    return budgets, rechecks


def _checked_once(backend, case: OpCase, strategies: list[ShardingStrategy], same: list[int], *,
                  on_result, **options) -> list[CheckResult]:
    """Each layout checked once, its result given to every strategy alike but in name
    (``same[i]``: the first strategy with i's layouts), said in each such result's note."""
    distinct = sorted(set(same))
    checked = dict(zip(distinct, verify_case(backend, case, [strategies[i] for i in distinct], **options)))
    results = []
    for i, strategy in enumerate(strategies):
        result = checked[same[i]]
        if same[i] != i:
            said = f"the layouts of {strategies[same[i]].name!r}, checked once"
            result = dataclasses.replace(result, strategy=strategy.name,
                                         note="; ".join(part for part in (result.note, said) if part))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _log_checks(count: int) -> None:
    """Append the number of checks to $SHARDVERIFY_CHECK_LOG when set (CI sums the lines to
    print how many strategy checks its suite ran, over every pytest-xdist worker)."""
    path = os.environ.get("SHARDVERIFY_CHECK_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:   # one short line per write: appends do not interleave
            log.write(f"{count}\n")
