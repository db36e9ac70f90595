"""The "model" spec kind: specs/models/*.yaml, one model trained under a grid of DDP plans.

`parse_model_spec` validates everything eagerly (it even builds the model and runs one forward
and loss on the declared shapes), raising one SpecError that names file, line and field;
`render_model_spec` turns the frozen `ModelSpec` into one generated pytest module whose tests
run `verify_model` for every plan and mesh. See specs/models/README.md for the format.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass

import torch

from shardverify.spec.fields import (Fields, as_factory, as_identifier, as_mesh, as_shape, as_tolerance, check_type,
                                        resolve_target)
from shardverify.spec.kinds import TemplateRenderer
from shardverify.spec.loader import Node
from shardverify.spec.limits import MAX_STEPS
from shardverify.pysource import py_identifier, py_literal
from shardverify.features.ddp.build import build_optimizer
from shardverify.spec.names import resolve_dotted
from shardverify.features.ddp.plan import (EXPECTATIONS, LOSSES, OPTIMIZERS, DDPOptions, LayerDecl, LossDecl,
                                  ModelDecl, ModelPlan, OptimizerDecl)
from shardverify.errors import InvalidArgument, spec_location

__all__ = ["PlanPoint", "ModelSpec", "parse_model_spec", "render_model_spec", "summarize_model_spec",
           "plan_source", "plan_arguments", "TEST_DIR"]

TEST_DIR = "generated_tests"
_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(DDPOptions)}
_OPTION_TYPES = {"int": int, "bool": bool, "float": float, "str": str}  # annotations are strings
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class PlanPoint:
    """One expanded entry of `plans`: the DDP options, the expectation, tolerance overrides."""

    options: DDPOptions
    expect: str = "equal"
    rtol: float | None = None
    atol: float | None = None

    @property
    def id(self) -> str:
        label = self.options.label().replace(",", "-")
        return label if self.expect == "equal" else f"{label}-expect_differ"


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec: the base plan (default DDP options) and every plan point."""

    name: str
    source: str
    description: str
    base: ModelPlan
    meshes: tuple[tuple[int, ...], ...]
    plans: tuple[PlanPoint, ...]

    def plan(self, point: PlanPoint) -> ModelPlan:
        rtol = point.rtol if point.rtol is not None else self.base.rtol
        atol = point.atol if point.atol is not None else self.base.atol
        return dataclasses.replace(self.base, options=point.options, expect=point.expect,
                                   rtol=rtol, atol=atol)


def _literal(node: Node) -> object:
    """A YAML scalar or a (nested) list of scalars, lists becoming tuples (hashable, emittable)."""
    if isinstance(node.value, list):
        return tuple(_literal(item) for item in node.value)
    if isinstance(node.value, dict):
        raise node.error("expected a scalar or a list of scalars, got a mapping")
    if isinstance(node.value, float) and not math.isfinite(node.value):
        raise node.error(f"expected a finite number, got {node.value!r}")
    return node.value


def _kwargs(node: Node | None) -> tuple[tuple[str, object], ...]:
    if node is None:
        return ()
    return tuple((as_identifier(Node(key, node.file, child.key_line or child.line, child.path)),
                  _literal(child)) for key, child in node.value.items())  # type: ignore[union-attr]


def _parse_layer(node: Node) -> LayerDecl:
    """`- torch.nn.ReLU` or `- {module: torch.nn.Linear, args: [6, 12], kwargs: {bias: false}}`."""
    if isinstance(node.value, str):
        target_node, args, kwargs = node, (), ()
    else:
        f = Fields(check_type(node, (str, dict)))
        target_node = f.required("module", str)
        args_node = f.optional("args", list)
        kwargs = _kwargs(f.optional("kwargs", dict))
        f.finish()
        args = _literal(args_node) if args_node is not None else ()
    target = resolve_target(target_node)
    cls = resolve_dotted(target)
    if not (target.startswith("torch.nn.") and isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise target_node.error(f"{target!r} is not a torch.nn.Module class (e.g. 'torch.nn.Linear')")
    return LayerDecl(target, args, kwargs)  # type: ignore[arg-type]


def _parse_model(node: Node) -> ModelDecl:
    f = Fields(node)
    layers_node = f.optional("layers", list)
    factory_node = f.optional("factory", str)
    kwargs_node = f.optional("kwargs", dict)
    f.finish()
    if (layers_node is None) == (factory_node is None):
        raise node.error("give exactly one of 'layers' (torch.nn modules in order) or "
                         "'factory' ('package.module:function')")
    if layers_node is not None:
        if not layers_node.value:
            raise layers_node.error("list at least one layer")
        if kwargs_node is not None:
            raise kwargs_node.error("'kwargs' goes with 'factory'; give layer arguments per layer")
        return ModelDecl(layers=tuple(_parse_layer(item) for item in layers_node.value),  # type: ignore[union-attr]
                         where=_where(node))
    assert factory_node is not None
    name = str(factory_node.value)
    if not _FACTORY.match(name):
        raise factory_node.error(f"expected 'package.module:function', got {name!r}")
    factory_kwargs = _kwargs(kwargs_node)
    as_factory(factory_node, kwargs_node, dict(factory_kwargs))   # read, not run: a spec that is read runs nothing
    return ModelDecl(factory=name, factory_kwargs=factory_kwargs, where=_where(node))


def _where(node: Node) -> str:
    """``file:line: field 'model'`` (as a SpecError would say it), kept for the model's build."""
    return spec_location(*node.where())


def _parse_loss(node: Node) -> LossDecl:
    """`loss: mse` (mean) or `loss: {name: sum, reduction: sum}`."""
    if isinstance(node.value, str):
        name_node, reduction = node, "mean"
    else:
        f = Fields(check_type(node, (str, dict)))
        name_node = f.required("name", str)
        reduction_node = f.optional("reduction", str)
        f.finish()
        reduction = "mean" if reduction_node is None else str(reduction_node.value)
        if reduction not in ("sum", "mean"):
            raise reduction_node.error(f"expected 'sum' or 'mean', got {reduction!r}")  # type: ignore[union-attr]
    if name_node.value not in LOSSES:
        raise name_node.error(f"unknown loss {name_node.value!r}; expected one of {', '.join(LOSSES)}")
    return LossDecl(str(name_node.value), reduction)


def _parse_optimizer(node: Node) -> OptimizerDecl:
    f = Fields(node)
    name_node = f.required("name", str)
    if name_node.value not in OPTIMIZERS:
        raise name_node.error(f"unknown optimizer {name_node.value!r}; expected one of {', '.join(OPTIMIZERS)}")
    settings = []
    for key in OPTIMIZERS[str(name_node.value)]:
        child = f.optional(key, (int, float, bool, list))
        if child is not None:
            settings.append((key, _literal(child)))
    f.finish()
    decl = OptimizerDecl(str(name_node.value), tuple(settings))
    try:
        build_optimizer(decl, [torch.nn.Parameter(torch.zeros(1))])
    except InvalidArgument as exc:
        raise node.error(str(exc)) from None
    return decl


def _tolerance(node: Node | None) -> tuple[float | None, float | None]:
    if node is None:
        return None, None
    f = Fields(node)
    rtol, atol = f.optional("rtol", float), f.optional("atol", float)
    f.finish()
    return (None if rtol is None else as_tolerance(rtol)), (None if atol is None else as_tolerance(atol))


def _option_values(key: str, node: Node) -> tuple[object, ...]:
    kind = _OPTION_TYPES[_OPTION_FIELDS[key].type]
    items = node.value if isinstance(node.value, list) else [node]
    if not items:
        raise node.error(f"list at least one value for '{key}'")
    return tuple(check_type(item, kind).value for item in items)  # type: ignore[union-attr]


def _parse_plans(node: Node, base: ModelPlan) -> tuple[PlanPoint, ...]:
    """Each entry maps DDP option names to a value or a list of values (their product)."""
    if not node.value:
        raise node.error("list at least one plan (`- {}` is plain DDP)")
    points: list[PlanPoint] = []
    seen: dict[PlanPoint, str] = {}
    for entry in node.value:  # type: ignore[union-attr]
        f = Fields(entry)
        grid = [(key, _option_values(key, child)) for key in _OPTION_FIELDS
                if (child := f.optional(key, (bool, int, float, str, list))) is not None]
        expect_node = f.optional("expect", str)
        rtol, atol = _tolerance(f.optional("tolerance", dict))
        f.finish()
        expect = "equal" if expect_node is None else str(expect_node.value)
        if expect not in EXPECTATIONS:
            raise expect_node.error(f"expected one of {', '.join(EXPECTATIONS)}, got {expect!r}")  # type: ignore[union-attr]
        keys = [key for key, _ in grid]
        for values in itertools.product(*(values for _, values in grid)):
            try:
                options = DDPOptions(**dict(zip(keys, values)))
                point = PlanPoint(options, expect, rtol, atol)
                dataclasses.replace(base, options=options, expect=expect)  # plan-level checks
            except InvalidArgument as exc:
                raise entry.error(str(exc)) from None
            key = dataclasses.replace(point, expect="equal", rtol=None, atol=None)
            if key in seen:
                raise entry.error(f"plan {point.id!r} is already listed at {seen[key]}")
            seen[key] = entry.path
            points.append(point)
    return tuple(points)


def parse_model_spec(root: Node) -> ModelSpec:
    """Validate one model spec tree; raises a SpecError naming file, line and field."""
    f = Fields(root)
    name = as_identifier(f.required("name", str))
    desc_node = f.optional("description", str)
    model_node = f.required("model", dict)
    data_node = f.required("data", dict)
    loss_node = f.required("loss", (str, dict))
    optimizer_node = f.optional("optimizer", dict)
    steps_node = f.optional("steps", int)
    seed_node = f.optional("seed", int)
    meshes_node = f.required("meshes", list)
    tolerance = _tolerance(f.optional("tolerance", dict))
    plans_node = f.required("plans", list)
    f.finish()

    model = _parse_model(model_node)
    d = Fields(data_node)
    input_shape = as_shape(d.required("input", list), allow_empty=False)
    target_node = d.optional("target", list)
    classes_node = d.optional("classes", int)
    d.finish()
    loss = _parse_loss(loss_node)
    optimizer = _parse_optimizer(optimizer_node) if optimizer_node is not None else OptimizerDecl()
    steps = 2 if steps_node is None else int(steps_node.value)  # type: ignore[arg-type]
    if steps < 1:
        raise steps_node.error(f"expected an integer >= 1, got {steps}")  # type: ignore[union-attr]
    too_many = MAX_STEPS.exceeded(steps)
    if too_many:
        raise steps_node.error(too_many)  # type: ignore[union-attr]
    try:
        base = ModelPlan(
            name=name, model=model, input_shape=input_shape, loss=loss,
            target_shape=None if target_node is None else as_shape(target_node, allow_empty=False),
            classes=None if classes_node is None else int(classes_node.value),  # type: ignore[arg-type]
            optimizer=optimizer, steps=steps,
            seed=0 if seed_node is None else int(seed_node.value),  # type: ignore[arg-type]
            rtol=tolerance[0], atol=tolerance[1])
    except InvalidArgument as exc:
        raise data_node.error(str(exc)) from None

    if not meshes_node.value:
        raise meshes_node.error("list at least one mesh shape, e.g. [[2], [4]]")
    meshes = []
    for item in meshes_node.value:  # type: ignore[union-attr]
        mesh = as_mesh(item)
        try:
            base.check_world(math.prod(mesh))
        except InvalidArgument as exc:
            raise item.error(str(exc)) from None
        if mesh in meshes:
            raise item.error(f"mesh {list(mesh)} is listed twice")
        meshes.append(mesh)
    plans = _parse_plans(plans_node, base)
    return ModelSpec(name=name, source=root.file, description=str(desc_node.value) if desc_node else "",
                     base=base, meshes=tuple(meshes), plans=plans)


_EMITTABLE = (ModelPlan, ModelDecl, LayerDecl, LossDecl, OptimizerDecl, DDPOptions)


def plan_arguments(value: object) -> list[tuple[str, str]]:
    """(field, source) for the non-default fields of one of our frozen plan dataclasses."""
    if type(value) not in _EMITTABLE:
        raise InvalidArgument(f"refusing to emit {type(value).__name__} as generated source")
    arguments = []
    for field in dataclasses.fields(value):  # type: ignore[arg-type]
        item = getattr(value, field.name)
        if field.default is dataclasses.MISSING or item != field.default:
            arguments.append((py_identifier(field.name), plan_source(item)))
    return arguments


def plan_source(value: object) -> str:
    """Python source for a plan value: our frozen dataclasses as constructor calls naming only
    non-default fields, everything else through `py_literal` (so only validated literals)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(f"{name}={source}" for name, source in plan_arguments(value))
        return f"{type(value).__name__}({inner})"
    if isinstance(value, tuple):
        inner = ", ".join(plan_source(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return py_literal(value)


def _mesh_id(mesh: tuple[int, ...]) -> str:
    return "mesh" + "x".join(str(size) for size in mesh)


def render_model_spec(spec: ModelSpec, renderer: TemplateRenderer) -> dict[str, str]:
    """{generated test module path: text} for one model spec."""
    plans = []
    for point in spec.plans:
        plan = spec.plan(point)
        changes = [f"options={plan_source(plan.options)}"]
        changes += [f"{key}={py_literal(getattr(plan, key))}" for key in ("expect", "rtol", "atol")
                    if getattr(plan, key) != getattr(spec.base, key)]
        plans.append((", ".join(changes), point.id))
    model = spec.base.model
    base = [(name, "MODEL" if name == "model" else source) for name, source in plan_arguments(spec.base)]
    text = renderer.render("model_test.py.j2", spec=spec, base=base, plans=plans,
                           layers=[plan_source(layer) for layer in model.layers],
                           factory=[(name, source) for name, source in plan_arguments(model)
                                    if name != "layers"],
                           meshes=[(mesh, _mesh_id(mesh)) for mesh in spec.meshes])
    return {f"{TEST_DIR}/test_model_{spec.name}.py": text}


def summarize_model_spec(spec: ModelSpec) -> dict[str, str]:
    """The columns `shardverify list` prints for a model."""
    model = spec.base.model
    built = (", ".join(layer.target.rsplit(".", 1)[-1] for layer in model.layers) if model.layers
             else f"factory {model.factory}")
    differ = sum(point.expect == "differ" for point in spec.plans)
    return {
        "model": built,
        "training": (f"{spec.base.loss.name} ({spec.base.loss.reduction}), {spec.base.optimizer.name}, "
                     f"{spec.base.steps} step(s), batch {list(spec.base.input_shape)}"),
        "plans": f"{len(spec.plans)} ({differ} expected to differ): "
                 + " ".join(point.id for point in spec.plans),
        "meshes": " ".join(str(list(mesh)) for mesh in spec.meshes),
    }
