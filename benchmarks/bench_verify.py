"""How much does one strategy check cost over the plain torch arithmetic it checks?

For each op (linear, sum: the first cases of their specs) and mesh ((2,2), (2,2,2)), over every
distinct layout the op offers there, it measures in CPU time of this process (every thread's),
in alternating rounds (floor, least check, cold check, warm check; one pass of each over every
layout per round, so a burst of other load falls on all four alike):

  * the floor: plain torch on each rank's own shards.  Before the clock, each rank's block of
    every input and parameter is sliced by the strategy's layouts and made a leaf, and its block
    of the reference output gradient cut; the timed body then calls the plain torch function
    of the case's target directly and takes the gradient of its output, rank after rank,
    with no project code in it.  The call comes from the case's target: a function target
    (``torch.sum``, ``torch.matmul``, a ``torch.Tensor`` method) is called with the case's
    recorded arguments (its params: ``torch.sum(x, dim=(0, 2), keepdim=False)``), a module target
    through its functional form (``torch.nn.Linear`` -> ``F.linear(x, weight, bias)`` on the
    weight and bias shards).  What it cannot express: a module target without an entry in
    ``_functional`` (one whose forward reads configuration off the module: convolutions, norms),
    refused naming the module; a call whose per-rank module attributes change (groups); the
    layout's collectives (a layout whose op cannot run on its bare shards, an input gathered
    before the op, is left out and counted; one whose op runs on them anyway is timed on them,
    as the check's arithmetic less its collectives); a partial input, run as the rank's block
    (the piece the check gives it has that block's shape); index masks and post-added operands
    (run as an ordinary operand of the call),
  * the least check: the floor's calls and, still in plain torch with everything made before
    the clock, the least any check of a rank's own call must add to them: the layout's
    all-reduces (a partial output summed over its rank groups, a gradient over its groups) and
    one comparison of each rank's output and each gradient with its block of the reference's
    bounds, ``expected -/+ (atol + rtol * |expected|)`` at the engine's tolerance (a clamp and
    an equality, the engine's passing comparison).  It leaves out all a real check also does (the
    reference, the blocks, the costs, the dtypes, the seeds, any collective but an all-reduce
    summing: a layout needing another is refused).  Untimed, every layout without a partial input
    (whose rank the floor gives its block, not its piece) must pass it, but for those the engine
    passes only by its low-precision budget (their values leave the default tolerance: at 4x
    linear's shapes, every float32 one), which are counted instead; so the floor -> least ->
    check columns split the check's cost into the op, what a check cannot avoid, and the rest,
  * the check, cold: ``verify_case`` on the simulated backend (every rank in one thread,
    backends/stacked.py) as ``shardverify verify`` runs it, each layout once on fresh caches: a
    new copy of the case and of the strategies per pass, and every table the verify engine
    remembers in (each module-level dict shardverify/verify/ starts empty: its references,
    blocks, pieces, slices, layouts, seeds) emptied before the pass, so the pass builds the
    case's reference and every layout's blocks as the first check of them does (only the traced
    harness, which a run builds to list the strategies, and torch's own caches stay warm),
  * the check, warm: the same, again on the same case copy right after the cold pass (new
    strategy objects, every table filled): what a second check of each layout costs,

on the same layouts (those the floor runs), each reported as ms per layout (min and median
over the rounds) with least/floor, cold/floor, warm/floor and cold/least (the ratio of the
minima and of the medians).
Besides, on the same layouts:

  * strategy generation: CPU seconds to list the row's strategies on a newly traced graph (the
    op's, and its predecessor's, which a following op reads), against the cold check of the
    row's layouts (on the larger-shape rows too: the strategies are the same at any shape); and
    again as a run's later cases pay it, the predecessor's layouts shared from its first,
  * PyTorch DTensor under LocalTensorMode (torch.distributed.tensor on a fake process group):
    the op on the same reference values, each strategy's input and parameter layouts given as
    DTensor placements (mesh axis m sharding tensor dim d -> Shard(d), else Replicate), forward
    and backward, outputs and gradients reconciled and compared.  Its first check of each
    layout runs under --dtensor-budget CPU seconds; a layout DTensor cannot run, or that goes
    over, is left out and counted on its line, as are the layouts past --dtensor-layouts (a
    count; those it tries are spread evenly over the row's), and the DTensor figure is set
    against the warm check timed on exactly the layouts DTensor ran (alternating rounds),
  * the ranks batched: on the layouts whose ranks' calls are alike (blocks of one shape, the same
    other arguments), the floor's calls of every rank as one call, the op under
    ``torch.func.vmap`` on the ranks' blocks stacked on a new leading dim (stacked before the
    clock, checked untimed to give each rank's output and gradients), against the floor on the
    same layouts (alternating rounds).  At the grid's shapes the floor is mostly the cost of a
    call, paid once per rank; this says what the same arithmetic costs paid once per layout, the
    least a check that ran an even layout's ranks together would start from.  Layouts with
    blocks of other shapes or other arguments per rank, and those vmap refuses or computes
    otherwise, are left out and counted,
  * the gloo pool, warm (persistent worker processes, a case's strategies as one batch): wall
    ms per check, the median of --gloo-passes passes (its work runs in other processes, so this
    process's CPU time does not see it; its budget is the count),
  * the same op and mesh on the spec's first case with its free dims multiplied by --scale, as a
    row of its own (scaled_case: the first input's leading dims and the dims of other inputs that
    must match them, never a contracted or feature dim): the grid cases are small, so their ratio
    is mostly what the check costs per call; the larger shape shows what grows with the
    arithmetic (--scaled-only SPEC ...: specs measured in that row alone); a row whose blocks,
    made before the clocks, hold more than --memory-gib is measured in chunks of its layouts
    within it (16x linear's on (2, 2) took over 24 GB at once), counted on the row,
  * on the first mesh, the fresh-processes-per-case baselines (each of the first --fresh-cases
    cases on new gloo processes, spawned per case, and a forkserver pool started per case)
    against one warm pool running the same checks, and the pool start-up against a bare spawn of
    as many gloo processes (wall clock: a start-up is waiting as much as work).

Every budget is CPU time or a count, never the wall clock: a row measures rounds until it has
spent --seconds CPU seconds and run --rounds rounds (the backends' 120 s hang guards are no
budget: one that fires fails the run, it leaves nothing out).  Before the rows, for each op with a loop
written out here (``_hand_loop``: linear, sum), an A/B on the first mesh: that loop against the
floor's timed body on the same shards, alternating, both printed; a disagreement of more than
10% (of the minima) ends the run with exit status 1 (not in --quick, whose rounds are too few to
judge; a loop whose output differs from the floor's fails there too).

Usage: .venv/bin/python benchmarks/bench_verify.py [--meshes 2,2 2,2,2] [--specs linear sum]
       [--ab-specs linear sum] [--cases 1] [--seconds 2] [--rounds 5] [--gloo-passes 5] [--scale 4]
       [--dtensor-layouts 72] [--skip-gloo] [--skip-dtensor] [--json]
       .venv/bin/python benchmarks/bench_verify.py --quick     # CI's smoke run (figures not for quoting)
A figure it cannot measure (no layout ran on the floor or under DTensor, no round timed) ends
the run with exit status 1, never a row left out.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import logging
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Container
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
#: the A/B's limit: the hand-written loop and the floor's body may differ by this fraction (of the minima)
AB_LIMIT = 0.10
#: bytes the floor's and the least check's blocks of a row's layouts may hold at once (--memory-gib):
#: every grid row fits; a larger shape is measured in chunks within it (measure_row)
MEMORY_BYTES = 4 << 30


# ---------------------------------------------------------------------- bare gloo spawn
def _bare_rank(rank: int, world: int, store_path: str, conn) -> None:
    """One bare gloo process: import torch.distributed, join the group, say so, leave."""
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    conn.send(rank)
    conn.recv()   # stay in the group until every rank has joined
    dist.destroy_process_group()


def bare_spawn_seconds(world: int) -> float:
    """Seconds until ``world`` freshly spawned gloo processes have all joined one group."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as folder:
        return _spawn_and_join(ctx, world, folder)


def _spawn_and_join(ctx, world: int, folder: str) -> float:
    """Spawn the ranks on a FileStore in ``folder``, time until all joined, let them leave."""
    began = time.perf_counter()
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_bare_rank, args=(rank, world, os.path.join(folder, "store"), child))
        proc.start()
        procs.append(proc)
        conns.append(parent)
    for conn in conns:
        conn.recv()
    seconds = time.perf_counter() - began
    for conn in conns:
        conn.send(None)
    for proc in procs:
        proc.join(30)
    return seconds


# ------------------------------------------------------------------------- measurements
class Unmeasured(Exception):
    """A figure this run could not measure: the benchmark fails rather than print a row without it."""


class Disagreement(Exception):
    """The A/B found the floor's body and a hand-written torch loop apart by more than AB_LIMIT,
    or the least check failed a layout the engine passes."""


def _spread(pass_seconds: list[float], layouts: int) -> dict:
    """ms per layout of the fastest and of the median pass."""
    if not pass_seconds:
        raise Unmeasured("no pass was timed")
    return {"min": min(pass_seconds) / layouts * 1e3, "median": statistics.median(pass_seconds) / layouts * 1e3}


def _ratio(over: dict, under: dict) -> dict:
    return {"min": over["min"] / under["min"], "median": over["median"] / under["median"]}


def distinct_layouts(strategies: list) -> list:
    """One strategy per layout set: ``verify_case`` checks strategies alike but in name once
    (a following op offers one per predecessor), so timing them all and dividing by their
    count would flatter the check against a floor that runs each layout once."""
    firsts: dict = {}
    for strategy in strategies:
        firsts.setdefault(strategy.layout_key(), strategy)
    return list(firsts.values())


def _fresh(value):
    """A new object equal to ``value`` (a case, a list of strategies): nothing the engine
    remembers per object (by id) is found for it."""
    return pickle.loads(pickle.dumps(value))


def engine_tables() -> list[tuple[str, dict]]:
    """("module.NAME", table) of every table the verify engine remembers in: each module-level
    dict a module of shardverify/verify/ starts empty (``_LAYOUTS: dict = {}``, or a case table:
    ``_BLOCKS: dict = case_table()``), found in the source, so a table added later is emptied too."""
    import shardverify.verify as package

    found = []
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(stmt, ast.AnnAssign):
                target, value = stmt.target, stmt.value
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
            else:
                continue
            empty = isinstance(value, ast.Dict) and not value.keys or \
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "case_table"
            if isinstance(target, ast.Name) and empty:
                table = getattr(importlib.import_module(f"{package.__name__}.{path.stem}"), target.id)
                if isinstance(table, dict):
                    found.append((f"{path.stem}.{target.id}", table))
    if not found:
        raise Unmeasured("found no table of the verify engine to empty for the cold check (shardverify/verify/)")
    return found


# ------------------------------------------------------------------ the floor: plain torch
class PlainCall(NamedTuple):
    """One rank's op call in plain torch, everything it takes made before the clock: ``fn(*args,
    **kwargs)``, the outputs carrying a gradient (``pick``: their positions in a tuple result,
    None for a single tensor), the leaves and the output gradient blocks."""

    fn: object
    args: tuple
    kwargs: dict
    pick: tuple | None
    leaves: tuple
    grads: tuple


class FloorLayout(NamedTuple):
    """One layout on the floor: each rank's call, and its shards by operand locator (the A/B's
    hand-written loop reads them)."""

    case: object
    strategy: object
    calls: tuple
    shards: tuple


def floor_body(calls) -> None:
    """The floor's timed work: each rank's op and the gradient of its output, plain torch."""
    import torch

    grad = torch.autograd.grad
    for fn, args, kwargs, pick, leaves, grads in calls:
        out = fn(*args, **kwargs)
        if pick is not None:
            out = [out[i] for i in pick]
        if leaves:
            grad(out, leaves, grads, allow_unused=True)


def _functional() -> dict:
    """Module target -> (its functional form, the module's tensors it takes after the inputs,
    in order; an absent one passed as None): modules whose forward is that call on its input
    and tensors alone."""
    import torch
    import torch.nn.functional as F

    return {torch.nn.Linear: (F.linear, ("weight", "bias"))}


def plain_target(case, node, module) -> tuple[object, tuple[str, ...] | None]:
    """(the plain torch callable of the case's target, the module tensor names it takes after the
    call's arguments, or None for a function target), checked against the captured node."""
    import torch

    from shardverify.spec.case import resolve

    target = resolve(case.target)
    if isinstance(target, type):
        found = _functional().get(target)
        if found is None:
            raise Unmeasured(f"{case.op}: the floor has no functional form of module {case.target} "
                             f"(benchmarks/bench_verify.py _functional knows {[t.__name__ for t in _functional()]})")
        if node.op != "call_module" or type(module) is not target:
            raise Unmeasured(f"{case.op}: node {node.name!r} is a {node.op} of {type(module).__name__}, "
                             f"not of the case's target {case.target}")
        return found
    called = node.target if node.op == "call_function" else \
        getattr(torch.Tensor, node.target, None) if node.op == "call_method" else None
    if called is not target:
        raise Unmeasured(f"{case.op}: node {node.name!r} calls {node.target!r}, not the case's target {case.target}")
    return target, None


def plain_calls(case, strategy, mesh) -> FloorLayout:
    """Each rank's :class:`PlainCall` of ``strategy`` and its shards: its block of every input and
    parameter (a leaf where floating and not constant), its local non-tensor arguments, and its
    block of the reference output gradient in the output's dtype, all made now (before any clock).
    Which outputs carry a gradient is settled by :func:`settle` (a call, so it may raise)."""
    import torch

    from shardverify.capture.call import call_parts, called_module
    from shardverify.verify.rank import local_arguments
    from shardverify.verify.reference import reference

    ref = reference(case, None, torch.device("cpu"))
    node = ref.node
    module = called_module(ref.graph_module, node)
    fn, tensor_names = plain_target(case, node, module)
    calls, shards = [], []
    for rank in range(mesh.size):
        values, leaves = {}, []
        for data in strategy.inputs:
            loc = (data.locator.kind, data.locator.key)
            block = strategy.get_sharding_spec_by_name(data.name).local_shard(ref.typed(loc), mesh, rank).clone()
            if (block.is_floating_point() or block.is_complex()) and loc not in ref.constant:
                leaves.append(block.requires_grad_())
            values[loc] = block
        shards.append(dict(values))
        values.update(local_arguments(strategy, rank))
        args, kwargs, tensors = call_parts(node, module, values)
        if tensor_names is not None:
            extra = set(tensors) - set(tensor_names)
            if extra:
                raise Unmeasured(f"{case.op}: module {case.target} holds {sorted(extra)}, which its functional "
                                 f"form does not take")
            args = (*args, *(tensors.get(name) for name in tensor_names))
        grads = tuple(None if g is None else strategy.get_sharding_spec_by_name(d.name).local_shard(g, mesh, rank)
                      for d, g in zip(strategy.outputs, ref.grad_outputs))
        calls.append(PlainCall(fn, args, kwargs, None, tuple(leaves), grads))
    return FloorLayout(case, strategy, tuple(calls), tuple(shards))


def settle(layout: FloorLayout) -> FloorLayout:
    """``layout`` with each rank's outputs carrying a gradient picked and their gradient blocks
    in the outputs' dtypes, found by calling the op once per rank (raises where the op cannot run
    on the bare shards, or its output does not fit the layout's gradient block)."""
    settled = []
    for fn, args, kwargs, _, leaves, grads in layout.calls:
        result = fn(*args, **kwargs)
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        carrying = [i for i, (out, g) in enumerate(zip(outputs, grads)) if g is not None and out.requires_grad]
        for i in carrying:
            if outputs[i].shape != grads[i].shape:
                raise ValueError(f"output {i} of shape {tuple(outputs[i].shape)} on the bare shards, the layout's "
                                 f"block is {tuple(grads[i].shape)}")
        pick = tuple(carrying) if isinstance(result, (list, tuple)) else None
        if not carrying:
            leaves = ()
        settled.append(PlainCall(fn, args, kwargs, pick,
                                 leaves, tuple(grads[i].to(outputs[i].dtype) for i in carrying)))
    return layout._replace(calls=tuple(settled))


def floor_layout(case, strategy, mesh) -> FloorLayout | None:
    """``strategy``'s layout on the floor, run once (forward and backward); None where it cannot
    run (its op needs the layout's collectives)."""
    prepared = plain_calls(case, strategy, mesh)   # outside the try: a change of the engine's API fails
    try:
        prepared = settle(prepared)
        floor_body(prepared.calls)
    except Exception as exc:  # noqa: BLE001 - a layout whose op needs its collectives
        if os.environ.get("BENCH_DEBUG"):
            print("floor:", strategy.name, type(exc).__name__, str(exc).splitlines()[0][:200], file=sys.stderr)
        return None
    return prepared


def _none_ran(left_out: int) -> Unmeasured:
    return Unmeasured(f"the floor ran none of the {left_out} layouts (BENCH_DEBUG=1 says why)")


def floor_layouts(mesh, cases_and_strategies) -> tuple[list[FloorLayout], int]:
    """The layouts the floor runs (:func:`floor_layout`) and how many it cannot; none at all is
    refused (Unmeasured)."""
    runnable, left_out = [], 0
    for case, strategies in cases_and_strategies:
        for strategy in strategies:
            made = floor_layout(case, strategy, mesh)
            if made is None:
                left_out += 1
            else:
                runnable.append(made)
    if not runnable:
        raise _none_ran(left_out)
    return runnable, left_out


# ------------------------------------------- the least check: what any per-rank check must do
class LeastLayout(NamedTuple):
    """One layout's least check, everything made before the clock: the floor's calls; per output
    carrying a gradient, the rank groups its forward all-reduce sums over (None: none); per leaf
    (the floor's leaves, in order), the groups its gradient's all-reduce sums over; each rank's
    bounds ``(low, high)`` of those outputs and gradients; whether its verdict is judged (no
    partial input: the floor gives a partial input's rank its block, not its piece; and not one
    the engine passes only by its low-precision budget, whose values leave these bounds)."""

    calls: tuple
    out_groups: tuple
    leaf_groups: tuple
    out_bounds: tuple
    grad_bounds: tuple
    judged: bool


def _groups_of(mesh, actions, pattern, name: str):
    """The rank groups of the all-reduces of ``pattern`` on operand ``name`` (their mesh axes
    together), None without one; raises for a reduction other than a sum."""
    axes = []
    for action in actions:
        if action.pattern is pattern and action.operand == name:
            if action.op != "sum":
                raise Unmeasured(f"the least check sums its all-reduces; {name!r} is reduced by {action.op}")
            axes += action.axes
    return mesh.groups(tuple(sorted(set(axes)))) if axes else None


def _bounds(full, spec, mesh, rank: int, dtype, tol) -> tuple:
    """``rank``'s block of the float64 reference ``full`` as bounds ``expected -/+ (atol + rtol *
    |expected|)`` in ``dtype`` (the engine's rule; its float32 rounding inward is left out)."""
    expected = spec.local_shard(full, mesh, rank)
    allowed = expected.abs() * tol.rtol + tol.atol
    return (expected - allowed).to(dtype), (expected + allowed).to(dtype)


def least_layouts(mesh, runnable: list[FloorLayout], budgeted: Container[tuple[int, str]] = ()) -> list[LeastLayout]:
    """The least check of each floor layout: its forward all-reduces (``ALLREDUCE_FWD_IDENTITY_BWD``
    on an output) and gradient all-reduces (``IDENTITY_FWD_ALLREDUCE_BWD`` on an input), as sums
    over their rank groups, and one bounds comparison per output and per gradient of each rank,
    at the engine's tolerance.  A layout with any other collective is refused (Unmeasured).
    ``budgeted``: ``(id(case), strategy name)`` of the layouts the engine passes only by its
    low-precision budget (:func:`budget_passes`): timed like the others, never judged."""
    import torch

    from shardverify.sharding.strategy import CommPattern
    from shardverify.verify.reference import reference
    from shardverify.verify.tolerance import tolerance_for

    made = []
    for layout in runnable:
        strategy, case = layout.strategy, layout.case
        other = {a.pattern.name for a in strategy.communication_actions} - \
            {CommPattern.ALLREDUCE_FWD_IDENTITY_BWD.name, CommPattern.IDENTITY_FWD_ALLREDUCE_BWD.name}
        if other:
            raise Unmeasured(f"{case.op}: the least check runs all-reduces only; {strategy.name!r} needs "
                             f"{sorted(other)}")
        ref = reference(case, None, torch.device("cpu"))
        actions = strategy.communication_actions
        pick = layout.calls[0].pick
        outputs = [(i, strategy.outputs[i]) for i in (pick if pick is not None else (0,))]
        leaf_ids = {id(leaf) for leaf in layout.calls[0].leaves}   # plain_calls makes them in input order
        leaves = [d for d in strategy.inputs if id(layout.shards[0].get((d.locator.kind, d.locator.key))) in leaf_ids]
        out_groups = tuple(_groups_of(mesh, actions, CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, d.name)
                           for _, d in outputs)
        leaf_groups = tuple(_groups_of(mesh, actions, CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, d.name) for d in leaves)
        out_bounds, grad_bounds = [], []
        for rank, call in enumerate(layout.calls):
            dtypes = [g.dtype for g in call.grads]
            out_bounds.append(tuple(
                _bounds(ref.outputs[i], strategy.get_sharding_spec_by_name(d.name), mesh, rank, dtype,
                        tolerance_for(dtype, case.rtol, case.atol)) for (i, d), dtype in zip(outputs, dtypes)))
            grad_bounds.append(tuple(
                _bounds(ref.grads[(d.locator.kind, d.locator.key)], strategy.get_sharding_spec_by_name(d.name), mesh,
                        rank, leaf.dtype, tolerance_for(leaf.dtype, case.rtol, case.atol))
                for d, leaf in zip(leaves, call.leaves)))
        made.append(LeastLayout(layout.calls, out_groups, leaf_groups, tuple(out_bounds), tuple(grad_bounds),
                                not strategy.partial_inputs and (id(case), strategy.name) not in budgeted))
    return made


def budget_passes(results) -> set[tuple[int, str]]:
    """``(id(case), strategy name)`` of each passed check whose note says it passed only by the
    engine's low-precision budget (verify/engine.py ``_verdict``: "... differences are within 8 x
    the ..."), its values outside the default tolerance; a note may say other things (the seeds a
    case needed, a worker replaced).  At 4x the grid's leading dims most of linear's float32
    layouts pass so; the least check compares at the default tolerance, so it cannot judge them."""
    from shardverify.verify.precision import BUDGET_FACTOR

    said = f"differences are within {BUDGET_FACTOR:g} x the"
    return {(id(case), result.strategy) for case, found in results for result in found
            if result.passed and said in result.note}


def _summed(per_rank: list[list], position: int, groups) -> None:
    """Each rank's tensor at ``position`` replaced by the sum over its group (in group order)."""
    for group in groups:
        total = per_rank[group[0]][position]
        for rank in group[1:]:
            total = total + per_rank[rank][position]
        for rank in group:
            per_rank[rank][position] = total


def least_body(layouts) -> list[bool]:
    """The least check's timed work, plain torch: each rank's op (the floor's call), the
    layout's forward all-reduces, one comparison of each rank's output with its bounds (a clamp
    and an equality), the backward of each rank, the gradients' all-reduces and one comparison
    of each gradient.  Whether each layout's comparisons all passed."""
    import torch

    grad, equal = torch.autograd.grad, torch.equal
    verdicts = []
    for calls, out_groups, leaf_groups, out_bounds, grad_bounds, _ in layouts:
        results, passed = [], True
        for fn, args, kwargs, pick, leaves, grads in calls:
            out = fn(*args, **kwargs)
            results.append([out[i] for i in pick] if pick is not None else [out])
        values = [[t.detach() for t in outs] for outs in results]
        for position, groups in enumerate(out_groups):
            if groups is not None:
                _summed(values, position, groups)
        for outs, bounds in zip(values, out_bounds):
            for t, (low, high) in zip(outs, bounds):
                passed = equal(t.clamp(low, high), t) and passed
        gradients = [list(grad(outs, call.leaves, call.grads, allow_unused=True)) if call.leaves else []
                     for outs, call in zip(results, calls)]
        for position, groups in enumerate(leaf_groups):
            if groups is not None:
                _summed(gradients, position, groups)
        for grads, bounds in zip(gradients, grad_bounds):
            for g, (low, high) in zip(grads, bounds):
                if g is not None:
                    passed = equal(g.clamp(low, high), g) and passed
        verdicts.append(passed)
    return verdicts


def check_least(op: str, layouts: list[LeastLayout]) -> int:
    """The number of judged layouts, each of which must pass its least check (its collectives
    and bounds are the engine's, so a layout the engine passes passes here)."""
    verdicts = least_body(layouts)
    failed = [i for i, (layout, ok) in enumerate(zip(layouts, verdicts)) if layout.judged and not ok]
    if failed:
        raise Disagreement(f"{op}: the least check fails {len(failed)} layout(s) the engine passes "
                           f"(first: layout {failed[0]})")
    return sum(layout.judged for layout in layouts)


# --------------------------------------------------------- the A/B: a loop written out by hand
def _hand_loop(op: str, case):
    """A plain torch loop for ``op`` written out here, sharing nothing with the floor but the
    shards it runs on: a function of [(shards by locator, gradient block)] per rank that runs
    the op and its backward and returns the outputs; None for an op without one."""
    import torch
    import torch.nn.functional as F

    params = dict(case.params)
    if op == "sum":
        dim, keepdim = params.get("dim"), params.get("keepdim", False)

        def run_sum(ranks):
            outs = []
            for shards, grad in ranks:
                x = shards[("arg", 0)]
                out = torch.sum(x, dim, keepdim)
                torch.autograd.grad(out, x, grad)
                outs.append(out)
            return outs
        return run_sum
    if op == "linear":
        def run_linear(ranks):
            outs = []
            for shards, grad in ranks:
                x, w, b = shards[("arg", 0)], shards[("param", "weight")], shards.get(("param", "bias"))
                out = F.linear(x, w, b)
                torch.autograd.grad(out, [x, w] if b is None else [x, w, b], grad)
                outs.append(out)
            return outs
        return run_linear
    return None


def alternating(bodies: dict, seconds: float, rounds: int) -> dict[str, list[float]]:
    """CPU seconds of each body, one run of each a round (which goes first swaps every round, so a
    burst of other load falls on both alike), until ``seconds`` are spent and ``rounds`` rounds run."""
    timed: dict[str, list[float]] = {name: [] for name in bodies}
    order, start = list(bodies), time.process_time()
    while time.process_time() - start < seconds or len(timed[order[-1]]) < rounds:
        for name in order:
            began = time.process_time()
            bodies[name]()
            timed[name].append(time.process_time() - began)
        order.reverse()
    return timed


def ab_check(op: str, layouts: list[FloorLayout], seconds: float, rounds: int) -> dict | None:
    """The hand-written loop of ``op`` against the floor's body on the floor's shards, alternating
    (which goes first swaps every round), in CPU time: ms per layout of each (min, median) and
    floor/hand; None for an op without a hand-written loop.  Their outputs must be equal first."""
    import torch

    hand = _hand_loop(op, layouts[0].case)
    if hand is None:
        return None
    work = [(shards, call.grads[0]) for layout in layouts for shards, call in zip(layout.shards, layout.calls)]
    calls = [call for layout in layouts for call in layout.calls]
    for (fn, args, kwargs, *_), out in zip(calls, hand(work)):
        if not torch.equal(fn(*args, **kwargs), out):
            raise Disagreement(f"{op}: the hand-written loop's output differs from the floor's call's")
    timed = alternating({"floor": lambda: floor_body(calls), "hand": lambda: hand(work)}, seconds, rounds)
    floor, hand_ms = _spread(timed["floor"], len(layouts)), _spread(timed["hand"], len(layouts))
    return {"layouts": len(layouts), "rounds": len(timed["hand"]), "floor_ms": floor, "hand_ms": hand_ms,
            "floor_over_hand": _ratio(floor, hand_ms)}


def check_agreement(op: str, ab: dict) -> None:
    """Raise :class:`Disagreement` where the A/B's minima differ by more than AB_LIMIT."""
    apart = abs(ab["floor_over_hand"]["min"] - 1)
    if apart > AB_LIMIT:
        raise Disagreement(f"{op}: the floor's body and the hand-written loop differ by {apart:.0%} (over "
                           f"{AB_LIMIT:.0%}) on the same shards")


# --------------------------------------------- ranks batched: every rank's call in one call
class BatchedLayout(NamedTuple):
    """A layout whose ranks' calls are alike (the same shapes, dtypes and other arguments), as one
    call over the stacked blocks: ``fn(*args)`` (the op under ``torch.func.vmap``), the outputs
    carrying a gradient (``pick``), the stacked leaves and the stacked output gradient blocks."""

    fn: object
    args: tuple
    pick: tuple | None
    leaves: tuple
    grads: tuple


def _alike(calls) -> bool:
    """Whether every rank's call takes tensors of one shape and dtype at each position, and the
    same other arguments (an even layout: the ranks' blocks stack)."""
    import torch

    first = calls[0]
    if any(isinstance(v, torch.Tensor) for v in first.kwargs.values()):
        return False
    for call in calls[1:]:
        if call.kwargs != first.kwargs or call.pick != first.pick or len(call.args) != len(first.args) or \
                len(call.grads) != len(first.grads):
            return False
        for mine, theirs in zip(call.args, first.args):
            if isinstance(mine, torch.Tensor) != isinstance(theirs, torch.Tensor):
                return False
            if isinstance(mine, torch.Tensor):
                if mine.shape != theirs.shape or mine.dtype != theirs.dtype or \
                        mine.requires_grad != theirs.requires_grad:
                    return False
            elif mine != theirs:
                return False
        if any(g.shape != h.shape for g, h in zip(call.grads, first.grads)):
            return False
    return True


def batched_layout(layout: FloorLayout) -> BatchedLayout | None:
    """The floor's calls of ``layout`` as one vmapped call on the ranks' stacked blocks (made now,
    before any clock), checked to give every rank's output and gradients; None where the ranks'
    calls are not alike (ragged blocks, other arguments per rank), or where vmap refuses the op
    or gives other values."""
    import torch

    calls = layout.calls
    if not _alike(calls):
        return None
    first = calls[0]
    tensor_at = [i for i, a in enumerate(first.args) if isinstance(a, torch.Tensor)]
    args, leaves = list(first.args), []
    for i in tensor_at:
        stacked = torch.stack([call.args[i].detach() for call in calls])
        if first.leaves and first.args[i].requires_grad:   # a leaf where the rank's block is one
            leaves.append(stacked.requires_grad_())
        args[i] = stacked
    fn, kwargs = first.fn, first.kwargs
    mapped = torch.func.vmap(lambda *a: fn(*a, **kwargs),
                             in_dims=tuple(0 if i in tensor_at else None for i in range(len(args))))
    grads = tuple(torch.stack([call.grads[k] for call in calls]) for k in range(len(first.grads)))
    made = BatchedLayout(mapped, tuple(args), first.pick, tuple(leaves), grads)
    try:   # the same values as the ranks' own calls, or it is no floor of them
        out, found = _batched_run(made)
        for rank, call in enumerate(calls):
            own = call.fn(*call.args, **call.kwargs)
            own = [own[i] for i in call.pick] if call.pick is not None else [own]
            own_grads = torch.autograd.grad(own, call.leaves, call.grads, allow_unused=True) if call.leaves else ()
            for mine, theirs in zip(own, out):
                torch.testing.assert_close(mine, theirs[rank])
            for mine, theirs in zip(own_grads, found):
                if mine is not None:
                    torch.testing.assert_close(mine, theirs[rank])
    except Exception as exc:  # noqa: BLE001 - vmap refuses the op, or gives other values
        if os.environ.get("BENCH_DEBUG"):
            print("batched:", layout.strategy.name, type(exc).__name__, str(exc).splitlines()[0][:200],
                  file=sys.stderr)
        return None
    return made


def _batched_run(made: BatchedLayout) -> tuple[list, tuple]:
    import torch

    out = made.fn(*made.args)
    out = [out[i] for i in made.pick] if made.pick is not None else [out]
    found = torch.autograd.grad(out, made.leaves, made.grads, allow_unused=True) if made.leaves else ()
    return out, found


def batched_body(layouts: list[BatchedLayout]) -> None:
    """The batched floor's timed work: each layout's one call and the gradient of its output."""
    import torch

    grad = torch.autograd.grad
    for fn, args, pick, leaves, grads in layouts:
        out = fn(*args)
        if pick is not None:
            out = [out[i] for i in pick]
        if leaves:
            grad(out, leaves, grads, allow_unused=True)


def batched_ab(mesh, pairs: list[tuple], seconds: float, rounds: int) -> dict:
    """The floor against the ranks batched (:func:`batched_layout`) on the layouts both run,
    alternating (which goes first swaps every round), in CPU time: ms per layout of each (min,
    median), batched/floor, and how many layouts were left out, and why."""
    floors, batched, unlike, refused = [], [], 0, 0
    for case, strategy in pairs:
        floor = settle(plain_calls(case, strategy, mesh))
        if not _alike(floor.calls):
            unlike += 1
            continue
        made = batched_layout(floor)
        if made is None:
            refused += 1
            continue
        floors.append(floor)
        batched.append(made)
    row = {"layouts": len(batched), "unlike": unlike, "refused": refused}
    if not batched:
        return row
    calls = [call for layout in floors for call in layout.calls]
    timed = alternating({"floor": lambda: floor_body(calls), "batched": lambda: batched_body(batched)}, seconds,
                        rounds)
    row.update({"rounds": len(timed["batched"]), "floor_ms": _spread(timed["floor"], len(batched)),
                "batched_ms": _spread(timed["batched"], len(batched))})
    row["batched_over_floor"] = _ratio(row["batched_ms"], row["floor_ms"])
    return row


def batched_note(found: dict) -> str:
    left = f"left out: {found['unlike']} whose ranks' calls differ (ragged blocks, or other arguments per rank), " \
           f"{found['refused']} vmap refuses or computes otherwise"
    if not found["layouts"]:
        return f"ranks batched: no layout measured ({left})"
    return (f"ranks batched: {found['layouts']} layouts, every rank's call as one torch.func.vmap call on the "
            f"stacked blocks, {_pair(found['batched_ms'], 3)} ms per layout against the floor's "
            f"{_pair(found['floor_ms'], 3)} on the same layouts ({found['rounds']} alternating rounds): "
            f"batched/floor {_pair(found['batched_over_floor'], 2)}; {left}")


# ----------------------------------------------------------------------- floor, cold, warm
def held_bytes(values, besides: set[int] = frozenset()) -> int:
    """Bytes of the distinct tensor storages in ``values`` (tuples, lists, dicts and NamedTuples
    of them, anything else ignored), leaving out those whose data pointer is in ``besides``."""
    import torch

    seen, total, left = set(besides), 0, [values]
    while left:
        value = left.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(value, dict):
            left.extend(value.values())
        elif isinstance(value, (tuple, list)):
            left.extend(value)
    return total


def _reference_storages(case) -> set[int]:
    """The data pointers of the tensors the case's reference holds (kept for the whole run)."""
    import torch

    from shardverify.verify.reference import reference

    return {t.untyped_storage().data_ptr() for t in reference(case, None, torch.device("cpu")).tensors()}


def sized_layouts(mesh, cases_and_strategies) -> tuple[list[tuple], int, list[int]]:
    """``(case, strategy)`` of each layout the floor runs, how many it cannot run, and the bytes
    each runnable layout's floor and least check hold besides the case's reference: each is made
    alone and let go, so sizing a row never holds more than one layout's blocks."""
    pairs, sizes, left_out = [], [], 0
    for case, strategies in cases_and_strategies:
        for strategy in strategies:
            layout = floor_layout(case, strategy, mesh)
            if layout is None:
                left_out += 1
                continue
            least = least_layouts(mesh, [layout])
            pairs.append((case, strategy))
            sizes.append(held_bytes((layout.calls, layout.shards, least), _reference_storages(case)))
    if not pairs:
        raise _none_ran(left_out)
    return pairs, left_out, sizes


def chunked(sizes: list[int], budget: int) -> list[list[int]]:
    """The layouts' indices in order, cut into runs whose bytes stay within ``budget`` (a layout
    over it alone in its run)."""
    chunks: list[list[int]] = []
    held = budget + 1
    for index, size in enumerate(sizes):
        if held + size > budget:
            chunks.append([])
            held = 0
        chunks[-1].append(index)
        held += size
    return chunks


def measure_row(simulated, mesh, cases_and_strategies, seconds: float, rounds: int,
                memory: int = MEMORY_BYTES) -> dict:
    """Floor, least check, cold check and warm check (module docstring) in alternating rounds on
    the layouts the floor runs, until ``seconds`` CPU seconds and ``rounds`` rounds are spent: ms
    per layout (min, median) of each, the ratios, and how many layouts the floor left out.

    The floor's and the least check's blocks of every layout are made before the clock, and at
    larger shapes they do not all fit in memory (16x linear's leading dims on (2, 2): over 24 GB):
    layouts whose blocks hold more than ``memory`` bytes are measured in chunks within it, each
    round passing over every chunk in turn (its blocks made before, and let go after, its clocks),
    the engine's tables emptied once per round on one copy of each case, so the cold pass builds
    each case's reference once and meets each layout once, as ``verify`` does."""
    from shardverify.verify.engine import verify_case
    from shardverify.verify.report import assert_passed

    pairs, left_out, sizes = sized_layouts(mesh, cases_and_strategies)
    chunks = chunked(sizes, memory)
    cases = {id(case): case for case, _ in pairs}
    untimed = []
    for key, case in cases.items():   # untimed: every check must pass, and torch's own first-call costs go
        untimed.append((case, verify_case(simulated, case, _fresh([s for c, s in pairs if id(c) == key]))))
        assert_passed(untimed[-1][1])
    budgeted = budget_passes(untimed)
    made_once = _made(mesh, pairs, budgeted) if len(chunks) == 1 else None   # one chunk: made for every round
    judged = unjudged = 0
    for chunk in chunks:   # every judged verdict once, chunk by chunk
        _, least = made_once or _made(mesh, [pairs[i] for i in chunk], budgeted)
        judged += check_least(pairs[0][0].op, least)
        unjudged += sum(not layout.judged and not pairs[i][1].partial_inputs for i, layout in zip(chunk, least))
        del least
    tables = engine_tables()
    timed: dict[str, list[float]] = {"floor": [], "least": [], "cold": [], "warm": []}
    start = time.process_time()
    while time.process_time() - start < seconds or len(timed["warm"]) < rounds:
        copies = {key: _fresh(case) for key, case in cases.items()}   # the round's cases: one reference a pass
        for spent in timed.values():
            spent.append(0.0)
        for _, table in tables:
            table.clear()
        for chunk in chunks:
            floor, least = made_once or _made(mesh, [pairs[i] for i in chunk], budgeted)
            calls = [call for layout in floor for call in layout.calls]
            by_case: dict[int, list] = {}
            for i in chunk:
                by_case.setdefault(id(pairs[i][0]), []).append(pairs[i][1])
            checks = [(copies[key], _fresh(strategies), _fresh(strategies)) for key, strategies in by_case.items()]
            began = time.process_time()
            floor_body(calls)
            timed["floor"][-1] += time.process_time() - began
            began = time.process_time()
            least_body(least)
            timed["least"][-1] += time.process_time() - began
            for phase, index in (("cold", 1), ("warm", 2)):   # warm: the cold pass's case copy, its tables filled
                results, began = [], time.process_time()
                for made in checks:
                    results.append(verify_case(simulated, made[0], made[index]))
                timed[phase][-1] += time.process_time() - began
                for found in results:
                    assert_passed(found)
            del floor, least, calls
    layouts = len(pairs)
    row = {"layouts": layouts, "floor_left_out": left_out, "rounds": len(timed["warm"]), "least_judged": judged,
           "least_budgeted": unjudged, "chunks": len(chunks), "memory_gib": memory / 2**30,
           "held_gib": sum(sizes) / 2**30, "tables_emptied": [name for name, _ in tables]}
    for phase, seconds_list in timed.items():
        row[f"{phase}_ms"] = _spread(seconds_list, layouts)
    row["cold_over_floor"] = _ratio(row["cold_ms"], row["floor_ms"])
    row["warm_over_floor"] = _ratio(row["warm_ms"], row["floor_ms"])
    row["least_over_floor"] = _ratio(row["least_ms"], row["floor_ms"])
    row["cold_over_least"] = _ratio(row["cold_ms"], row["least_ms"])
    row["warm_over_least"] = _ratio(row["warm_ms"], row["least_ms"])
    row["cold_over_warm"] = _ratio(row["cold_ms"], row["warm_ms"])
    row["runnable"] = pairs
    return row


def _made(mesh, pairs: list[tuple], budgeted) -> tuple[list[FloorLayout], list[LeastLayout]]:
    """The floor's and the least check's layouts of ``pairs`` (each known to run on the floor)."""
    floor = [settle(plain_calls(case, strategy, mesh)) for case, strategy in pairs]
    return floor, least_layouts(mesh, floor, budgeted)


# --------------------------------------------------------------------------------- DTensor
def _placements(spec, mesh_ndim: int):
    from torch.distributed.tensor import Replicate, Shard

    owner = {axis: dim for dim, axes in spec.dim_partition for axis in axes}
    return [Shard(owner[m]) if m in owner else Replicate() for m in range(mesh_ndim)]


def _plain(tensor):
    """One tensor from every rank's identical copy (a LocalTensor), or the tensor itself."""
    return tensor.reconcile() if hasattr(tensor, "reconcile") else tensor


class _TooSlow(Exception):
    pass


@contextlib.contextmanager
def _budget(seconds: float):
    """Raise _TooSlow in this (the main) thread once ``seconds`` of CPU time have passed (a loaded
    machine's waits do not count: they would leave out layouts that need little work), but only
    while this file's own code runs: raised inside torch (Python code torch's C++ called, LocalTensorMode's
    dispatch), the exception crosses a C++ frame that cannot pass it on and the process aborts
    ("terminate called after throwing ... _TooSlow"). Until this file's code runs again the alarm
    re-arms every 10 ms, so a layout is cut between DTensor calls; past 3 x ``seconds`` of CPU time
    it is cut wherever it is."""
    from shardverify.backends.signals import deadline

    here = os.path.abspath(__file__)
    with deadline(seconds, lambda: _TooSlow(f"over {seconds:g} CPU s"), hard_after=3 * seconds, cpu=True,
                  only_where=lambda frame: frame is not None and os.path.abspath(frame.f_code.co_filename) == here):
        yield


def _mode_stacks() -> tuple[int, int]:
    """The depths of this thread's torch dispatch mode stack and of LocalTensorMode's own list."""
    import torch
    from torch.distributed._local_tensor import get_local_tensor_mode_list

    return torch._C._len_torch_dispatch_stack(), len(get_local_tensor_mode_list())


def _restore_mode_stacks(depths: tuple[int, int]) -> None:
    """Back to ``depths`` (:func:`_mode_stacks`): a layout cut by the budget's hard limit inside
    LocalTensorMode's own enter or exit leaves it entered (its DeviceMesh and RNG functions
    patched, its dispatch on this thread), and every tensor made after it, the floor's and the
    fresh-processes baseline's, was a LocalTensor (seen once: the floor 5x slower, then
    "Cannot convert local tensor to list")."""
    import torch
    from torch.distributed._local_tensor import get_local_tensor_mode_list
    from torch.utils._python_dispatch import _pop_mode

    dispatch, local = depths
    modes = get_local_tensor_mode_list()
    while len(modes) > local:
        modes.pop().disable_()
    while torch._C._len_torch_dispatch_stack() > dispatch:
        _pop_mode()


def evenly(items: list, most: int) -> list:
    """At most ``most`` of ``items``, evenly spaced over them (all of them when they are fewer)."""
    if len(items) <= most:
        return list(items)
    return [items[i * len(items) // most] for i in range(most)]


def dtensor_row(simulated, mesh_shape, layouts: list[tuple], seconds: float, rounds: int,
                budget: float = 2.0, most: int = 72) -> dict:
    """DTensor LocalTensorMode on the same ops, values and layouts (module docstring) against the
    warm check on the layouts DTensor ran, alternating: ms per layout (min, median) of each, the
    ratio, and how many of ``layouts`` ((case, strategy) pairs) DTensor cannot run, how many took
    it over ``budget`` CPU seconds for its first check (its sharding propagation searches
    redistribution paths, which explodes on 3-D meshes: a first check of a linear layout on
    (2, 2, 2) takes it about 1.7 CPU s) and how many were not tried (past ``most``, a count:
    those tried are spread evenly over ``layouts``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DeviceMesh, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardverify.capture.call import as_outputs, call_op, called_module
    from shardverify.verify.engine import verify_case
    from shardverify.verify.reference import reference
    from shardverify.verify.report import assert_passed

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)   # "suboptimal" notes
    world = 1
    for size in mesh_shape:
        world *= size
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))

        def check(case, strategy) -> None:
            ref = reference(case, None, torch.device("cpu"))
            module = called_module(ref.graph_module, ref.node)
            with LocalTensorMode(frozenset(range(world))):
                leaves = {}
                for data in strategy.inputs:
                    loc = (data.locator.kind, data.locator.key)
                    spec = strategy.get_sharding_spec_by_name(data.name)
                    value = distribute_tensor(ref.typed(loc), mesh, _placements(spec, len(mesh_shape)))
                    leaves[loc] = value.requires_grad_() if value.is_floating_point() else value
                outputs = as_outputs(ref.node, call_op(ref.node, module, leaves))
                grad_outs = [distribute_tensor(g.to(out.dtype), mesh, out.placements)
                             for out, g in zip(outputs, ref.grad_outputs)]
                wanted = [loc for loc, leaf in leaves.items() if leaf.requires_grad]
                grads = torch.autograd.grad(outputs, [leaves[loc] for loc in wanted], grad_outs)
                full_out = [out.full_tensor() for out in outputs]
                full_grads = [g.full_tensor() for g in grads]
            for got, want in zip(full_out, ref.outputs):
                torch.testing.assert_close(_plain(got).double(), want, rtol=1e-5, atol=1e-4)
            for loc, got in zip(wanted, full_grads):
                torch.testing.assert_close(_plain(got).double(), ref.grads[loc], rtol=1e-5, atol=1e-4)

        runnable, cannot, over, tried = [], 0, 0, evenly(layouts, most)
        for case, strategy in tried:   # its first check: DTensor caches sharding propagation
            modes = _mode_stacks()
            try:
                with _budget(budget):
                    check(case, strategy)
            except Exception as exc:  # noqa: BLE001 - a layout DTensor cannot run (e.g. a view of a doubly sharded dim)
                _restore_mode_stacks(modes)
                if os.environ.get("BENCH_DEBUG"):
                    print("DTensor:", strategy.name, type(exc).__name__, str(exc).splitlines()[0][:200],
                          file=sys.stderr)
                if isinstance(exc, _TooSlow):
                    over += 1
                else:
                    cannot += 1
            else:
                runnable.append((case, strategy))
        if not runnable:
            raise Unmeasured(f"DTensor ran none of the {len(tried)} layouts tried ({cannot} it cannot run, {over} "
                             f"over {budget:g} CPU s; BENCH_DEBUG=1 says why)")
        by_case: dict[int, tuple] = {}
        for case, strategy in runnable:
            by_case.setdefault(id(case), (case, []))[1].append(strategy)
        for case, strategies in by_case.values():   # untimed: the check's caches for these layouts warm
            assert_passed(verify_case(simulated, case, _fresh(strategies)))
        timed: dict[str, list[float]] = {"dtensor": [], "check": []}
        start = time.process_time()
        while time.process_time() - start < seconds or len(timed["check"]) < rounds:
            began = time.process_time()
            for case, strategy in runnable:
                check(case, strategy)
            timed["dtensor"].append(time.process_time() - began)
            copies = [(case, _fresh(strategies)) for case, strategies in by_case.values()]
            results, began = [], time.process_time()
            for case, strategies in copies:
                results.append(verify_case(simulated, case, strategies))
            timed["check"].append(time.process_time() - began)
            for found in results:
                assert_passed(found)
        dtensor_ms, check_ms = _spread(timed["dtensor"], len(runnable)), _spread(timed["check"], len(runnable))
        return {"layouts": len(runnable), "cannot_run": cannot, "over_budget": over, "budget_cpu_s": budget,
                "not_tried": len(layouts) - len(tried), "most_tried": most,
                "rounds": len(timed["check"]), "dtensor_ms": dtensor_ms, "warm_check_ms": check_ms,
                "dtensor_over_warm_check": _ratio(dtensor_ms, check_ms)}
    finally:
        if _mode_stacks() != (0, 0):   # never left entered, whatever ended the measuring
            _restore_mode_stacks((0, 0))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ gloo
def pool_ms_per_check(pool, cases_and_strategies, passes: int) -> tuple[float, int]:
    """Wall ms per check of the median of ``passes`` passes (after one untimed) of every
    (case, strategies) on a process pool, fresh strategy copies each pass; every check must
    pass.  Wall, not CPU: the pool's work runs in its worker processes."""
    from shardverify.verify.engine import verify_case
    from shardverify.verify.report import assert_passed

    for case, strategies in cases_and_strategies:
        assert_passed(verify_case(pool, case, _fresh(strategies)))
    per_pass, timed = sum(len(s) for _, s in cases_and_strategies), []
    for _ in range(max(passes, 1)):
        batch = [(case, _fresh(strategies)) for case, strategies in cases_and_strategies]
        began = time.perf_counter()
        for case, strategies in batch:
            assert_passed(verify_case(pool, case, strategies))
        timed.append(time.perf_counter() - began)
    return statistics.median(timed) / per_pass * 1e3, per_pass * len(timed)


def fresh_vs_pool(mesh, cases_and_strategies, passes: int) -> dict:
    """The same checks on fresh processes per case and on one warm pool (wall clock).  Fresh
    processes are measured two ways: spawned per case (``start_method="spawn"``: every case
    starts its own processes, each importing torch and joining a new gloo group, as a test that
    spawns its ranks does), and a forkserver pool started per case (what a pool restart costs
    once this process has its forkserver).  Each is started, used for the case's batch and closed."""
    from shardverify.backends.process import ProcessBackend
    from shardverify.verify.engine import verify_case
    from shardverify.verify.report import assert_passed

    def per_case(start_method: str) -> tuple[float, int]:
        checks, start = 0, time.perf_counter()
        for case, strategies in cases_and_strategies:
            with ProcessBackend(mesh, backend="gloo", timeout=120, start_method=start_method) as backend:
                results = verify_case(backend, case, _fresh(strategies))
                assert_passed(results)
                checks += len(results)
        return (time.perf_counter() - start) / checks * 1e3, checks

    spawned, checks = per_case("spawn")
    restarted, _ = per_case("forkserver")
    with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
        pool.start()
        warm = pool_ms_per_check(pool, cases_and_strategies, passes)[0]
    return {"fresh_ms_per_check": spawned, "fresh_checks": checks, "restarted_pool_ms_per_check": restarted,
            "warm_gloo_ms_per_check": warm, "fresh_over_warm": spawned / warm, "restarted_over_warm": restarted / warm}


# ------------------------------------------------------------------------------ scaled rows
def scaled_case(case, factor: int):
    """``case`` grown by ``factor`` on its free dims only (shardverify/spec/scaled.py: each leading
    dim of the first input, with the dims of other inputs it must match, never a contracted or
    feature dim, kept where the case still builds; for linear and sum every leading dim), and
    which dims grew, as ``Scaled(case, dims)``.  Unmeasured, naming the case and why each dim
    stayed, when none can grow."""
    from shardverify.errors import InvalidArgument
    from shardverify.spec.scaled import scale_case

    try:
        return scale_case(case, factor)
    except InvalidArgument as exc:
        raise Unmeasured(f"{case.op}: its first case cannot be grown x{factor}: {exc}") from exc


def scaled_row(simulated, spec, mesh, factor: int, seconds: float, rounds: int, memory: int = MEMORY_BYTES) -> dict:
    """:func:`measure_row` on the spec's first case scaled by ``factor`` (:func:`scaled_case`),
    every distinct layout of it."""
    from shardverify.strategies.for_node import strategies_for_node

    _, first = next(iter(spec.op_cases()))
    grown = scaled_case(first, factor)
    case = grown.case
    graph_module, node_name = case.build()
    chosen = [(case, distinct_layouts(strategies_for_node(graph_module, node_name, mesh)))]
    row = measure_row(simulated, mesh, chosen, seconds, rounds, memory)
    shapes = [list(decl.shape) for decl in case.inputs]
    row.update({"op": f"{spec.name} x{factor}", "mesh": list(mesh.shape), "factor": factor, "dims": grown.describe(),
                "shapes": shapes, "notes": [f"the first case x{factor} on {grown.describe()} {shapes}; "
                                            f"{_row_note(row)}", generation_note(row, chosen, mesh, rounds)]})
    return row


def generation(cases_and_strategies, mesh, rounds: int) -> dict:
    """CPU seconds to generate the strategies of the row's cases (the op's and its predecessor's,
    every strategy a run lists, duplicates included), each round on a newly traced graph (so no
    table of strategies, meta calls or names is warm), min and median over ``rounds``; and again
    as every case of a run after its spec's first pays it ("in_run"): a predecessor whose
    layouts are keyed by value in full (strategies/by_value.py) is then derived already."""
    from shardverify.strategies import by_value
    from shardverify.strategies.for_node import strategies_for_node

    def timed() -> tuple[float, int]:
        graphs = [case._trace() for case, _ in cases_and_strategies]   # new graphs
        began = time.process_time()
        count = sum(len(strategies_for_node(graph, node, mesh)) for graph, node in graphs)
        return time.process_time() - began, count

    passes, in_run, count = [], [], 0
    for _ in range(max(rounds, 1)):
        by_value.forget()                 # nothing remembered
        spent, count = timed()
        passes.append(spent)
        in_run.append(timed()[0])         # the predecessor's layouts as the first pass left them
    return {"strategies": count, "min_s": min(passes), "median_s": statistics.median(passes),
            "in_run": {"min_s": min(in_run), "median_s": statistics.median(in_run)}}


def generation_note(row: dict, cases_and_strategies, mesh, rounds: int) -> str:
    """:func:`generation` of the row's cases, set on the row against its cold check (the same
    strategies at any shape, while the check grows with it), and said in a line."""
    made = row["generation"] = generation(cases_and_strategies, mesh, rounds)
    checked = {k: row["cold_ms"][k] * row["layouts"] / 1e3 for k in ("min", "median")}
    for part in (made, made["in_run"]):
        part["over_cold_check"] = {k: part[f"{k}_s"] / checked[k] for k in ("min", "median")}
    return (f"generating its {made['strategies']} strategies (its predecessor's generated too) {made['min_s']:.3f} / "
            f"{made['median_s']:.3f} CPU s (min / median over fresh graphs), {_pair(made['over_cold_check'], 2)} of "
            f"the cold check of its {row['layouts']} layouts; in a run, with the predecessor's layouts derived for an "
            f"earlier case, {made['in_run']['min_s']:.3f} / {made['in_run']['median_s']:.3f} CPU s, "
            f"{_pair(made['in_run']['over_cold_check'], 2)}")


# ---------------------------------------------------------------------------------- output
def _row_note(row: dict) -> str:
    return (f"{row['floor_left_out']} of {row['layouts'] + row['floor_left_out']} layouts left out of every column "
            f"(the floor cannot run them bare); cold/warm {_pair(row['cold_over_warm'], 2)}; the least check's "
            f"verdicts judged on {row['least_judged']} of {row['layouts']} layouts, all passed (of the others, "
            f"{row['least_budgeted']} pass the engine only by its low-precision budget, their values outside the "
            f"default tolerance the least check compares at, and the rest hold a partial input, which the floor's "
            f"shards give as the rank's block); {row['rounds']} rounds" +
            (f", each over {row['chunks']} chunks of layouts (their blocks hold {row['held_gib']:.1f} GiB, over "
             f"--memory-gib {row['memory_gib']:g})" if row["chunks"] > 1 else ""))


def _pair(figures: dict, digits: int) -> str:
    return f"{figures['min']:.{digits}f} / {figures['median']:.{digits}f}"


def table(rows: list[dict]) -> str:
    """The rows as a text table: ms per layout and ratios, each as min / median."""
    head = (f"{'op':10s} {'mesh':10s} {'layouts':>7s}  {'floor ms':>15s}  {'least check ms':>15s}  "
            f"{'cold check ms':>15s}  {'warm check ms':>15s}  {'least/floor':>13s}  {'cold/floor':>13s}  "
            f"{'warm/floor':>13s}  {'cold/least':>13s}  {'left out':>8s}")
    lines = [head, f"{'':30s}{'(min / median)':>15s}", "-" * len(head)]
    for row in rows:
        lines.append(f"{row['op']:10s} {str(tuple(row['mesh'])):10s} {row['layouts']:7d}  {_pair(row['floor_ms'], 3):>15s}  "
                     f"{_pair(row['least_ms'], 3):>15s}  {_pair(row['cold_ms'], 3):>15s}  "
                     f"{_pair(row['warm_ms'], 3):>15s}  {_pair(row['least_over_floor'], 2):>13s}  "
                     f"{_pair(row['cold_over_floor'], 2):>13s}  {_pair(row['warm_over_floor'], 2):>13s}  "
                     f"{_pair(row['cold_over_least'], 2):>13s}  {row['floor_left_out']:8d}")
    return "\n".join(lines)


def _public(row: dict) -> dict:
    """The row without what only the run uses (the layouts themselves)."""
    return {key: value for key, value in row.items() if key != "runnable"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["2,2", "2,2,2"], help="mesh shapes, e.g. 2,2 2,2,2")
    parser.add_argument("--specs", nargs="+", default=["linear", "sum"])
    parser.add_argument("--ab-specs", nargs="*", default=None,
                        help="specs of the A/B on the first mesh (default: --specs; those without a loop written "
                             "out here are named and skipped)")
    parser.add_argument("--cases", type=int, default=1, help="cases per spec (the first N of its grid)")
    parser.add_argument("--fresh-cases", type=int, default=2,
                        help="cases per spec in the fresh-processes-per-case baseline (first mesh only; 0 "
                             "leaves the baseline out)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="CPU seconds of this process each row's rounds take at least (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds each row takes at least (default 5)")
    parser.add_argument("--gloo-passes", type=int, default=5, help="timed passes of the warm gloo pool (default 5)")
    parser.add_argument("--scale", type=int, default=4,
                        help="factor on the first case's free dims for the larger-shape row of each op and mesh "
                             "(1 leaves the row out; default 4)")
    parser.add_argument("--scaled-only", nargs="*", default=[],
                        help="specs measured only in the larger-shape row, on the first mesh (a case whose "
                             "contracted dim must not grow, e.g. matmul)")
    parser.add_argument("--skip-gloo", action="store_true", help="no process pools (no start-up, no fresh baseline)")
    parser.add_argument("--skip-dtensor", action="store_true", help="no DTensor LocalTensorMode figures")
    parser.add_argument("--dtensor-budget", type=float, default=2.0,
                        help="CPU seconds DTensor may take for its first check of a layout before the layout is "
                             "left out, counted (default 2; the machine's load does not count)")
    parser.add_argument("--dtensor-layouts", type=int, default=72,
                        help="layouts DTensor tries per row at most, spread evenly over the row's; the rest are "
                             "counted as not tried (default 72: every layout of linear and sum on (2, 2))")
    parser.add_argument("--memory-gib", type=float, default=MEMORY_BYTES / 2**30,
                        help="GiB the floor's and the least check's blocks of a row may hold at once; a row over "
                             "it is measured in chunks of layouts within it, counted on the row (default 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the text")
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: every figure once, briefly (mesh 2,2 only, the sum spec's first case, "
                             "the A/B on linear and sum, 0.2 CPU s and 3 rounds per row, the larger-shape row at "
                             "--scale 2, for matmul too, 3 gloo passes, fresh-processes baseline on one case); its "
                             "ratios are not for quoting")
    args = parser.parse_args()
    if args.quick:
        args.meshes, args.specs, args.cases, args.seconds, args.rounds = ["2,2"], ["sum"], 1, 0.2, 3
        args.ab_specs = ["linear", "sum"] if args.ab_specs is None else args.ab_specs
        args.fresh_cases, args.scale, args.gloo_passes = min(args.fresh_cases, 1), min(args.scale, 2), 3
        args.scaled_only = args.scaled_only or ["matmul"]
    for name in ("cases", "rounds", "gloo_passes", "scale", "dtensor_layouts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seconds < 0:
        parser.error(f"--seconds must be 0 or more, got {args.seconds}")
    if not args.memory_gib > 0:
        parser.error(f"--memory-gib must be more than 0, got {args.memory_gib}")
    memory = int(args.memory_gib * 2**30)
    if args.scaled_only and args.scale < 2:
        parser.error("--scaled-only needs --scale of 2 or more")
    if args.fresh_cases < 0:
        parser.error(f"--fresh-cases must be 0 or more, got {args.fresh_cases}")

    import torch

    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.backends import SimulatedBackend
    from shardverify.backends.process import ProcessBackend
    from shardverify.cli.verify_cmd import parse_mesh
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.backends.gc_policy import tune_for_checking
    from shardverify.sharding.mesh import DeviceMesh

    torch.set_num_threads(1)
    tune_for_checking()   # the collector settings `shardverify verify` and the suite check under
    meshes = [DeviceMesh(parse_mesh(text)) for text in args.meshes]
    specs = load_op_specs(REPO, None, args.specs)
    report: dict = {"load_average": list(os.getloadavg()), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "cpu_seconds_per_row": args.seconds, "rounds_per_row": args.rounds, "ab": [], "rows": []}
    say = (lambda *a: None) if args.json else print
    say(f"load average {report['load_average']}, {report['cpus']} CPUs, torch {torch.__version__}; every figure "
        f"in CPU time of this process unless it says wall")

    if not args.skip_gloo:   # first, while this process has started no pool (no forkserver yet)
        mesh = meshes[0]
        began = time.perf_counter()
        with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
            pool.start()
            first_start = time.perf_counter() - began
        began = time.perf_counter()
        with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
            pool.start()
            later_start = time.perf_counter() - began
        bare = bare_spawn_seconds(mesh.size)
        startup = {"mesh": list(mesh.shape), "pool_first_start_s": first_start, "pool_later_start_s": later_start,
                   "bare_spawn_s": bare, "first_over_bare": first_start / bare, "later_over_bare": later_start / bare}
        report["startup"] = startup
        say(f"pool start-up on {mesh.shape} (wall): first {first_start:.2f}s (starting the forkserver included), "
            f"later {later_start:.2f}s; bare spawn of {mesh.size} gloo processes {bare:.2f}s "
            f"(ratios {startup['first_over_bare']:.2f}x, {startup['later_over_bare']:.2f}x)")

    def chosen_for(spec, mesh, cases: int) -> tuple[list, int]:
        chosen, offered = [], 0
        for _, case in list(spec.op_cases())[:cases]:
            graph_module, node_name = case.build()
            strategies = list(strategies_for_node(graph_module, node_name, mesh))
            offered += len(strategies)
            chosen.append((case, distinct_layouts(strategies)))
        return chosen, offered

    ab_specs = specs if args.ab_specs is None else load_op_specs(REPO, None, args.ab_specs) if args.ab_specs else []
    for spec in ab_specs:   # the A/B, on the first mesh: the floor's body against a loop written out here
        chosen, _ = chosen_for(spec, meshes[0], 1)
        layouts, _ = floor_layouts(meshes[0], chosen)
        ab = ab_check(spec.name, layouts, min(args.seconds, 1.0), max(args.rounds, 15))
        if ab is None:
            say(f"A/B {spec.name}: no hand-written loop for this op (benchmarks/bench_verify.py _hand_loop)")
            continue
        ab.update({"op": spec.name, "mesh": list(meshes[0].shape)})
        report["ab"].append(ab)
        say(f"A/B {spec.name} {meshes[0].shape}, {ab['layouts']} layouts, {ab['rounds']} alternating rounds: "
            f"the floor's body {_pair(ab['floor_ms'], 4)} ms per layout, a plain torch loop written out "
            f"{_pair(ab['hand_ms'], 4)} (min / median): floor/hand {_pair(ab['floor_over_hand'], 3)}")
        if args.quick:   # 0.2 CPU s of rounds on a shared machine: the minima are too noisy to judge
            say(f"A/B {spec.name}: the {AB_LIMIT:.0%} limit is not judged in --quick (its figures are not for quoting)")
        else:
            check_agreement(spec.name, ab)

    for mesh in meshes:
        with SimulatedBackend(mesh, timeout=120) as simulated:
            for spec in specs:
                chosen, offered = chosen_for(spec, mesh, args.cases)
                row = measure_row(simulated, mesh, chosen, args.seconds, args.rounds, memory)
                row.update({"op": spec.name, "mesh": list(mesh.shape), "cases": len(chosen), "offered": offered})
                notes = [_row_note(row), generation_note(row, chosen, mesh, args.rounds)]
                row["batched"] = batched_ab(mesh, row["runnable"], args.seconds, args.rounds)
                notes.append(batched_note(row["batched"]))
                if not args.skip_dtensor:
                    dt = row["dtensor"] = dtensor_row(simulated, mesh.shape, row["runnable"], args.seconds,
                                                      args.rounds, args.dtensor_budget, args.dtensor_layouts)
                    notes.append(f"DTensor LocalTensorMode {_pair(dt['dtensor_ms'], 2)} ms per layout on the "
                                 f"{dt['layouts']} layouts it ran, the warm check {_pair(dt['warm_check_ms'], 3)} "
                                 f"on the same: {_pair(dt['dtensor_over_warm_check'], 1)}x; left out: "
                                 f"{dt['cannot_run']} layouts it cannot run, {dt['over_budget']} over "
                                 f"{dt['budget_cpu_s']:g} CPU s for its first check, {dt['not_tried']} not tried "
                                 f"(at most {dt['most_tried']} per row, spread evenly)")
                if not args.skip_gloo:
                    with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
                        pool.start()
                        row["gloo_ms"], row["gloo_checks"] = pool_ms_per_check(pool, chosen, args.gloo_passes)
                    notes.append(f"gloo pool warm {row['gloo_ms']:.2f} ms per check (wall, median of "
                                 f"{args.gloo_passes} passes over all {sum(len(s) for _, s in chosen)} layouts)")
                row["notes"] = notes
                report["rows"].append(row)
                if args.scale > 1:
                    report["rows"].append(scaled_row(simulated, spec, mesh, args.scale, args.seconds, args.rounds,
                                                     memory))
                say(f"measured {spec.name} on {mesh.shape}")
            if mesh is meshes[0]:
                for spec in load_op_specs(REPO, None, args.scaled_only) if args.scaled_only else []:
                    report["rows"].append(scaled_row(simulated, spec, mesh, args.scale, args.seconds, args.rounds,
                                                     memory))

    if not args.skip_gloo and args.fresh_cases:
        mesh = meshes[0]
        baseline = [pair for spec in specs for pair in chosen_for(spec, mesh, args.fresh_cases)[0]]
        fresh = fresh_vs_pool(mesh, baseline, args.gloo_passes)
        report["fresh_processes"] = fresh
        say(f"fresh processes per case on {mesh.shape} ({fresh['fresh_checks']} checks, wall): spawned per case "
            f"{fresh['fresh_ms_per_check']:.1f} ms/check, a forkserver pool started per case "
            f"{fresh['restarted_pool_ms_per_check']:.1f}, against a warm pool's {fresh['warm_gloo_ms_per_check']:.2f} "
            f"on the same checks: {fresh['fresh_over_warm']:.0f}x and {fresh['restarted_over_warm']:.1f}x")
    report["rows"] = [_public(row) for row in report["rows"]]
    report["load_average_after"] = list(os.getloadavg())
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print()
    print(table(report["rows"]))
    print()
    for row in report["rows"]:
        for note in row.get("notes", ()):
            print(f"{row['op']} {tuple(row['mesh'])}: {note}")
    print(f"cold: each pass on a new copy of the case and strategies, the engine's tables emptied "
          f"({', '.join(report['rows'][0]['tables_emptied'])})")
    print(f"load average after: {report['load_average_after']}")


if __name__ == "__main__":
    try:
        main()
    except Unmeasured as exc:
        sys.exit(f"bench_verify: a figure could not be measured: {exc}")
    except Disagreement as exc:
        sys.exit(f"bench_verify: a plain torch loop disagrees with the floor or the engine: {exc}")
