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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardverify.spec.fields import Fields, as_identifier, as_shape
from shardverify.codegen.kinds import SpecKind, register_spec_kind
from shardverify.spec.loader import Node
from shardverify.codegen.render import Renderer
from shardverify.errors import ShardVerifyError
from shardverify.spec.names import resolve_dotted

__all__ = ["PlanSpec", "parse_plan_spec", "render_plan_spec", "build_spec_model", "SOLVER"]

SOLVER = "solver"


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


def build_spec_model(factory: str, kwargs, inputs, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The model (parameters drawn from ``seed``) and its example inputs."""
    make = resolve_dotted(factory)
    gen = torch.Generator().manual_seed(seed)
    module = make(**dict(kwargs))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module, tuple(torch.randn(shape, generator=gen) for _, shape in inputs)


def parse_plan_spec(root: Node) -> PlanSpec:
    fields = Fields(root)
    name = as_identifier(fields.required("name", str))
    description = fields.optional("description", str)
    model = Fields(fields.required("model", dict))
    factory_node = model.required("factory", str)
    kwargs_node = model.optional("kwargs", dict)
    model.finish()
    kwargs = () if kwargs_node is None else tuple((k, v.plain()) for k, v in kwargs_node.value.items())
    inputs_node = fields.required("inputs", dict)
    inputs = tuple((k, as_shape(v, allow_empty=False)) for k, v in inputs_node.value.items())
    mesh = as_shape(fields.required("mesh", list), allow_empty=False)
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
    from shardverify.plan.verify import make_plan

    try:
        module, example = build_spec_model(str(factory_node.value), kwargs, inputs)
    except (ShardVerifyError, LookupError, TypeError) as error:
        raise factory_node.error(f"cannot build the model: {error}") from None
    for key, plan in plans:
        try:
            make_plan(module, example, mesh, None if plan == SOLVER else dict(plan))
        except ShardVerifyError as error:
            raise plans_node.value[key].error(f"plan {key!r}: {error}") from None
    return PlanSpec(name, root.file, "" if description is None else str(description.value), str(factory_node.value),
                    kwargs, inputs, mesh, tuple(plans), beats)


def render_plan_spec(spec: PlanSpec, renderer: Renderer) -> dict[str, str]:
    plans = {k: (v if v == SOLVER else dict(v)) for k, v in spec.plans}
    return {f"generated_tests/test_plan_{spec.name}.py": renderer.render("plan_test.py.j2", spec=spec, plans=plans)}


def summarize_plan_spec(spec: PlanSpec) -> dict[str, str]:
    return {"model": spec.factory, "mesh": str(list(spec.mesh)), "plans": ", ".join(k for k, _ in spec.plans)}


PLAN_KIND = register_spec_kind(SpecKind(
    name="plan", subdir="plans", parse=parse_plan_spec,  # type: ignore[arg-type]
    render=render_plan_spec, summary=summarize_plan_spec))  # type: ignore[arg-type]
