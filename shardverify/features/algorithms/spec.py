"""The "collective" spec kind: ``specs/collectives/<name>.yaml`` -> a generated pytest module
``generated_tests/test_collective_<name>.py`` that verifies one implementation of a
collective against its reference on the simulated backend, against the
``torch.distributed`` builtin on the process backend, and by ``gradcheck``.

A spec (every key but the marked ones is optional)::

    name: ring_all_reduce                                  # required, an identifier
    description: ...
    implementation: shardverify.features.algorithms.implementations.ring_all_reduce  # required: fn(comm, t, axes, **params)
    reference: all_reduce                                  # required: a key of REFERENCES
    group_sizes: [2, 3, 4]                                 # 1-D meshes (g,), axes [0]
    meshes: [{shape: [2, 2], axes: [1]}]                   # other meshes and axes
    dtypes: [float32, float64, int64]                      # required
    shapes: [[], [7], [3, 4]]                              # required: local input shapes ([] is 0-d)
    params: {dim: [0, 1]}                                  # grid; passed to the implementation
    backward: true                                         # also check gradients (float dtypes)
    gradcheck_shapes: [[2, 2]]                             # float64 gradcheck cases
    seed: 0
    rtol: 1.0e-5                                           # tolerance overrides
    atol: 1.0e-5

The grid is meshes x params x dtypes x shapes. Points the reference calls impossible (a
dim out of range, a size not divisible by the group) stay in it: their test checks that
the implementation raises ``CollectiveError``. Gradcheck points that are impossible are
left out (the grid already checks their error).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from shardverify.spec.fields import (Fields, allowed_definition, as_dtype, as_identifier, as_mesh, as_shape,
                                     as_tolerance, check_type, describe, finite_number)
from shardverify.spec.kinds import TemplateRenderer
from shardverify.spec.limits import MAX_MESH_RANKS
from shardverify.spec.loader import Node
from shardverify.spec.trust import find_definition
from shardverify.features.algorithms.check import CollectiveCase
from shardverify.features.algorithms.references import REFERENCES, REQUIRED, get_reference

__all__ = ["MeshSpec", "CollectiveSpec", "parse_collective_spec", "render_collective_spec",
           "summarize_collective_spec", "case_id", "TEST_DIR", "DTYPES"]

TEST_DIR = "generated_tests"
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z")

Literal = object   # None, bool, int, float or str, validated


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    axes: tuple[int, ...]


@dataclass(frozen=True)
class CollectiveSpec:
    name: str
    source: str
    description: str
    implementation: str
    reference: str
    meshes: tuple[MeshSpec, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    params: tuple[tuple[str, tuple[Literal, ...]], ...]
    backward: bool = True
    gradcheck_shapes: tuple[tuple[int, ...], ...] = ()
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None

    def param_points(self) -> list[tuple[tuple[str, Literal], ...]]:
        names = [name for name, _ in self.params]
        return [tuple(zip(names, values)) for values in itertools.product(*(v for _, v in self.params))]

    def _case(self, mesh: MeshSpec, shape, dtype: str, point) -> CollectiveCase:
        return CollectiveCase(self.name, self.implementation, self.reference, mesh.shape, mesh.axes,
                              shape, dtype, point, self.backward, self.seed, self.rtol, self.atol)

    def cases(self) -> tuple[CollectiveCase, ...]:
        """Every grid point, mesh-major (a process pool serves a run of consecutive tests)."""
        return tuple(self._case(mesh, shape, dtype, point)
                     for mesh in self.meshes for point in self.param_points()
                     for dtype in self.dtypes for shape in self.shapes)

    def gradcheck_cases(self) -> tuple[CollectiveCase, ...]:
        """float64 points of ``gradcheck_shapes`` that the reference calls possible."""
        ref = get_reference(self.reference)
        found = []
        for mesh in self.meshes:
            p = 1
            for axis in mesh.axes:
                p *= mesh.shape[axis]
            for point in self.param_points():
                for shape in self.gradcheck_shapes:
                    if ref.invalid(shape, p, ref.resolve(dict(point))) is None:
                        found.append(self._case(mesh, shape, "float64", point))
        return tuple(found)


def case_id(case: CollectiveCase) -> str:
    """A short pytest id: ``g3-float32-3x4-dim=1`` or ``m2x2a1-...`` for other meshes."""
    if len(case.mesh_shape) == 1 and case.axes == (0,):
        mesh = f"g{case.mesh_shape[0]}"
    else:
        mesh = "m" + "x".join(map(str, case.mesh_shape)) + "a" + "".join(map(str, case.axes))
    shape = "x".join(map(str, case.shape)) or "0d"
    params = "".join(f"-{key}={value}" for key, value in case.params)
    return f"{mesh}-{case.dtype}-{shape}{params}"


# --------------------------------------------------------------------------- parsing


def _list(node: Node, what: str, *, allow_empty: bool = False) -> list[Node]:
    check_type(node, list)
    items = node.value
    assert isinstance(items, list)
    if not items and not allow_empty:
        raise node.error(f"expected a non-empty list of {what}")
    return items


def _implementation(node: Node) -> str:
    check_type(node, str)
    name = str(node.value)
    if not _DOTTED.match(name):
        raise node.error(f"expected a dotted name 'package.module.function', got {name!r}")
    definition = allowed_definition(node, "implementation")   # only what may run, read, not imported
    if definition.kind != "function":
        raise node.error(f"implementation {name!r} is a class; expected a function fn(comm, t, axes, ...)")
    return name


def _mesh(node: Node) -> MeshSpec:
    fields = Fields(node)
    shape = as_mesh(fields.required("shape", list))
    axes_node = fields.required("axes", list)
    fields.finish()
    axes = []
    for item in _list(axes_node, "mesh axes"):
        if isinstance(item.value, bool) or not isinstance(item.value, int) or not 0 <= item.value < len(shape):
            raise item.error(f"expected a mesh axis of mesh shape {list(shape)} (0..{len(shape) - 1}), "
                             f"got {describe(item)}")
        if item.value in axes:
            raise item.error(f"mesh axis {item.value} is repeated")
        axes.append(item.value)
    return MeshSpec(shape, tuple(axes))


def _meshes(fields: Fields, root: Node) -> tuple[MeshSpec, ...]:
    meshes = []
    sizes = fields.optional("group_sizes", list)
    if sizes is not None:
        for item in _list(sizes, "group sizes"):
            if isinstance(item.value, bool) or not isinstance(item.value, int) or item.value < 2:
                raise item.error(f"expected a group size >= 2, got {describe(item)}")
            too_many = MAX_MESH_RANKS.exceeded(item.value)
            if too_many:
                raise item.error(too_many)
            meshes.append(MeshSpec((item.value,), (0,)))
    extra = fields.optional("meshes", list)
    if extra is not None:
        meshes.extend(_mesh(item) for item in _list(extra, "meshes"))
    if not meshes:
        raise root.error("a collective spec needs 'group_sizes' or 'meshes'")
    for i, mesh in enumerate(meshes):
        if mesh in meshes[:i]:
            node = extra if extra is not None else sizes
            raise node.error(f"mesh {list(mesh.shape)} with axes {list(mesh.axes)} is listed twice")
    return tuple(meshes)


def _params(node: Node | None) -> tuple[tuple[str, tuple[Literal, ...]], ...]:
    if node is None:
        return ()
    fields = Fields(node)
    params = []
    for key in fields.keys():
        values = fields.required(key, list)
        key_node = node.value[key]  # type: ignore[index]
        name = as_identifier(Node(key, key_node.file, key_node.key_line or key_node.line, key_node.path))
        items = []
        for item in _list(values, f"values of {name}"):
            check_type(item, (int, str, bool, float, type(None)))
            if isinstance(item.value, float):
                finite_number(item)
            items.append(item.value)
        params.append((name, tuple(items)))
    fields.finish()
    return tuple(params)


def _check_signature(implementation: str, params, node: Node, points) -> None:
    """Every grid point must bind to ``fn(comm, t, axes, **point)``."""
    signature = find_definition(implementation).signature
    if signature is None:
        return   # builtins without a signature: checked when the tests run
    for point in points:
        try:
            signature.bind(None, None, None, **dict(point))
        except TypeError as exc:
            raise node.error(f"{implementation}(comm, t, axes, **{dict(point)!r}) does not bind: {exc}") from None


def _tolerance(fields: Fields, key: str) -> float | None:
    node = fields.optional(key, float)
    return None if node is None else as_tolerance(node)


def parse_collective_spec(root: Node) -> CollectiveSpec:
    """Validate a collective spec eagerly; every SpecError names file, line and field."""
    fields = Fields(root)
    name = as_identifier(fields.required("name", str))
    description_node = fields.optional("description", str)
    implementation_node = fields.required("implementation", str)
    implementation = _implementation(implementation_node)
    reference_node = fields.required("reference", str)
    reference = str(reference_node.value)
    if reference not in REFERENCES:
        raise reference_node.error(f"unknown reference {reference!r}; known: {', '.join(REFERENCES)}")
    meshes = _meshes(fields, root)
    dtypes = []
    for item in _list(fields.required("dtypes", list), "dtypes"):
        dtype = as_dtype(item)
        if dtype not in DTYPES:
            raise item.error(f"dtype {dtype!r} is not supported by collective checks; use one of {', '.join(DTYPES)}")
        dtypes.append(dtype)
    shapes = tuple(as_shape(item) for item in _list(fields.required("shapes", list), "shapes"))
    params_node = fields.optional("params", dict)
    params = _params(params_node)
    backward_node = fields.optional("backward", bool)
    backward = True if backward_node is None else bool(backward_node.value)
    gradcheck_node = fields.optional("gradcheck_shapes", list)
    gradcheck = () if gradcheck_node is None else tuple(
        as_shape(item) for item in _list(gradcheck_node, "shapes", allow_empty=True))
    if gradcheck and not backward:
        raise gradcheck_node.error("gradcheck_shapes needs backward: true")
    seed_node = fields.optional("seed", int)
    seed = 0 if seed_node is None else int(seed_node.value)  # type: ignore[arg-type]
    if seed < 0:
        raise seed_node.error(f"expected a seed >= 0, got {seed}")
    rtol, atol = _tolerance(fields, "rtol"), _tolerance(fields, "atol")
    fields.finish()

    ref = get_reference(reference)
    given = {key for key, _ in params}
    for key, default in ref.params:
        if default is REQUIRED and key not in given:
            raise (params_node or root).error(f"reference {reference!r} needs the parameter '{key}' in params")
    spec = CollectiveSpec(name, root.file, "" if description_node is None else str(description_node.value),
                          implementation, reference, meshes, tuple(dtypes), shapes, params, backward,
                          gradcheck, seed, rtol, atol)
    _check_signature(implementation, params, params_node or implementation_node, spec.param_points())
    return spec


# --------------------------------------------------------------------------- rendering


def render_collective_spec(spec: CollectiveSpec, renderer: TemplateRenderer) -> dict[str, str]:
    """{generated_tests/test_collective_<name>.py: text}."""
    cases = [(case, case_id(case)) for case in spec.cases()]
    gradcheck = [(case, case_id(case)) for case in spec.gradcheck_cases()]
    text = renderer.render("collective_test.py.j2", spec=spec, cases=cases, gradcheck=gradcheck)
    return {f"{TEST_DIR}/test_collective_{spec.name}.py": text}


def summarize_collective_spec(spec: CollectiveSpec) -> dict[str, str]:
    """The columns `shardverify list` prints for a collective."""
    meshes = " ".join(f"{list(m.shape)}@{list(m.axes)}" for m in spec.meshes)
    return {
        "implementation": spec.implementation,
        "reference": spec.reference,
        "cases": f"{len(spec.cases())} (+{len(spec.gradcheck_cases())} gradcheck)",
        "meshes": meshes,
    }
