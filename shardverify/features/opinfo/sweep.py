"""The OpInfo sweep: every sample of an op spec's OpInfo entries captured (torch.fx and
torch.export) as a one-op module, served as a plan would serve it, every served strategy verified
at the call, and each call's outcome counted.

Outcomes of a call: ``grid`` (its spec's grid covered it), ``on-demand`` (verified where it was
met), ``refused`` (with the handler's reason), ``no-handler`` (the capture made it an op no spec
covers: export's decompositions), ``not-captured`` (the capture itself failed), ``raw-error`` (a
raw exception where a reason was owed: a bug), ``folded`` (the capture left no op to serve: a factory
on constants traced to a constant, ``x.contiguous()`` of a contiguous input exported as the input,
or only nodes a plan runs without strategies: uninitialised memory (``torch.empty``, never
compared), a factory of constants built whole on every rank; counted, but not among the calls a
share is taken of). A strategy served on the grid is verified at the call too, so a wrong one shows
as ``wrong``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from shardverify.capture.call import target_name, tuple_element
from shardverify.capture.decompose import decompose_unserved
from shardverify.capture.export import export_graph
from shardverify.capture.fx import trace
from shardverify.capture.randomness import draws_random
from shardverify.capture.uninitialised import is_uninitialised
from shardverify.errors import ShardVerifyError
from shardverify.features.opinfo.samples import Sample, entries_for, one_op_module, samples_of
from shardverify.plan.coverage import is_constant, shards, unserved
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.names import resolve_dotted
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.handlers.base import target_key
from shardverify.strategies.handlers.call_values import resolve_operands
from shardverify.strategies.handlers.serving import handler_for_node
from shardverify.verify.engine import verify_case
from shardverify.verify.on_demand import OnDemandVerifier, checkable_case

__all__ = ["CallOutcome", "SweepResult", "sweep_spec", "sweep_entry", "entry_name", "OUTCOMES"]

OUTCOMES = ("grid", "on-demand", "refused", "no-handler", "not-captured", "raw-error", "folded")
RANDOM = "draws random numbers"   # in the reason of a call unserved because it draws them


@dataclass(frozen=True)
class CallOutcome:
    op: str                          # the spec that served the call (else the one listing its entry)
    sample: str                      # entry#index(shapes)
    capture: str                     # fx or export
    mesh: tuple[int, ...]
    outcome: str
    reason: str = ""
    served_by: tuple[str, ...] = ()  # the specs whose handlers took the call's op nodes
    strategies: int = 0              # served
    sharded: int = 0                 # of those, ones that lay out a tensor sharded or communicate
    checked: int = 0                 # strategies verified at the call by the sweep itself
    wrong: tuple[str, ...] = ()      # served strategies that failed at the call
    #: of the failures, strategies taking a partial max or min input: plans leave those out
    #: (they carry partial sums only), so no plan is served them; counted apart
    wrong_extremum: tuple[str, ...] = ()


@dataclass
class SweepResult:
    outcomes: list[CallOutcome] = field(default_factory=list)
    defects: list[str] = field(default_factory=list)   # on-demand verification's rule defects
    seconds: float = 0.0

    def counts(self, op: str | None = None) -> Counter:
        return Counter(o.outcome for o in self.outcomes if op is None or o.op == op)

    @property
    def wrong(self) -> list[CallOutcome]:
        return [o for o in self.outcomes if o.wrong]


def _capture(sample: Sample, how: str) -> fx.GraphModule:
    """The sample's one-op module as a plan captures a model: torch.fx or torch.export, every node
    no handler serves decomposed into ATen ops that are served (PyTorch's own decompositions)."""
    module = one_op_module(sample)
    if how == "fx":
        graph = trace(module, {f"x{i}": t for i, t in enumerate(sample.tensors)})
    else:
        graph = export_graph(module, sample.tensors)
    return decompose_unserved(graph, lambda node: unserved(node, graph))


def _op_nodes(graph_module: fx.GraphModule, targets: set) -> list[fx.Node]:
    """The call nodes of the op under test: those whose target is a spec target, else (and for an
    entry no spec lists: no ``targets``) every call node that returns a tensor (the capture made
    the call into other ops, or a lambda called several), else every call returning a number
    computed from tensors."""
    calls = [n for n in graph_module.graph.nodes if n.op in ("call_function", "call_method", "call_module")
             and tuple_element(n) is None]   # an element of a tuple result is no op; x[:, :2] is
    mine = [n for n in calls if _is_target(n, targets)] if targets else []
    return mine or [n for n in calls if "tensor_meta" in n.meta] or [n for n in calls if _value_of_tensors(n)]


_METADATA = frozenset({"size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous",
                       "is_floating_point", "is_complex", "get_device", "data_ptr"})


def _value_of_tensors(node: fx.Node) -> bool:
    """A call returning a Python number computed from tensors' values (``torch.equal``,
    ``x.item()``), not their metadata (``x.size()``): a call a layout changes, so never folded."""
    return node.meta.get("type") in (bool, int, float, complex) and node.target is not getattr \
        and getattr(node.target, "__name__", node.target) not in _METADATA \
        and any(isinstance(a, fx.Node) for a in node.all_input_nodes)


def _is_target(node: fx.Node, targets: set) -> bool:
    try:
        return node.target in targets
    except TypeError:           # an unhashable target
        return False


def _extremum(strategy) -> bool:
    return any(p.op != "sum" for p in strategy.partial_inputs)


_RANK = {name: i for i, name in enumerate(OUTCOMES)}


def _node_outcome(node: fx.Node, graph_module: fx.GraphModule, mesh: DeviceMesh, verifier: OnDemandVerifier,
                  check_grid: bool) -> dict | None:
    """One op node's outcome (the fields of a :class:`CallOutcome` it decides), or None for a node a
    plan serves without strategies, as :func:`~shardverify.plan.coverage.classify_nodes` does: an
    allocation of uninitialised memory (never compared), a factory of constants no handler
    describes (built whole on every rank)."""
    if is_uninitialised(node):
        return None
    handler = handler_for_node(node, graph_module)
    if handler is None:
        if is_constant(node):
            return None
        if draws_random(node, graph_module):
            return dict(outcome="no-handler", reason=f"{target_name(node)} {RANDOM} and no spec serves it: a rank "
                                                     "drawing its block draws other numbers than one device; write a "
                                                     "spec whose tensors stay whole (whole_tensors), checked with "
                                                     "every rank drawing the whole tensor from one generator state")
        return dict(outcome="no-handler", reason=f"captured as {target_name(node)}")
    before = len(verifier.records)
    try:
        served = list(strategies_for_node(graph_module, node.name, mesh, on_demand=verifier))
    except ShardVerifyError as error:
        if is_constant(node):
            return None
        return dict(outcome="refused", reason=str(error).splitlines()[0], served_by=handler.name)
    except Exception as error:  # noqa: BLE001 - a raw exception is a bug the sweep reports
        return dict(outcome="raw-error", reason=f"{type(error).__name__}: {error}"[:300], served_by=handler.name)
    on_demand = len(verifier.records) > before
    wrong, extremum, checked = (), (), 0
    if check_grid and not on_demand:   # the grid's verdict, checked at this very call
        try:
            case = checkable_case(handler, graph_module, node, resolve_operands(handler, node, graph_module))
            results = verify_case(verifier.backend(mesh), case, served)
        except ShardVerifyError as error:
            said = str(error) if "at this call" in str(error) else f"cannot be verified at this call: {error}"
            return dict(outcome="refused", reason=said[:300], served_by=handler.name)
        except Exception as error:  # noqa: BLE001 - a raw exception is a bug the sweep reports
            return dict(outcome="raw-error", reason=f"verifying at the call: {type(error).__name__}: {error}"[:300],
                        served_by=handler.name)
        failed = {r.strategy for r in results if not r.passed}
        checked = len(results)
        wrong = tuple(st.name for st in served if st.name in failed and not _extremum(st))
        extremum = tuple(st.name for st in served if st.name in failed and _extremum(st))
    return dict(outcome="on-demand" if on_demand else "grid", served_by=handler.name, strategies=len(served),
                sharded=sum(map(shards, served)), checked=checked, wrong=wrong, wrong_extremum=extremum)


def _classify(op: str, sample: Sample, how: str, mesh: DeviceMesh, verifier: OnDemandVerifier,
              targets: set, check_grid: bool) -> CallOutcome:
    """The call's one outcome: served only when every op node it captured as is served; else the
    worst node's outcome and reason. ``op`` names the call where no handler served a node."""
    base = dict(op=op, sample=sample.describe(), capture=how, mesh=tuple(mesh.shape))
    try:
        graph_module = _capture(sample, how)
    except Exception as error:  # noqa: BLE001 - torch's capture refused the sample
        return CallOutcome(**base, outcome="not-captured", reason=f"{type(error).__name__}: "
                                                                 f"{str(error).splitlines()[0][:160] if str(error) else ''}")
    found = [f for node in _op_nodes(graph_module, targets)
             if (f := _node_outcome(node, graph_module, mesh, verifier, check_grid)) is not None]
    if not found:   # torch.arange(5) traced to a constant, x.contiguous() exported as x: no op to serve
        return CallOutcome(**base, outcome="folded", reason="the capture left no op call (a constant, the input, or "
                                                            "uninitialised memory, never compared)")
    worst = max(found, key=lambda f: _RANK[f["outcome"]])
    by = tuple(dict.fromkeys(f["served_by"] for f in found if f.get("served_by")))
    return CallOutcome(**{**base, "op": by[0] if by else op}, outcome=worst["outcome"], reason=worst.get("reason", ""),
                       served_by=by, strategies=sum(f.get("strategies", 0) for f in found),
                       sharded=sum(f.get("sharded", 0) for f in found),
                       checked=sum(f.get("checked", 0) for f in found),
                       wrong=tuple(w for f in found for w in f.get("wrong", ())),
                       wrong_extremum=tuple(w for f in found for w in f.get("wrong_extremum", ())))


def entry_name(entry) -> str:
    """An OpInfo entry's unique name: its op's name and its variant's."""
    return entry.name + (f".{entry.variant_test_name}" if entry.variant_test_name else "")


def sweep_entry(entry, op: str, targets: Sequence[object], meshes: Sequence[tuple[int, ...]] = ((2, 2), (4,)),
                captures: Sequence[str] = ("fx", "export"), limit: int = 24, verifier: OnDemandVerifier | None = None,
                check_grid: bool = True, seed: int = 0) -> SweepResult:
    """Every sample of one OpInfo entry (at most ``limit``, a fixed draw) under each capture and
    mesh: one outcome per call. ``op`` names the spec that listed the entry (a call no spec served
    is counted under it); ``targets`` are the targets that make a captured node the op under test
    (none, for an entry no spec lists: every op node its captures hold)."""
    start = time.perf_counter()
    keys = {target_key(t) for t in targets} | set(targets)
    own = verifier is None
    verifier = verifier or OnDemandVerifier()
    first = len(verifier.records)
    result = SweepResult()
    try:
        for sample in samples_of(entry, torch.float64, limit, seed):
            for how in captures:
                for shape in meshes:
                    result.outcomes.append(_classify(op, sample, how, DeviceMesh(tuple(shape)), verifier, keys,
                                                     check_grid))
        result.defects = [r.defect() for r in verifier.records[first:] if r.failed]
    finally:
        if own:
            verifier.close()
    result.seconds = time.perf_counter() - start
    return result


def sweep_spec(spec, meshes: Sequence[tuple[int, ...]] = ((2, 2), (4,)), captures: Sequence[str] = ("fx", "export"),
               limit: int = 24, verifier: OnDemandVerifier | None = None, check_grid: bool = True,
               seed: int = 0) -> SweepResult:
    """Every OpInfo sample (at most ``limit`` per entry, a fixed draw) of the spec's targets, under
    each capture and mesh."""
    targets = [resolve_dotted(t.name) for t in spec.targets]
    own = verifier is None
    verifier = verifier or OnDemandVerifier()
    result = SweepResult()
    try:
        for entry in entries_for(targets):
            found = sweep_entry(entry, spec.name, targets, meshes, captures, limit, verifier, check_grid, seed)
            result.outcomes += found.outcomes
            result.defects += found.defects
            result.seconds += found.seconds
    finally:
        if own:
            verifier.close()
    return result
