"""The "plan" spec kind: ``specs/plans/<name>.yaml`` -> ``generated_tests/test_plan_<name>.py``.

::

    name: mlp                                      # required, an identifier
    description: ...
    model:                                         # required
      factory: shardverify.plan.zoo:mlp_block      # dotted path of a function or nn.Module class
      kwargs: {d_in: 64}
    inputs: {x: [32, 64]}                          # required: forward argument -> shape (float32)
    mesh: [2, 2]                                   # required
    plans:                                         # required: plan name -> {node: strategy name}
      solver: solver                               # the built-in solver's plan
      replicated: {}                               # nodes left out take their replicated strategy
      megatron: {fc1: "RS01 = RR x RS01", fc2: "RR = RS01 x S01R"}
    solver_beats: [replicated]                     # plans whose declared cost the solver's must beat

Every plan is verified end to end on the simulated backend and (marked ``dist``) on gloo.
Reading the spec runs nothing: the factory is found in its module's source; the model is built
and each plan made (misspelt nodes and strategies found) by those tests and `shardverify plan`,
every error naming the spec's file, line and field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardverify.spec.fields import Fields, as_factory, as_identifier, as_mesh, as_shape
from shardverify.spec.limits import tensor_size_problems
from shardverify.codegen.kinds import SpecKind, register_spec_kind
from shardverify.spec.loader import Node
from shardverify.codegen.render import Renderer
from shardverify.errors import InvalidArgument, ShardVerifyError, SpecError
from shardverify.spec.trust import call_factory

__all__ = ["PlanSpec", "parse_plan_spec", "render_plan_spec", "build_spec_model", "spec_plan", "SOLVER", "Where"]

SOLVER = "solver"

#: where a spec says something: (file, line, field), for errors raised when the spec is used
Where = tuple[str, "int | None", "str | None"]


@dataclass(frozen=True)
class PlanSpec:
    name: str
    source: str
    description: str
    factory: str
    kwargs: tuple[tuple[str, object], ...]
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    mesh: tuple[int, ...]
    plans: tuple[tuple[str, object], ...]        # name -> "solver" or ((node, strategy), ...)
    solver_beats: tuple[str, ...] = ()
    where: tuple[tuple[str, Where], ...] = ()    # "factory" and each plan name -> its place in the file


def _error(where: Where | None, message: str) -> ShardVerifyError:
    if where is None:
        return ShardVerifyError(message)
    return SpecError(message, file=where[0], line=where[1], field=where[2])


def build_spec_model(factory: str, kwargs, inputs, seed: int = 0, where: Where | None = None,
                     ) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The model (parameters drawn from ``seed``) and its example inputs. The factory is
    imported and called only here, never when a spec is read (spec/trust.py's call_factory:
    a model over its size limit is refused before anything is allocated); every failure is
    one error naming ``where`` (the spec's factory field)."""
    problems = tensor_size_problems([(f"input {name!r}", tuple(shape)) for name, shape in inputs])
    if problems:
        raise _error(where, "; ".join(problems))
    try:
        module = call_factory(factory, dict(kwargs))
    except InvalidArgument as error:
        raise _error(where, str(error)) from error.__cause__   # the factory's own error, for --debug
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module, tuple(torch.randn(shape, generator=gen) for _, shape in inputs)


def spec_plan(module: torch.nn.Module, inputs: Sequence[torch.Tensor], mesh: tuple[int, ...],
              plan: str | Mapping[str, str], where: Where | None = None):
    """A spec's plan made for its model: the solver's (``"solver"``) or the listed strategies
    completed; a misspelt node or strategy is an error naming ``where`` (the plan's field)."""
    from shardverify.plan.verify import make_plan

    try:
        return make_plan(module, inputs, mesh, None if plan == SOLVER else dict(plan))  # type: ignore[arg-type]
    except ShardVerifyError as error:
        raise _error(where, str(error)) from None


def parse_plan_spec(root: Node) -> PlanSpec:
    """Read a plan spec without running it: the factory is found in its module's source and its
    keyword arguments bound to its parameters, but nothing is imported or called; the model is
    built, and its plans made, by the tests and `shardverify plan` (see :func:`build_spec_model`)."""
    fields = Fields(root)
    name = as_identifier(fields.required("name", str))
    description = fields.optional("description", str)
    model = Fields(fields.required("model", dict))
    factory_node = model.required("factory", str)
    kwargs_node = model.optional("kwargs", dict)
    model.finish()
    kwargs = () if kwargs_node is None else tuple((k, v.plain()) for k, v in kwargs_node.value.items())
    factory = as_factory(factory_node, kwargs_node, dict(kwargs))
    inputs_node = fields.required("inputs", dict)
    inputs = tuple((k, as_shape(v, allow_empty=False)) for k, v in inputs_node.value.items())
    problems = tensor_size_problems([(f"input {k!r}", shape) for k, shape in inputs])
    if problems:
        raise inputs_node.error("; ".join(problems))
    mesh_node = fields.required("mesh", list)
    mesh = as_mesh(mesh_node)
    plans_node = fields.required("plans", dict)
    plans = []
    for key, child in plans_node.value.items():
        if child.value == SOLVER:
            plans.append((key, SOLVER))
        elif isinstance(child.value, dict):
            plans.append((key, tuple((n, str(v.value)) for n, v in child.value.items())))
        else:
            raise child.error(f"a plan is '{SOLVER}' or a mapping node name -> strategy name")
    beats_node = fields.optional("solver_beats", list)
    beats = () if beats_node is None else tuple(str(b.value) for b in beats_node.value)
    fields.finish()
    names = [k for k, _ in plans]
    for b in beats:
        if b not in names:
            raise beats_node.error(f"solver_beats names {b!r}, which is not one of the plans {names}")
    where = (("factory", factory_node.where()), *((key, plans_node.value[key].where()) for key in names))
    return PlanSpec(name, root.file, "" if description is None else str(description.value), factory,
                    kwargs, inputs, mesh, tuple(plans), beats, where)


def render_plan_spec(spec: PlanSpec, renderer: Renderer) -> dict[str, str]:
    plans = {k: (v if v == SOLVER else dict(v)) for k, v in spec.plans}
    return {f"generated_tests/test_plan_{spec.name}.py": renderer.render("plan_test.py.j2", spec=spec, plans=plans,
                                                                         where=dict(spec.where))}


def summarize_plan_spec(spec: PlanSpec) -> dict[str, str]:
    return {"model": spec.factory, "mesh": str(list(spec.mesh)), "plans": ", ".join(k for k, _ in spec.plans)}


PLAN_KIND = register_spec_kind(SpecKind(
    name="plan", subdir="plans", parse=parse_plan_spec,  # type: ignore[arg-type]
    render=render_plan_spec, summary=summarize_plan_spec))  # type: ignore[arg-type]
