"""DTensor as a second oracle: for the same input layouts, which output placement does
``torch.distributed.tensor`` propagate, and does it need communication to get there?

DTensor runs in this process on a *fake* process group (``torch.testing``'s FakeStore: no
network, collectives are hallucinated), so only its sharding propagation is consulted; a
collective counted by ``CommDebugMode`` means DTensor has no rule that runs the op on these
placements directly. Where DTensor and the audit disagree, the audit's numerical check of
DTensor's claimed output layout on the real local outputs decides who is right.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from shardverify.sharding.layout import Layout
from shardverify.features.audit.combinations import CaseCombinations, outputs_hold
from shardverify.features.dtensor.placements import layout_of
from shardverify.features.dtensor.world import fake_world

__all__ = ["Disagreement", "DTensorReport", "compare_case", "compare_specs", "format_disagreements"]

STRIDED = "DTensor output strided"   # a _StridedShard output: outside the audit's block layouts


@dataclass(frozen=True)
class Disagreement:
    """One input combination where DTensor and shardverify's numerical decision differ."""

    kind: str          # "dtensor-missing" | "dtensor-wrong" | "shardverify-wrong" | "dtensor-error" | "dtensor-strided"
    line: str
    shardverify: str
    dtensor: str
    right: str         # who the numerical check says is right

    def to_json(self) -> dict:
        return {"kind": self.kind, "line": self.line, "shardverify": self.shardverify, "dtensor": self.dtensor,
                "right": self.right}


@dataclass
class DTensorReport:
    op: str
    case: str
    mesh: tuple[int, ...]
    counts: Counter = field(default_factory=Counter)
    disagreements: list[Disagreement] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "mesh": list(self.mesh), "counts": dict(self.counts),
                "disagreements": [d.to_json() for d in self.disagreements], "note": self.note or None}


def _placements(layout: Layout, ndim: int):
    """DTensor placements for ``layout`` (None where DTensor has no plain equivalent: S10)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements: list = [Replicate() for _ in range(ndim)]
    for dim, axes in enumerate(layout.dims):
        if list(axes) != sorted(axes):
            return None   # DTensor shards a dim over mesh dims in mesh order; S10 needs _StridedShard
        for axis in axes:
            placements[axis] = Shard(dim)
    for axis in layout.partial:
        placements[axis] = Partial(layout.reduce)
    return placements


class _watch_resharding:
    """Record whether DTensor changes any input's placements before running a (decomposed) op:
    R -> Shard is a local slice, so counting collectives alone would miss it."""

    def __init__(self, found: list[bool]) -> None:
        self.found = found

    def __enter__(self) -> None:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.utils import _pytree as pytree

        dispatcher = DTensor._op_dispatcher
        original = type(dispatcher).redistribute_local_args
        found = self.found

        def watched(op_info, schema, use_val):
            flat = (pytree.tree_leaves(schema.args_schema) if op_info.args_tree_spec is not None
                    else schema.args_schema)
            if any(isinstance(a, DTensorSpec) and isinstance(b, DTensorSpec) and a.placements != b.placements
                   for a, b in zip(op_info.flat_args_schema, flat)):
                found.append(True)
            return original(op_info, schema, use_val)

        dispatcher.redistribute_local_args = watched
        self.dispatcher = dispatcher

    def __exit__(self, *exc) -> None:
        del self.dispatcher.redistribute_local_args


def _dtensor_outputs(audit: CaseCombinations, mesh, combo) -> tuple[str, tuple[Layout, ...] | None]:
    """("ok", output layouts) when DTensor runs the op with no collective, ("comm", None) when it
    redistributes, ("strided: ...", None) when its output is a _StridedShard (interleaved, no
    block layout), ("error: ...", None) when it refuses."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from shardverify.capture.call import call_op

    problem = audit.problem
    values = {}
    for operand, layout in zip(audit.operands, combo):
        full = problem.values[operand.locator]
        placements = _placements(layout, problem.mesh.ndim)
        local = full[problem.slices(layout, operand.shape, 0)]
        if local.is_floating_point():
            local = local.to(torch.float32)   # integer operands (indices, targets) keep their dtype
        local = local.contiguous()
        values[operand.locator] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                     shape=full.shape, stride=full.contiguous().stride())
    resharded: list[bool] = []
    try:
        with CommDebugMode() as comm, torch.no_grad(), _watch_resharding(resharded):
            out = call_op(problem.node, problem.module, values)
    except Exception as exc:  # DTensor has no strategy, or rejects these placements
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}", None
    if comm.get_total_counts() or resharded:
        return "comm", None
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    found = []
    for k in problem.out_index:
        item = outs[k]
        if not isinstance(item, DTensor):
            return "error: a non-DTensor output", None
        layout = layout_of(item.placements, item.dim())
        if layout is None:
            # a _StridedShard: every rank holds an interleaved slice, not a block; a layout of its
            # own that no shardverify layout (blocks only) is, so the comparison cannot judge it
            return f"strided: {', '.join(map(str, item.placements))}", None
        found.append(layout.normalized(problem.mesh.shape))
    return "ok", tuple(found)


def _holds(audit: CaseCombinations, combo, outputs) -> bool:
    return outputs_hold(audit.problem, combo, outputs)


def compare_case(spec, case_id: str, case, mesh_shape: tuple[int, ...], point: dict | None = None) -> DTensorReport:
    """Compare DTensor's propagation with the audit's decision on every expressible input
    combination of one case, partial inputs included, absent ones not; every member of a mesh-axis
    orbit is asked (DTensor's rules are not symmetric under swapping mesh axes)."""
    report = DTensorReport(spec.name, case_id, tuple(mesh_shape))
    audit = CaseCombinations(spec, case, tuple(mesh_shape), partial_inputs=True, extremum_inputs=False)
    audit.enumerate()
    with fake_world(tuple(mesh_shape)) as mesh:
        for combo, outcome in audit.results.items():
            if any(layout.absent for layout in combo):
                continue
            if any(_placements(layout, audit.mesh.ndim) is None for layout in combo):
                report.counts["not expressible in DTensor"] += 1
                continue
            status, theirs = _dtensor_outputs(audit, mesh, combo)
            ours = ", ".join(map(str, outcome.outputs)) if outcome.valid else f"invalid ({outcome.reason})"
            line = " ".join(f"{o.role}={layout}" for o, layout in zip(audit.operands, combo))
            if status == "comm":
                if outcome.valid:
                    report.counts["valid, DTensor communicates"] += 1
                    report.disagreements.append(Disagreement("dtensor-missing", line, ours,
                                                             "redistributes first", "shardverify"))
                else:
                    report.counts["agree: invalid"] += 1
                continue
            if status.startswith("strided"):
                report.counts[STRIDED] += 1
                if outcome.valid:
                    report.disagreements.append(Disagreement("dtensor-strided", line, ours, status,
                                                             "undecided (a strided layout is outside the audit's)"))
                continue
            if status != "ok":
                report.counts["DTensor error"] += 1
                if outcome.valid:
                    report.disagreements.append(Disagreement("dtensor-error", line, ours, status, "shardverify"))
                continue
            shown = ", ".join(map(str, theirs))
            if outcome.valid and theirs == outcome.outputs:
                report.counts["agree: same output"] += 1
            elif _holds(audit, combo, theirs):
                if outcome.valid:
                    report.counts["agree: equivalent output"] += 1
                else:
                    report.counts["shardverify wrong"] += 1
                    report.disagreements.append(Disagreement("shardverify-wrong", line, ours, shown, "DTensor"))
            else:
                report.counts["DTensor wrong"] += 1
                report.disagreements.append(Disagreement("dtensor-wrong", line, ours, shown, "shardverify"))
    return report


def compare_specs(specs, meshes=None) -> list[DTensorReport]:
    """Every case of every spec on its 1-D and 2-D meshes (or ``meshes``)."""
    reports = []
    for spec in specs:
        for case_spec, (case_id, case) in zip(spec.cases(), spec.op_cases()):
            for mesh in meshes or spec.verify.meshes:
                if len(mesh) > 2:
                    continue
                try:
                    reports.append(compare_case(spec, case_id, case, tuple(mesh), dict(case_spec.point)))
                except Exception as exc:  # reported, never skipped silently
                    reports.append(DTensorReport(spec.name, case_id, tuple(mesh),
                                                 note=f"{type(exc).__name__}: {exc}"))
    return reports


def format_disagreements(reports: list[DTensorReport], show: int = 10) -> str:
    lines = ["DTensor comparison (fake process group, in-process):"]
    for r in reports:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(r.counts.items()))
        lines.append(f"  {r.op} {r.case} mesh {list(r.mesh)}: {counts or 'nothing compared'}"
                     + (f" [{r.note}]" if r.note else ""))
        for d in r.disagreements[:show]:
            lines.append(f"    {d.kind}: {d.line}: shardverify {d.shardverify}; DTensor {d.dtensor}; "
                         f"right: {d.right}")
        if len(r.disagreements) > show:
            lines.append(f"    ... {len(r.disagreements) - show} more (--json)")
    return "\n".join(lines)
