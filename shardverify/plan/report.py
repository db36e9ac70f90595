"""A plan check as a person reads it: the verdict first, then detail on demand.

The first lines (:func:`verdict_lines`) say whether the chosen plan matches the single-device
model, on which mesh, how many ops it shards and keeps whole, what it is predicted to cost, how
many ops have verified sharding strategies, and on a failure the first culprit. What
follows is only what a reader must act on (ops that ran whole for want of strategies, the failure's
evidence, notes); the op-by-op listing and the coverage's detail are for ``-v``
(:func:`detail_lines`). Words are the user's: ops, layouts, sharded, replicated, devices; never
the engine's (handler, grid, partial input).
"""

from __future__ import annotations

from collections import Counter

from shardverify.plan.coverage import Coverage
from shardverify.plan.model import PlanCost
from shardverify.plan.verify import PlanResult, describe_plan, node_label

__all__ = ["VERDICT_LINES", "verdict_lines", "plan_text", "detail_lines", "seconds_text", "bytes_text"]

#: how many lines the verdict takes at most: a reader (or a test) finds it all there
VERDICT_LINES = 5
#: ops named in one line before the rest are counted
SHOW = 3


def seconds_text(seconds: float) -> str:
    """0.000821 -> '0.821 ms': the unit that keeps the figure readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns" if seconds else "0 s"


def bytes_text(count: int) -> str:
    """4788442 -> '4.57 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"


def _targets(counts: Counter, show: int = SHOW) -> str:
    named = ", ".join(t if n == 1 else f"{t} x{n}" for t, n in counts.most_common(show))
    return named + (f", and {len(counts) - show} more" if len(counts) > show else "")


def _where(result: PlanResult, node: str) -> str:
    status = result._status(node)
    return f"node {node!r}" + (status.source if status is not None else "")


def _verdict(result: PlanResult, label: str) -> str:
    """Line 1: PASS or FAIL, the model, the mesh, and where it first went wrong."""
    what = f"the plan for {label} on mesh {list(result.plan.mesh_shape)}" if label else \
        f"the plan on mesh {list(result.plan.mesh_shape)}"
    cov = result.coverage
    if cov is not None and cov.tensor_ops == 0:
        return f"FAIL: {what}: the model has no tensor op, so no plan node ran and nothing was checked"
    first = result.first_divergence()
    if first is None:
        matches = f"{what} matches the single-device model, forward and backward ({_ranks(result)})"
        if result.strict and result.strict_failures:
            return f"FAIL (strict): {matches}, but " + "; ".join(_strict_words(cov))
        if result.shards_nothing:
            return f"PASS, but the plan shards nothing: {matches}; no sharding was checked"
        return f"PASS: {matches}"
    if first.phase == "error":
        text = first.tensor.strip().splitlines()[0] if first.tensor.strip() else "the check stopped"
        where = "" if first.node == "?" else f" (at {_where(result, first.node)})"
        return f"FAIL: {what} could not be checked to the end: {text}{where}"
    if first.phase == "owner":
        return (f"FAIL: {what} differs from the single-device model in backward: {_where(result, first.node)} "
                f"is the first in backward order whose {first.tensor} is wrong")
    error = "" if first.max_abs_err is None else f", max abs error {first.max_abs_err:.3g}"
    return (f"FAIL: {what} differs from the single-device model: the {first.phase} {first.tensor} is first wrong "
            f"at {_where(result, first.node)}{error}")


def _ranks(result: PlanResult) -> str:
    devices = 1
    for size in result.plan.mesh_shape:
        devices *= size
    return f"checked on {devices} {result.backend} ranks"


def _strict_words(cov: Coverage | None) -> list[str]:
    found = []
    if cov is not None and cov.fallbacks:
        found.append(f"{len(cov.fallbacks)} op(s) ran replicated for want of sharding strategies")
    if cov is not None and not cov.sharded:
        found.append("the plan shards nothing")
    return found


def _sharding(cov: Coverage | None, devices: int) -> str:
    """Line 2: how many ops the plan shards and how many run whole on every device, and why."""
    if cov is None:
        return "sharded: not counted (no coverage was taken)"
    handled = cov.count("handled")
    whole = [f"{handled - len(cov.sharded)} by the plan's choice"] if handled > len(cov.sharded) else []
    if cov.count("constant"):
        whole.append(f"{cov.count('constant')} built from constants on every device")
    if cov.fallbacks:
        whole.append(f"{len(cov.fallbacks)} for want of sharding strategies")
    if cov.count("not compared"):
        whole.append(f"{cov.count('not compared')} uninitialised buffer(s), never compared")
    replicated = cov.tensor_ops - len(cov.sharded)
    why = "" if not whole else f" (the plan's choice)" if len(whole) == 1 and "choice" in whole[0] \
        else f" ({', '.join(whole)})"
    return (f"sharded: {len(cov.sharded)} of {cov.tensor_ops} ops split across the {devices} devices; "
            f"replicated: {replicated}{why}")


def _cost(result: PlanResult) -> str:
    """Line 3: the cost model's prediction for the plan picked (at the real size when it was
    solved there)."""
    at_real = result.real_size
    c: PlanCost = at_real.cost if at_real is not None else result.plan.cost
    size = f" at {at_real.label}" if at_real is not None else ""
    return (f"predicted cost{size}: {seconds_text(c.total)} per training step (compute {seconds_text(c.compute)}, "
            f"communication {seconds_text(c.communication)}, resharding {seconds_text(c.resharding)}); "
            f"{bytes_text(c.memory)} per device ({bytes_text(c.weights)} of it weights, gradients and optimizer "
            f"state) on {result.plan.device.label}, {result.plan.workload.label}")


def _coverage(cov: Coverage | None) -> str:
    """Line 4: how many ops have verified sharding strategies, and what was verified at this call
    because no spec had tested its shapes."""
    if cov is None:
        return "coverage: not taken"
    ruled = cov.count("handled") + len(cov.fallbacks)
    if not cov.fallbacks:
        parts = [f"all {ruled} ops that compute have verified sharding strategies"]
    else:
        missing = Counter(s.target for s in cov.fallbacks)
        parts = [f"{cov.count('handled')} of {ruled} ops that compute have verified sharding strategies; "
                 f"{len(cov.fallbacks)} ran replicated without ({_targets(missing)})"]
    pieces = cov.decompositions()
    if pieces:
        parts.append(f"{len(pieces)} op(s) no spec covers as a whole were split into "
                     f"{sum(sum(c.values()) for c in pieces.values())} smaller ones")
    demand = cov.on_demand or {}
    if demand.get("calls"):
        wrong = demand.get("strategies_wrong", 0)
        parts.append(f"{demand['calls']} call(s) at shapes no spec had tested were verified for this model "
                     f"({demand['verified']} in this run, {demand['cache_hits']} remembered from earlier runs), "
                     + (f"{wrong} wrong layout(s) found and not used" if wrong else "no wrong layout found"))
    return "coverage: " + "; ".join(parts)


def _culprit(result: PlanResult) -> str:
    """Line 5 of a failure: the node first wrong, the layout the plan gave it and what moved
    into it."""
    first = result.first_divergence()
    if first is None:
        return ""
    ranks = sorted({m.rank for m in result.mismatches if m.node == first.node})
    on = f"on rank(s) {ranks}" if ranks and ranks != [-1] else "on every rank"
    if first.phase == "error" and first.node == "?":
        return f"first culprit: not known: the check stopped before reaching a node ({on})"
    item = next((n for n in result.plan.nodes if n.node == first.node), None)
    layout = "" if item is None else f", layout {node_label(item, result.coverage)}"
    moved = "" if item is None else ", " + ("; ".join(f"{r.operand} moved {r.source} -> {r.target} by "
                                                    f"{', '.join(map(str, r.steps))}"
                                                    for r in item.reshards if r.steps) or "nothing moved into it")
    status = result._status(first.node)
    op = f" ({status.target})" if status is not None else ""
    return f"first culprit: {_where(result, first.node)}{op}{layout}{moved} ({on})"


def verdict_lines(result: PlanResult, label: str = "", verbose: bool = False) -> list[str]:
    """The verdict, at most :data:`VERDICT_LINES` lines: PASS/FAIL, the mesh and where it first
    went wrong; ops sharded and replicated; the predicted cost; the coverage; the first culprit
    (or, on a pass, where the detail is)."""
    cov = result.coverage
    devices = 1
    for size in result.plan.mesh_shape:
        devices *= size
    last = _culprit(result) or ("detail: every op's layout and what moves between devices follow; --json gives all "
                                "of it" if verbose else "detail: -v lists every op's layout and what moves between "
                                                        "devices; --json gives all of it")
    return [_verdict(result, label), _sharding(cov, devices), _cost(result), _coverage(cov), last]


def _failure_lines(result: PlanResult) -> list[str]:
    """A failure's evidence after the verdict: how many values differ, and a backend's own words."""
    first = result.first_divergence()
    if first is None:
        return []
    lines = [f"  {len(result.mismatches)} value(s) differ from the single-device model in all"]
    if first.phase == "error":
        lines += [f"  {line}" for line in first.tensor.strip().splitlines()[1:]]
    return lines


def _gap_lines(cov: Coverage | None) -> list[str]:
    """Ops that ran replicated for want of sharding strategies, with why: what a user would act on."""
    if cov is None:
        return []
    lines = []
    for s in cov.fallbacks[:SHOW * 4]:
        why = s.reason.replace("no spec has target", "no spec covers")
        lines.append(f"replicated without sharding strategies: {s.node!r} ({s.target}){s.source}: {why}")
    if len(cov.fallbacks) > SHOW * 4:
        lines.append(f"... {len(cov.fallbacks) - SHOW * 4} more (-v lists every op)")
    return lines


def plan_text(result: PlanResult, label: str = "", verbose: bool = False,
              cpu_seconds: dict[str, float] | None = None) -> str:
    """The whole text ``shardverify plan`` prints: the verdict, a failure's evidence, the ops that
    ran without sharding strategies, notes, a real size's summary; with ``verbose`` the op-by-op
    listing and the coverage's detail; the CPU seconds per phase last."""
    lines = verdict_lines(result, label, verbose) + _failure_lines(result) + _gap_lines(result.coverage)
    lines += [f"note: {note}" for note in result.notes]
    if result.real_size is not None:
        lines += result.real_size.lines()
    if verbose:
        lines += detail_lines(result)
    if cpu_seconds:
        lines.append("CPU seconds: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu_seconds.items()))
    return "\n".join(lines)


def detail_lines(result: PlanResult) -> list[str]:
    """What ``-v`` adds: every op's layout and resharding, then the coverage's detail."""
    lines = [describe_plan(result.plan, result.coverage)]
    if result.coverage is not None:
        lines += result.coverage.lines()
    return lines
