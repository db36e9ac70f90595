"""A user's own op and DTensor rule, verified by execution like the shipped ops.

The user's module registers the op (``torch.library``) and its DTensor sharding rule
(``torch.distributed.tensor.experimental.register_sharding`` or DTensor's strategy
registration); a YAML file describes the call and the grid::

    op: mylib::row_normalize        # the op, as torch.ops.mylib.row_normalize.default
    import: my_rules                # the module that registers op and rule (the file's folder is on the path)
    inputs:                         # the op's tensor arguments, in call order
      x: {dtype: float64}
    cases:                          # one shape per input, per case
      - {x: [8, 6]}
      - {x: [7, 5]}
    meshes: [[4], [2, 3]]

Every layout of every input (uneven, both shard orders, partial sums) is executed on DTensor,
forward and backward, and classified as the op specs' combinations are; whether a local
strategy exists is decided numerically from the op itself, with no rule of shardverify's.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shardverify.features.audit.decide import Operand, prepare
from shardverify.features.audit.layouts import tensor_layouts
from shardverify.features.dtensor.run import DEFAULT_BUDGET, CaseResult, execute_combos, present_combinations
from shardverify.errors import SpecError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.case import InputDecl, OpCase
from shardverify.spec.fields import Fields, as_dtype, as_mesh, as_shape
from shardverify.spec.loader import load_yaml

__all__ = ["CustomSpec", "load_custom", "run_custom"]


@dataclass(frozen=True)
class CustomSpec:
    name: str                                   # "mylib::row_normalize"
    module: str
    inputs: tuple[tuple[str, str], ...]         # (name, dtype)
    cases: tuple[tuple[tuple[int, ...], ...], ...]
    meshes: tuple[tuple[int, ...], ...]
    folder: Path

    @property
    def target(self) -> str:
        namespace, op = self.name.split("::")
        return f"torch.ops.{namespace}.{op}.default"


def load_custom(path: Path) -> CustomSpec:
    """Read and validate a custom-op spec (errors name the file, line and field)."""
    root = load_yaml(path)
    fields = Fields(root)
    op = fields.required("op", str)
    module = fields.required("import", str)
    inputs_node = fields.required("inputs", dict)
    cases_node = fields.required("cases", list)
    meshes_node = fields.required("meshes", list)
    fields.finish()
    if str(op.value).count("::") != 1 or not all(str(op.value).split("::")):
        raise op.error(f"expected an op as 'namespace::name', got {op.value!r}")
    inputs = []
    for name, decl in inputs_node.value.items():
        item = Fields(decl)
        dtype = item.optional("dtype", str)
        item.finish()
        inputs.append((name, as_dtype(dtype) if dtype is not None else "float64"))
    if not inputs:
        raise inputs_node.error("a custom op needs at least one tensor input")
    cases = []
    for case in cases_node.value:
        item = Fields(case)
        cases.append(tuple(as_shape(item.required(name, list)) for name, _ in inputs))
        item.finish()
    if not cases:
        raise cases_node.error("at least one case")
    meshes = tuple(as_mesh(m) for m in meshes_node.value)
    if not meshes:
        raise meshes_node.error("at least one mesh")
    return CustomSpec(str(op.value), str(module.value), tuple(inputs), tuple(cases), meshes, Path(path).parent)


def _module_refusal(spec: CustomSpec) -> str:
    """"" when the module the spec names is a Python file in the spec's own folder (tree),
    found without importing it; otherwise why it is not imported. Only the spec's own module
    runs: ``import: pydoc`` or ``import: antigravity`` (stdlib, whose import has effects) never."""
    folder = spec.folder.resolve()
    parts = spec.module.split(".")
    if not all(part.isidentifier() for part in parts) or "__main__" in parts:
        return f"{spec.module!r} is not a dotted module name"
    loaded = sys.modules.get(spec.module)
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        return "" if where and Path(where).resolve().is_relative_to(folder) else \
            f"{spec.module!r} is already imported from {where or 'no file'}, not from the spec's folder {folder}"
    locations: list[str] = [str(folder)]
    found = None
    for depth in range(1, len(parts) + 1):
        found = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), locations)
        if found is None:
            return f"{spec.module!r} is no Python module in the spec's folder {folder}: only the spec's own module is imported"
        locations = list(found.submodule_search_locations or [])
    origin = getattr(found, "origin", None)
    if not origin or not Path(origin).resolve().is_relative_to(folder):
        return f"{spec.module!r} lies outside the spec's folder {folder}"
    return ""


def _import(spec: CustomSpec) -> None:
    """The spec's module imported (it registers the op and its rule), only from the spec's folder."""
    refusal = _module_refusal(spec)
    if refusal:
        raise SpecError(f"custom op {spec.name}: {refusal}")
    sys.path.insert(0, str(spec.folder.resolve()))
    try:
        importlib.import_module(spec.module)
    except SystemExit as exc:   # a module that ends the process when imported: an input error, said
        raise SpecError(f"custom op {spec.name}: importing {spec.module!r} from {spec.folder} raised "
                        f"SystemExit({exc.code!r})") from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises is one line naming it
        text = str(exc).strip().splitlines()
        raise SpecError(f"custom op {spec.name}: cannot import {spec.module!r} from {spec.folder}: "
                        f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")) from None
    finally:
        sys.path.remove(str(spec.folder.resolve()))
    if not _registered(spec):
        raise SpecError(f"custom op {spec.name}: importing {spec.module!r} from {spec.folder} registered no op "
                        f"{spec.name} ({spec.target} does not exist); the module must define it with torch.library")


def _registered(spec: CustomSpec) -> bool:
    """Whether torch now has the spec's op (its default overload), asked without raising."""
    import torch

    namespace, op = spec.name.split("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), "default", None) is not None
    except (AttributeError, RuntimeError):
        return False


def run_custom(spec: CustomSpec, meshes=None, *, limit: int | None = None, budget: float | None = DEFAULT_BUDGET,
               on_result=None) -> list[CaseResult]:
    """Every case of the custom op on every mesh, executed on DTensor and classified."""
    _import(spec)
    results = []
    explained: set[str] = set()
    for shapes in spec.cases:
        case_id = "-".join("x".join(map(str, shape)) for shape in shapes)
        case = OpCase(op=spec.name, target=spec.target,
                      inputs=tuple(InputDecl(name, shape, dtype) for (name, dtype), shape in zip(spec.inputs, shapes)))
        for mesh_shape in meshes or spec.meshes:
            start = time.perf_counter()
            result = CaseResult(spec.name, case_id, tuple(mesh_shape))
            try:
                mesh = DeviceMesh(tuple(mesh_shape))
                operands = tuple(Operand(name, name, ("arg", i), shape, dtype.startswith(("float", "bfloat")))
                                 for i, ((name, dtype), shape) in enumerate(zip(spec.inputs, shapes)))
                problem = prepare(case, mesh, operands)
                choices = [tensor_layouts(o.shape, mesh.shape, partial=("sum",) if o.floating else ()) for o in operands]
                combos = present_combinations(itertools.product(*choices))
                execute_combos(result, problem, operands, combos, problem.decide, limit, budget, explained)
            except SpecError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported with the case, never skipped
                result.note = f"error: {type(exc).__name__}: {exc}"
            result.seconds = time.perf_counter() - start
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results
