"""The op kind: one YAML file per op in specs/ expands into a registered handler and a
generated pytest module that verifies every strategy numerically (plus property and audit
tests); this module says which files, from which templates, with which runs, and what
`shardverify list` prints. The spec model itself lives in `shardverify.spec.op`; this module
only reads validated values, and `shardverify.codegen` renders the templates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardverify.pysource import ModelSource, py_model
from shardverify.spec.kinds import SpecKind, TemplateRenderer
from shardverify.spec.op import CaseSpec, CountSpec, OpSpec, parse_op_spec

__all__ = ["render_op_spec", "handler_source", "HandlerSource", "process_runs", "simulated_runs", "summarize_op_spec", "audit_meshes", "OP_KIND", "HANDLER_DIR", "TEST_DIR"]

HANDLER_DIR = "shardverify/strategies/handlers/generated"
TEST_DIR = "generated_tests"


def audit_meshes(meshes) -> list[tuple[int, ...]]:
    """The meshes a generated audit test runs on: the spec's 1-D and 2-D ones (a 3-D audit of a
    3-operand op takes minutes: run it with ``shardverify audit --mesh 2,2,2``)."""
    return [tuple(mesh) for mesh in meshes if len(mesh) <= 2]


def _matches(count: CountSpec, case: CaseSpec) -> bool:
    point = dict(case.point)
    return (count.target in (None, case.target) and
            all(key in point and point[key] == value and type(point[key]) is type(value)
                for key, value in count.where))


def _mesh_id(mesh: tuple[int, ...]) -> str:
    return "mesh" + "x".join(str(size) for size in mesh)


def _cases_by_point(cases: tuple[CaseSpec, ...]) -> list[list[int]]:
    """The case indices of each grid point (one per target taking it), points in case order."""
    by_point: dict[str, list[int]] = {}
    for index, case in enumerate(cases):
        by_point.setdefault(repr(case.point), []).append(index)
    return list(by_point.values())


def process_runs(cases: tuple[CaseSpec, ...], meshes) -> list[tuple[int, tuple[int, ...], str]]:
    """(case index, mesh, test id) of the process-backend runs: every mesh of one or two axes and
    every grid point at least once (run j takes point j and mesh j, each modulo its count), the
    targets taking each point in turns. The process backend adds real collectives over the
    mesh's groups, which depend on the mesh and not on the op, the target or the grid point; the
    simulated backend, with the same semantics, runs the cases :func:`simulated_runs` lists. A
    mesh of three axes (eight processes on a CI machine of two cores) runs its real collectives
    in its resharding spec, every layout pair on gloo (specs/reshard/mesh_2x2x2.yaml), and in an
    op spec only when it lists no smaller mesh."""
    meshes = [mesh for mesh in meshes if len(mesh) <= 2] or list(meshes)
    points = _cases_by_point(cases)
    runs = set()
    for j in range(max(len(points), len(meshes))):
        indices, mesh = points[j % len(points)], tuple(meshes[j % len(meshes)])
        index = indices[(j // len(points)) % len(indices)]
        runs.add((index, mesh, f"{cases[index].id}-{_mesh_id(mesh)}"))
    return sorted(runs)


def simulated_runs(cases: tuple[CaseSpec, ...], meshes) -> list[tuple[int, tuple[int, ...], str]]:
    """(case index, mesh, test id) of the simulated-backend runs: every case on the spec's
    smallest mesh (fewest axes, then fewest ranks); on every other mesh of one or two axes each
    grid point once, the targets taking it in turns (shifted per mesh); on a mesh of three axes
    one grid point, taken in turns with the targets. What tells targets apart (how the call is
    captured and its operands found) does not depend on the mesh, what tells grid points apart
    shows on the smaller meshes, while the layouts multiply on larger ones (a product of two
    factors has 276 strategies on (2, 2, 2)). ``shardverify verify`` runs every case on every
    mesh."""
    points = _cases_by_point(cases)
    every = min((tuple(m) for m in meshes), key=lambda m: (len(m), math.prod(m)), default=None)
    runs = []
    for at, mesh in enumerate(meshes):
        mesh = tuple(mesh)
        if mesh == every:
            chosen = range(len(cases))
        elif len(mesh) >= 3:
            indices = points[at % len(points)]
            chosen = [indices[at % len(indices)]]
        else:
            chosen = [indices[(at + shift) % len(indices)] for shift, indices in enumerate(points)]
        runs += [(index, mesh, f"{cases[index].id}-{_mesh_id(mesh)}") for index in chosen]
    return runs


@dataclass(frozen=True)
class HandlerSource:
    """The parsed declarations and rule of a spec as the source its handler holds them in, and
    the classes that source names ((module, names) to import)."""

    imports: tuple[tuple[str, tuple[str, ...]], ...]
    operands: str
    params: str
    rule: str
    overrides: tuple[tuple[str, str, str], ...]    # (ATen target, its operands, its params)


def handler_source(spec: OpSpec) -> HandlerSource:
    """The source of what the generated handler registers, built from the parsed spec."""
    parts: list[ModelSource] = []

    def source(value: object, indent: int = 4) -> str:
        if isinstance(value, tuple) and value:   # one item a line
            items = [py_model(item) for item in value]
            parts.extend(items)
            pad = " " * (indent + 4)
            return "(\n" + "".join(f"{pad}{item.text},\n" for item in items) + " " * indent + ")"
        parts.append(py_model(value, indent))
        return parts[-1].text

    operands, params, rule = source(spec.operands), source(spec.params), source(spec.rule)
    parts.append(ModelSource("", (("shardverify.strategies.handlers.base", "HandlerDef"),
                                  ("shardverify.strategies.handlers.base", "register_handler"))))
    overrides = tuple((t.name, source(t.operands, 8), source(t.params, 8)) for t in spec.targets if t.aten)
    modules: dict[str, set[str]] = {}
    for part in parts:
        for module, name in part.imports:
            modules.setdefault(module, set()).add(name)
    return HandlerSource(tuple((m, tuple(sorted(n))) for m, n in sorted(modules.items())),
                         operands, params, rule, overrides)


def render_op_spec(spec: OpSpec, renderer: TemplateRenderer) -> dict[str, str]:
    """{handler module path: text, test module path: text} for one op spec."""
    cases = spec.cases()
    counts = [(index, count.mesh, count.count, f"{case.id}-{_mesh_id(count.mesh)}")
              for count in spec.verify.counts
              for index, case in enumerate(cases) if _matches(count, case)]
    handler = renderer.render("op_handler.py.j2", spec=spec, model=handler_source(spec))
    test = renderer.render("op_test.py.j2", spec=spec, cases=spec.op_cases(), counts=counts,
                           meshes=[(mesh, _mesh_id(mesh)) for mesh in spec.verify.meshes],
                           simulated=simulated_runs(cases, spec.verify.meshes),
                           process=process_runs(cases, spec.verify.meshes))
    outputs = {f"{HANDLER_DIR}/{spec.name}.py": handler, f"{TEST_DIR}/test_{spec.name}.py": test}
    # --- property tests (shardverify.features.explore): hypothesis beyond the listed grid ---
    if spec.verify.explore:
        outputs[f"{TEST_DIR}/test_{spec.name}_properties.py"] = renderer.render("op_property_test.py.j2", spec=spec)
    # --- end property tests ---
    # --- completeness audit (shardverify.features.audit): no valid strategy missing ---
    meshes = [] if spec.audit_skip else spec.audit_meshes or audit_meshes(spec.verify.meshes)
    if meshes:
        # the runs of the simulated backend's rule: the capture tells targets apart, the layouts
        # (thousands of combinations on a 2-D mesh) multiply with the mesh
        runs = [(cases[index].id, mesh, run_id) for index, mesh, run_id in simulated_runs(cases, meshes)]
        outputs[f"{TEST_DIR}/test_{spec.name}_audit.py"] = renderer.render("op_audit_test.py.j2", spec=spec, runs=runs)
    # --- end completeness audit ---
    return outputs


def summarize_op_spec(spec: OpSpec) -> dict[str, str]:
    """The columns `shardverify list` prints for an op."""
    grid = " x ".join(f"{key}[{len(values)}]" for key, values in spec.verify.grid) or "none"
    options = ", ".join(f"{key}={value!r}" for key, value in spec.options)
    summary = {
        "targets": ", ".join(t.name for t in spec.targets),
        "generator": spec.generator + (f" ({options})" if options else ""),
        "grid": f"{spec.grid_size()} point(s): {grid}",
        "cases": f"{len(spec.cases())} (targets x the grid points each takes)",
        "meshes": " ".join(str(list(mesh)) for mesh in spec.verify.meshes),
    }
    if spec.verify.counts:
        summary["strategies"] = "; ".join(
            f"{count.count} on {list(count.mesh)}"
            + "".join(f", {key}={value!r}" for key, value in count.where)
            + (f", {count.target}" if count.target else "")
            for count in spec.verify.counts)
    return summary


OP_KIND = SpecKind(name="op", subdir="", parse=parse_op_spec, render=render_op_spec,  # type: ignore[arg-type]
                   summary=summarize_op_spec, name_key="op")  # type: ignore[arg-type]
