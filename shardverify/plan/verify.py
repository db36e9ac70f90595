"""``verify_plan``: choose (or take) a plan for a model and verify it end to end on a backend."""

from __future__ import annotations

import gc

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch.nn.parameter import is_lazy

from shardverify.errors import BackendError, InvalidArgument, ShardVerifyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.plan.coverage import Coverage, classify_nodes
from shardverify.plan.capture_model import Captured, as_shardverify_error, capture_model, drawing_note
from shardverify.plan.execute import failed_node, rank_run_plan
from shardverify.plan.export_facts import NodeFacts, facts_of
from shardverify.plan.recipe import ModelRecipe, as_float64
from shardverify.plan.inputs import with_keywords
from shardverify.plan.build import build_plan
from shardverify.plan.device import NOMINAL, DeviceProfile
from shardverify.plan.model import Plan, PlanGoals
from shardverify.plan.phases import PhaseClock
from shardverify.plan.real_size import RealSize, RealSizePlan, solve_real_size
from shardverify.plan.problem import PlanProblem
from shardverify.plan.solver import Solver, solve_problem
from shardverify.plan.weights import held_weights, with_weight_layouts
from shardverify.plan.workload import Workload
from shardverify.verify.on_demand import OnDemandVerifier
from shardverify.verify.report import Mismatch

__all__ = ["PlanResult", "make_plan", "plan_with_coverage", "plans_with_coverage", "verify_plan", "run_plan", "strict_problems"]


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    backend: str
    mismatches: tuple[Mismatch, ...]
    coverage: Coverage | None = None
    strict: bool = False            # a pass needs every tensor op handled and something sharded
    notes: tuple[str, ...] = ()     # how the model was captured, when not as asked
    real_size: RealSizePlan | None = None   # the plan was solved at this size, mapped onto the model checked
    cpu_seconds: tuple[tuple[str, float], ...] = ()   # (phase, CPU seconds) of the check, plan/phases.py
    graph_facts: tuple[NodeFacts, ...] = ()   # the captured graph's nodes as data (export to ParallelStyles)

    @property
    def passed(self) -> bool:
        return not self.mismatches and not (self.strict and self.strict_failures)

    @property
    def strict_failures(self) -> tuple[str, ...]:
        """Why the plan is not a strict pass: ops that ran replicated for want of strategies, or
        a plan that shards nothing (whether or not ``strict`` was asked)."""
        return strict_problems(self.coverage)

    @property
    def shards_nothing(self) -> bool:
        """The plan runs every op replicated: a pass then checked no sharding at all."""
        return self.coverage is not None and not self.coverage.sharded

    def first_divergence(self) -> Mismatch | None:
        """The first node (graph order) whose output diverges in forward; else, in backward, the
        node that passes a wrong gradient back (the owner of the missing or wrong reduction:
        :mod:`shardverify.plan.blame`); else the last node whose output gradient diverges (the
        first the gradient reaches); else a grad."""
        for phase, pick in (("forward", min), ("owner", max), ("backward", max), ("grad", min), ("error", min)):
            found = [m for m in self.mismatches if m.phase == phase]
            if found:
                return pick(found, key=lambda m: m.order)
        return None

    def summary(self) -> str:
        first = self.first_divergence()
        if first is None and self.strict and self.strict_failures:
            return "FAIL (strict): " + "; ".join(self.strict_failures)
        if first is None:
            if self.shards_nothing:
                return "PASS, but the plan shards nothing: no sharding was checked"
            fallbacks = len(self.coverage.fallbacks) if self.coverage is not None else 0
            return f"PASS ({fallbacks} tensor op(s) ran replicated without strategies)" if fallbacks else "PASS"
        item = self.plan.node(first.node) if first.phase != "error" else None
        status = self._status(first.node)
        source = status.source if status is not None else ""    # the model node a decomposed piece came from
        if first.phase == "owner":
            head = (f"FAIL: backward: node {first.node!r}{source} is the first in backward order whose "
                    f"{first.tensor} diverges")
        elif first.phase == "error":   # the backend's own words (a rank that raised, died or timed out)
            head = f"FAIL: {first.tensor}" + ("" if first.node == "?" else f" (at node {first.node!r}{source})")
        else:
            head = (f"FAIL: {first.phase} {first.tensor} diverges first at node {first.node!r}{source}"
                    f" (max abs error {first.max_abs_err:.3g})")
        lines = [head]
        if item is not None:
            lines.append(f"  strategy: {node_label(item, self.coverage)}")
            lines += [f"  resharding before it: {r}" for r in item.reshards] or ["  resharding before it: none"]
        ranks = sorted({m.rank for m in self.mismatches if m.node == first.node})
        lines.append(f"  ranks: {ranks}; {len(self.mismatches)} mismatch(es) in all")
        return "\n".join(lines)

    def _status(self, node: str):
        return None if self.coverage is None else next((s for s in self.coverage.statuses if s.node == node), None)

    def to_json(self) -> dict:
        first = self.first_divergence()
        status = None if first is None else self._status(first.node)
        return {
            "mesh": list(self.plan.mesh_shape), "backend": self.backend, "passed": self.passed,
            "strict": self.strict, "strict_failures": list(self.strict_failures), "notes": list(self.notes),
            "cost": {"compute": self.plan.cost.compute, "communication": self.plan.cost.communication,
                     "resharding": self.plan.cost.resharding, "total": self.plan.cost.total,
                     "memory_bytes": self.plan.cost.memory, "weight_bytes": self.plan.cost.weights},
            "device": self.plan.device.to_json(), "workload": self.plan.workload.to_json(),
            "nodes": [{"node": n.node, "strategy": n.strategy_name,
                       "resharding": [{"operand": r.operand, "from": r.producer, "source": str(r.source),
                                       "target": str(r.target), "steps": [str(s) for s in r.steps]}
                                      for r in n.reshards if r.steps]} for n in self.plan.nodes],
            "first_divergence": None if first is None else {
                "node": first.node, "phase": first.phase, "what": first.tensor,
                "decomposed_from": None if status is None or status.origin is None else list(status.origin)},
            "coverage": None if self.coverage is None else self.coverage.to_json(),
            "real_size": None if self.real_size is None else self.real_size.to_json(),
            "mismatches": [m.describe() for m in self.mismatches],
            "cpu_seconds": dict(self.cpu_seconds),
        }


def strict_problems(coverage: Coverage | None) -> tuple[str, ...]:
    """What strict refuses, the one definition the API, the plan spec and the CLI share: a tensor
    op that ran replicated for want of strategies (refused, or without a handler), and a plan that
    shards nothing (its pass checked no sharding)."""
    if coverage is None:
        return ()
    found = []
    if coverage.fallbacks:
        found.append(f"{len(coverage.fallbacks)} tensor op(s) ran replicated without strategies (see coverage)")
    if not coverage.sharded:
        found.append("the plan shards nothing")
    return tuple(found)


def node_label(item, coverage: Coverage | None = None) -> str:
    """A node's strategy, or why it has none: no handler for its target, or its handler's refusal."""
    status = None if coverage is None or item.strategy is not None else \
        next((s for s in coverage.statuses if s.node == item.node), None)
    if status is None or status.status == "handled":
        return item.strategy_name
    if status.status == "unhandled":
        return f"replicated: no spec covers {status.target}"
    if status.status == "refused":
        return f"replicated: {status.target} refused: {status.reason[:160]}"
    if status.status == "constant":
        return f"replicated: {status.target} built from constants on every rank"
    if status.status == "element":
        return "a tuple element: laid out as its producer's strategy gives it"
    if status.status == "not compared":
        return f"runs as is: {status.target} allocates uninitialised memory, never compared"
    return "runs as is (no tensor output)"


#: how the op-by-op listing writes a layout, said once above it
NOTATION = ("one letter group per dim of each tensor: R whole on every device, S0 split over mesh axis 0 "
            "(S01 over axes 0 and 1); 'P0 sum': partial sums still to be added over axis 0")


def describe_plan(plan: Plan, coverage: Coverage | None = None) -> str:
    """Every op's layout (its inputs' -> its output's) and what moves into it, in graph order;
    the model's weights and inputs listed apart: no op of their own, each is held whole and an
    op that wants a piece of it takes the piece (its resharding line says how)."""
    statuses = {s.node for s in coverage.statuses} if coverage is not None else None
    last = plan.nodes[-1].node if plan.nodes else ""
    held = [item for item in plan.nodes if statuses is not None and item.strategy is None
            and item.node not in statuses and item.node != last]
    lines = [f"plan on mesh {list(plan.mesh_shape)}, op by op ({NOTATION}):"]
    if held:
        lines.append(f"  weights and inputs ({len(held)}): held whole on every device until an op takes its "
                     f"piece (the 'reshard' lines below): " + ", ".join(item.node for item in held))
    names = {item.node for item in held}
    for item in plan.nodes:
        if item.node in names:
            continue
        label = "the model's output, whole on every device" if item.node == last and item.strategy is None \
            and statuses is not None else node_label(item, coverage)
        if item.strategy is not None and not item.strategy.inputs:    # a weight's own node: how it is held
            label = f"weight held {label}: each device keeps its block, with its gradient and optimizer state"
        lines.append(f"  {item.node:<16} {label}")
        lines += [f"      reshard {r.operand}: {r.source} -> {r.target} via "
                  f"{', '.join(map(str, r.steps))} ({r.cost:.3g} s)" for r in item.reshards if r.steps]
    c = plan.cost
    lines.append(f"  predicted cost: {c.total:.4g} s per training step (compute {c.compute:.3g} + communication "
                 f"{c.communication:.3g} + resharding {c.resharding:.3g}); memory {c.memory} B/device "
                 f"({c.weights} B of it weights, gradients and optimizer state) on {plan.device.label}, "
                 f"{plan.workload.label}")
    return "\n".join(lines)


def _as_mesh(mesh, device: DeviceProfile = NOMINAL) -> DeviceMesh:
    """A mesh as given, or a shape's mesh priced by ``device``'s links."""
    return mesh if isinstance(mesh, DeviceMesh) else device.mesh(tuple(mesh))


def make_plan(module: torch.nn.Module, example_inputs, mesh,
              plan: Mapping[str, str] | Plan | None = None, memory_limit: int | None = None,
              device: DeviceProfile = NOMINAL, capture: str = "auto", goals: PlanGoals = PlanGoals(),
              verified_only: bool = False, cost_size: RealSize | None = None, solver: Solver | None = None,
              workload: Workload = Workload()) -> Plan:
    """The solver's plan (``plan=None``; for the costs at ``cost_size`` when given; ``solver``: CBC when
    None), or the user's ``{node: strategy name}`` completed."""
    return plan_with_coverage(module, example_inputs, mesh, plan, memory_limit, device, capture, goals,
                              verified_only, cost_size, solver, workload)[0]


def plan_with_coverage(module: torch.nn.Module, example_inputs, mesh,
                       plan: Mapping[str, str] | Plan | None = None, memory_limit: int | None = None,
                       device: DeviceProfile = NOMINAL, capture: str = "auto",
                       goals: PlanGoals = PlanGoals(), verified_only: bool = False,
                       cost_size: RealSize | None = None, solver: Solver | None = None,
                       workload: Workload = Workload()) -> tuple[Plan, Coverage]:
    """:func:`make_plan` and the account of the model's op nodes under it (from one capture).
    A call outside its spec's grid is verified where it is met (its strategies that pass are
    offered, the verdicts kept on disk), or refused with ``verified_only``."""
    module, inputs = with_keywords(module, example_inputs)
    found = _planned(module, inputs, mesh, plan, memory_limit, device, capture, goals, verified_only,
                     cost_size, solver, workload=workload)[:2]
    _collect_capture(module)
    return found


#: the float64 copies of a model's weights (8 B per element) from which a plan collects its capture
#: at once: 2 M elements and up (the 4.2 M-parameter MLP of benchmarks/bench_plan_memory.py)
COLLECT_FROM_BYTES = 16 * 2**20


def _collect_capture(module: torch.nn.Module) -> None:
    """The captured graph holds a float64 copy of every weight in reference cycles (fx nodes, the
    export's state): where those copies are large, collected now, not whenever the collector next
    runs, mid-check (the check's peak memory). A smaller capture is left to the collector: a full
    collection walks every live object (60-400 ms in a test session), which for a small model cost
    more than making its plan (half of tests/test_varargs_calls.py's CPU time)."""
    held = 8 * sum(t.numel() for t in (*module.parameters(), *module.buffers()) if not is_lazy(t))
    if held >= COLLECT_FROM_BYTES:
        gc.collect()


def _capture_for(capture: str, cost_size: RealSize | None, plan) -> str:
    """The capture a plan solved at a real size needs: torch.export's, the real size's own (the
    graphs are matched node by node)."""
    if cost_size is None:
        return capture
    if plan is not None:
        raise InvalidArgument("a real size (cost_size, --cost-size) costs the solver's plan; a given plan is not "
                              "solved: leave one of them out")
    if capture == "fx":
        raise InvalidArgument("a plan solved at a real size is mapped node by node from torch.export's graph of "
                          "the real size: capture with export (--capture export), not fx")
    return "export"


def plans_with_coverage(module: torch.nn.Module, example_inputs, mesh,
                        asked: Sequence[tuple[Mapping[str, str] | None, PlanGoals]], capture: str = "auto"
                        ) -> list[tuple[Plan, Coverage] | ShardVerifyError]:
    """:func:`plan_with_coverage` of several plans of one model on one mesh, each ``(None, goals)``
    (the solver's under ``goals``) or ``(node -> strategy, PlanGoals())``: one capture, one account
    of the nodes' strategies and one cost problem serve them all, where making each alone would
    derive them again. Each place holds its (plan, coverage), or the error making that plan raised
    (the others are still made)."""
    module, inputs = with_keywords(module, example_inputs)
    mesh = _as_mesh(mesh)
    captured = capture_model(module, tuple(inputs), capture)
    made = _made_on(captured, module, mesh, [(None if plan is None else dict(plan), goals) for plan, goals in asked],
                    None, NOMINAL, False, None, None, PhaseClock(), Workload())
    _collect_capture(module)   # as plan_with_coverage: the capture's float64 weights
    return [found if isinstance(found, ShardVerifyError) else found[:2] for found in made]


def _planned(module, inputs, mesh, plan, memory_limit, device, capture, goals,
             verified_only: bool = False, cost_size: RealSize | None = None, solver: Solver | None = None,
             clock: PhaseClock | None = None, workload: Workload = Workload()
             ) -> tuple[Plan, Coverage, Captured, RealSizePlan | None]:
    """The plan, the coverage, the capture and what solving at the real size gave. The memory limit
    is ``memory_limit``, else the device's memory; under a limit each weight may be held sharded."""
    mesh = _as_mesh(mesh, device)
    if memory_limit is None:
        memory_limit = device.memory_bytes
    clock = clock or PhaseClock()
    with clock.phase("capture"):
        captured = capture_model(module, tuple(inputs), _capture_for(capture, cost_size, plan))
    made = _made_on(captured, module, mesh, [(plan, goals)], memory_limit, device, verified_only, cost_size, solver,
                    clock, workload)[0]
    if isinstance(made, ShardVerifyError):
        raise made
    chosen, coverage, at_real = made
    return chosen, coverage, captured, at_real


def _made_on(captured: Captured, module: torch.nn.Module, mesh: DeviceMesh, asked: list[tuple[object, PlanGoals]],
             memory_limit: int | None, device: DeviceProfile, verified_only: bool, cost_size: RealSize | None,
             solver: Solver | None, clock: PhaseClock, workload: Workload
             ) -> list[tuple[Plan, Coverage, RealSizePlan | None] | ShardVerifyError]:
    """Each asked (plan, goals) made on one capture: the nodes' strategies derived once (a call
    outside its spec's grid verified once), the solver's cost problem posed once for every goal."""
    gm = captured.graph
    where = f"planning {type(module).__name__}"
    try:
        with clock.phase("strategies"), (nullcontext() if verified_only else OnDemandVerifier()) as on_demand:
            plain, statuses = classify_nodes(gm, mesh, on_demand)
            # under a limit each weight may be held sharded, and a given plan may name how
            weighted = with_weight_layouts(gm, plain, mesh) \
                if memory_limit is not None or any(_names_weight(plan, gm) for plan, _ in asked) else plain
    except Exception as error:  # noqa: BLE001 - never a raw exception out of a plan's making
        raise as_shardverify_error(error, where) from error
    problem: PlanProblem | None = None
    made: list = []
    for plan, goals in asked:
        options = weighted if memory_limit is not None or _names_weight(plan, gm) else plain
        at_real = None
        try:
            with clock.phase("solve"):
                if cost_size is not None:
                    plan, at_real = solve_real_size(gm, options, cost_size, mesh, memory_limit, device, goals, solver,
                                                    workload)
                elif plan is None:
                    if problem is None or problem.options is not options:
                        problem = PlanProblem.of(gm, mesh, options, device, workload=workload)
                    plan = solve_problem(problem, memory_limit, goals, solver)
                elif not isinstance(plan, Plan):   # a given choice: a strategy verification at the call removed is said so
                    removed = {} if on_demand is None else {r.node: dict(r.failed) for r in on_demand.records if r.failed}
                    plan = build_plan(gm, mesh, dict(plan), options, device, removed=removed, workload=workload)
        except Exception as error:  # noqa: BLE001 - never a raw exception out of a plan's making
            found = as_shardverify_error(error, where)
            if found is not error:
                found.__cause__ = error
            made.append(found)
            continue
        made.append((plan, Coverage.of(statuses, plan, on_demand), at_real))
    return made


def _names_weight(plan, graph) -> bool:
    """Does a given plan (node -> strategy) name the layout a weight's own node holds it in?"""
    return isinstance(plan, Mapping) and any(node.name in plan for node in held_weights(graph))


def run_plan(backend, module, example_inputs, plan: Plan, seed: int = 0,
             timeout: float | None = None, *, capture: str = "fx", coverage: Coverage | None = None,
             graph: Captured | None = None) -> PlanResult:
    """Verify ``plan`` on ``backend``'s ranks, forward and backward, against the single device.
    ``graph``: the graph the plan was made on (:func:`verify_plan` passes its capture); when None,
    ``module`` is captured here by ``capture`` once. The plan's nodes must be that graph's; ranks
    in this process run it as it is, worker processes capture ``module`` and refuse another graph."""
    if tuple(plan.mesh_shape) != tuple(backend.mesh.shape):
        raise InvalidArgument(f"plan is for mesh {plan.mesh_shape}, the backend's mesh is {backend.mesh.shape}")
    captured = graph if graph is not None else capture_model(module, tuple(example_inputs), capture)
    _same_nodes(plan, captured.graph)
    recipe = ModelRecipe(module, tuple(as_float64(t.detach().cpu()) for t in example_inputs), seed,
                         captured.capture, captured.graph)
    from shardverify.backends.registry import backend_label

    name = backend_label(backend)
    try:
        reports = backend.run(rank_run_plan, recipe, plan, timeout=timeout)
    except BackendError as error:
        ranks = getattr(error, "ranks", ()) or (getattr(error, "rank", -1),)
        node, order = failed_node(str(error)) or ("?", 0)
        frames = [line.strip() for line in getattr(error, "traceback_text", "").splitlines()
                  if line.strip().startswith("File ")][-3:]
        detail = str(error) + ("".join(f"\n      {frame}" for frame in frames) if frames else "")
        return PlanResult(plan, str(name), tuple(Mismatch("error", int(r), detail, phase="error", node=node, order=order) for r in ranks),
                          coverage)
    return PlanResult(plan, str(name), tuple(m for report in reports for m in report), coverage)


def _same_nodes(plan: Plan, graph) -> None:
    """Refuse a plan made on another graph than the one the ranks would run (another capture, or
    another model): its node names would name nodes the ranks do not have."""
    names = [node.name for node in graph.graph.nodes]
    if [item.node for item in plan.nodes] != names:
        missing = sorted(set(item.node for item in plan.nodes) - set(names))[:5]
        raise InvalidArgument(f"the plan was made on another graph than the one captured to run it "
                              f"({len(plan.nodes)} plan nodes, {len(names)} graph nodes"
                              + (f"; not in the graph: {missing}" if missing else "; in another order")
                              + "): make the plan with the same model, inputs and capture")


def verify_plan(model: torch.nn.Module, example_inputs, mesh, plan=None, *, backend: str | object = "simulated",
                memory_limit: int | None = None, seed: int = 0, capture: str = "auto",
                min_sharded: int = 0, shard_weights: bool = False, data_parallel: bool = False,
                timeout: float | None = None, strict: bool = False,
                verified_only: bool = False, cost_size: RealSize | None = None,
                solver: Solver | None = None, clock: PhaseClock | None = None,
                device: DeviceProfile = NOMINAL, workload: Workload = Workload()) -> PlanResult:
    """Plan ``model`` on ``mesh`` (the solver's plan when ``plan`` is None; else a
    ``{node name: strategy name}`` mapping or a Plan) and verify it on every rank against
    the single-device model, forward and backward. ``example_inputs``: a tensor, a sequence of
    them (by position), a mapping of keyword inputs (``{"decoder_input_ids": ...}``) or a
    (positional, keyword) pair; integer and bool inputs keep their dtype. ``capture``: ``"auto"``
    (torch.fx symbolic tracing, torch.export's ATen graph when fx cannot trace the model, said
    in ``notes``), ``"fx"`` or ``"export"``. The model runs in the mode it is in; a node that draws
    random numbers (dropout in training mode) is checked with every rank drawing from the single
    device's generator state, said in ``notes``.
    ``min_sharded``, ``shard_weights``, ``data_parallel``: what the solver's plan must do besides
    costing least (:class:`~shardverify.plan.model.PlanGoals`). ``strict``: a pass also needs
    every tensor op to have strategies and the plan to shard something (:func:`strict_problems`).
    ``timeout``: seconds the check may take on the backend (its default when None; a model of a
    hundred million parameters wants minutes). The result counts the nodes that ran without
    strategies. A call outside its spec's grid is verified where it is met (the coverage counts
    them, with any strategy found wrong there); ``verified_only`` refuses it instead. ``cost_size``:
    the model at the size it will train at (:class:`~shardverify.plan.real_size.RealSize`): the
    solver takes its costs (and ``memory_limit`` its memory) from that size, and its plan is mapped
    onto ``model`` node by node and verified there (``result.real_size`` says what it cost and what
    was left out). ``solver``: what picks the plan (:class:`~shardverify.plan.solver.Solver`; CBC when
    None). ``clock``: the CPU seconds of each phase are added to it (and the result's
    ``cpu_seconds`` is its split). Every error but a verification failure is a ShardVerifyError."""
    from shardverify.backends import get_backend
    from shardverify.backends.registry import backend_kind

    if isinstance(backend, str):
        backend_kind(backend)   # an unknown name is refused before the capture and the solver
    model, inputs = with_keywords(model, example_inputs)
    mesh = _as_mesh(mesh, device)
    goals = PlanGoals(min_sharded, shard_weights, data_parallel)
    clock = clock or PhaseClock()
    chosen, coverage, captured, at_real = _planned(model, inputs, mesh, plan, memory_limit, device, capture,
                                                  goals, verified_only, cost_size, solver, clock, workload)
    notes = tuple(note for note in (captured.note, drawing_note(captured.drawing)) if note)
    with clock.phase("check"):
        if isinstance(backend, str):
            runner = get_backend(backend, mesh)
            try:
                result = run_plan(runner, model, inputs, chosen, seed, timeout, coverage=coverage, graph=captured)
            finally:
                runner.close()
        else:
            result = run_plan(backend, model, inputs, chosen, seed, timeout, coverage=coverage, graph=captured)
    return replace(result, strict=strict, notes=notes, real_size=at_real, cpu_seconds=clock.split(),
                   graph_facts=facts_of(captured.graph, model))
