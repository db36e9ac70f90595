"""The "plan" spec kind: ``specs/plans/<name>.yaml`` -> ``generated_tests/test_plan_<name>.py``.

::

    name: mlp                                      # required, an identifier
    description: ...
    model:                                         # required: a factory, or zoo: NAME
      factory: shardverify.plan.zoo:mlp_block      # dotted path of a function or nn.Module class
      kwargs: {d_in: 64}
    inputs: {x: [32, 64]}                          # forward argument -> shape (float32); not with zoo
    capture: fx                                    # fx (the default) | export (the default for zoo)
    mesh: [2, 2]                                   # or meshes: [[2, 2], [4]]
    plans:                                         # required: plan name -> how it is made
      solver: solver                               # the built-in solver's plan
      dp: data_parallel                            # the solver's plan, weights replicated, batch split
      tp: shard_weights                            # the solver's plan, every weight it can shard sharded
      replicated: {}                               # nodes left out take their replicated strategy
      megatron: {fc1: "RS01 = RR x RS01", fc2: "RR = RS01 x S01R"}   # one mesh only
    solver_beats: [replicated]                     # plans whose declared cost the solver's must beat
    strict: true                                   # every tensor op has strategies and the plan shards something
    cost_size:                                     # solve at the size it trains at, verify this build
      kwargs: {d_in: 4096, d_hidden: 16384}        # the factory's keyword arguments there (over model.kwargs)
      inputs: {x: [8, 4096]}                       # its inputs there (shapes only: never allocated)
    suite_meshes: [[2, 2]]                         # the generated test's meshes (default: all)

``cost_size`` makes every solved plan (``solver`` and the goals) take its costs from the model at
that size and map the plan onto this build (:mod:`shardverify.plan.real_size`); a zoo model's is
``cost_size: real`` (hidden 4096, seq 4096, batch 8) or ``{hidden: 8192, batch: 16}`` over it.
``model: {zoo: gpt2}`` is a tiny HF transformers model of :mod:`shardverify.plan.hf_zoo` with its
own example inputs (token ids, pixels), captured with torch.export. Every plan is verified end to
end on every mesh on the simulated backend and (marked ``dist``) on gloo; a spec naming
``suite_meshes`` (a model whose plans cost minutes) leaves the other meshes to ``shardverify plan
SPEC --mesh M``.
Reading the spec runs nothing: the factory is found in its module's source; the model is built
and each plan made (misspelt nodes and strategies found) by those tests and `shardverify plan`,
every error naming the spec's file, line and field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardverify.plan.inputs import InputSpec, draw_inputs
from shardverify.plan.model import PlanGoals
from shardverify.spec.fields import Fields, as_factory, as_identifier, as_mesh, as_shape
from shardverify.spec.limits import tensor_size_problems
from shardverify.spec.kinds import TemplateRenderer
from shardverify.spec.loader import Node
from shardverify.errors import InvalidArgument, ShardVerifyError, SpecError
from shardverify.spec.allow import call_factory, project_of

__all__ = ["PlanSpec", "parse_plan_spec", "render_plan_spec", "summarize_plan_spec", "build_spec_model", "real_spec_model", "spec_cost_size", "spec_plans",
           "spec_plan",
           "SOLVER", "GOALS", "Where"]

SOLVER = "solver"
#: plans the solver makes under a goal besides the least cost (see PlanGoals)
GOALS = {"data_parallel": PlanGoals(data_parallel=True), "shard_weights": PlanGoals(shard_weights=True)}
CAPTURES = ("fx", "export")

#: where a spec says something: (file, line, field), for errors raised when the spec is used
Where = tuple[str, "int | None", "str | None"]


@dataclass(frozen=True)
class PlanSpec:
    name: str
    source: str
    description: str
    factory: str                                 # "" for a zoo model
    kwargs: tuple[tuple[str, object], ...]
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    meshes: tuple[tuple[int, ...], ...]
    plans: tuple[tuple[str, object], ...]        # name -> "solver", a GOALS key or ((node, strategy), ...)
    solver_beats: tuple[str, ...] = ()
    where: tuple[tuple[str, Where], ...] = ()    # "factory" and each plan name -> its place in the file
    zoo: str = ""                                # a model of shardverify.plan.hf_zoo, its inputs its own
    capture: str = "fx"
    strict: bool = False                         # every tensor op has strategies, and something is sharded
    #: solved plans cost at this size: a zoo's (("hidden", 4096), ...) (() for its realistic size), a
    #: factory's (("kwargs", ((name, value), ...)), ("inputs", ((name, shape), ...))); None: this build's own
    cost_size: tuple | None = None
    #: the meshes the generated test runs (the suite's share, for a model whose plans cost minutes);
    #: () for every mesh; `shardverify plan SPEC --mesh M` runs any of them
    suite_meshes: tuple[tuple[int, ...], ...] = ()


def _error(where: Where | None, message: str) -> ShardVerifyError:
    if where is None:
        return ShardVerifyError(message)
    return SpecError(message, file=where[0], line=where[1], field=where[2])


def build_spec_model(factory: str, kwargs, inputs, seed: int = 0, where: Where | None = None, zoo: str = "",
                     *, redraw: bool = False, train: bool = False):
    """The model as its factory built it (its own initialisation, under ``torch.manual_seed(seed)``)
    in eval mode (training mode with ``train``: a model that then draws random numbers, dropout,
    is refused by the check), and its example inputs. ``redraw``: every parameter re-drawn from
    the standard normal times 0.2 (seeded), for a factory whose own weights are all zeros or ones.
    ``inputs``: (name, shape) pairs (float32, by position), :class:`~shardverify.plan.inputs.InputSpec`
    (dtype, value range, by keyword when named), or empty: the model's own ``example_inputs``
    attribute (a tensor, a tuple, a mapping of keyword inputs, or a function returning one),
    which a factory sets. The factory is imported and called only here, never when a spec is read
    (spec/allow.py's call_factory, only as it allows: a function of the spec's
    project, a torch.nn.Module class, a zoo's; a model over its size limit is refused before anything is
    allocated); every failure is one error naming ``where`` (the spec's factory field). A
    ``zoo`` model comes with its own weights and inputs (:func:`shardverify.plan.hf_zoo.hf_model`)."""
    if zoo:
        from shardverify.plan.hf_zoo import hf_model

        try:
            module, example = hf_model(zoo, seed)
        except InvalidArgument as error:
            raise _error(where, str(error)) from None
        return module.train(train), example
    specs = [spec if isinstance(spec, InputSpec) else InputSpec(spec[0], tuple(spec[1])) for spec in inputs]
    problems = tensor_size_problems([(f"input {spec.name!r}", spec.shape) for spec in specs])
    if problems:
        raise _error(where, "; ".join(problems))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            module = call_factory(factory, dict(kwargs), project_of(where[0] if where else None))
        except InvalidArgument as error:
            raise _error(where, str(error)) from error.__cause__   # the factory's own error, for --debug
    gen = torch.Generator().manual_seed(seed)
    if redraw:
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    module.train(train)
    if specs:
        if any(isinstance(spec, InputSpec) for spec in inputs):
            positional, keywords = draw_inputs(specs, gen)
            return module, ((positional, keywords) if keywords else positional)
        return module, tuple(torch.randn(spec.shape, generator=gen) for spec in specs)
    own = getattr(module, "example_inputs", None)
    if own is None:
        raise _error(where, f"{factory} builds a {type(module).__name__} without example_inputs: give its inputs "
                            "(--input, or the spec's 'inputs')")
    return module, own() if callable(own) else own


def real_spec_model(factory: str, kwargs, real_kwargs, real_inputs, where: Where | None = None, zoo: str = "",
                    sizes: Mapping[str, int] | None = None):
    """The model at the size it will train at, as a :class:`~shardverify.plan.real_size.RealSize`
    (built later on the meta device and captured on fake tensors: nothing is allocated, so no size
    limit applies): a zoo model at ``sizes`` (hidden, seq, batch over its realistic size), or the
    factory called with ``real_kwargs`` over ``kwargs`` on ``real_inputs``
    (:class:`~shardverify.plan.inputs.InputSpec`, their shapes and dtypes; the values are never
    read). The factory is allowed as :func:`build_spec_model`'s is, before anything is built."""
    from shardverify.plan.real_size import RealSize
    from shardverify.spec.allow import resolve_allowed

    if zoo:
        from shardverify.plan.hf_zoo import real_size

        try:
            return real_size(zoo, dict(sizes or {}))
        except InvalidArgument as error:
            raise _error(where, str(error)) from None
    if sizes:
        raise _error(where, "hidden/seq/batch sizes are a zoo model's; give a factory's real size as its keyword "
                            "arguments and inputs at that size (--cost-kwarg, --cost-input)")
    if not real_inputs:
        raise _error(where, "a factory's real size needs its inputs at that size (--cost-input, as --input)")
    try:
        make = resolve_allowed(factory, project_of(where[0] if where else None))
    except InvalidArgument as error:
        raise _error(where, f"factory {error}") from None
    merged = {**dict(kwargs), **dict(real_kwargs)}

    def build():
        positional, keywords = draw_inputs(list(real_inputs), None)
        return make(**merged), ((positional, keywords) if keywords else positional)

    shown = [f"{k}={v}" for k, v in real_kwargs] + \
        [f"{spec.name + '=' if spec.name else ''}[{','.join(map(str, spec.shape))}]" for spec in real_inputs]
    return RealSize(build, f"{factory} at {', '.join(shown)}")


def spec_cost_size(factory: str, kwargs, cost_size: tuple | None, where: Where | None = None, zoo: str = ""):
    """A spec's ``cost_size`` (:attr:`PlanSpec.cost_size`) as a RealSize, or None."""
    if cost_size is None:
        return None
    if zoo:
        return real_spec_model("", (), (), (), where, zoo, dict(cost_size))
    given = dict(cost_size)
    inputs = [InputSpec("", tuple(shape)) for _, shape in given["inputs"]]
    return real_spec_model(factory, kwargs, given["kwargs"], inputs, where)


def spec_plan(module: torch.nn.Module, inputs: Sequence[torch.Tensor], mesh: tuple[int, ...],
              plan: str | Mapping[str, str], where: Where | None = None, capture: str = "fx", cost_size=None):
    """A spec's plan made for its model and the account of its nodes (a Coverage): the solver's
    (``"solver"``, or under a goal of :data:`GOALS`; solved at ``cost_size``, a RealSize, when
    given) or the listed strategies completed; a misspelt node or strategy is an error naming
    ``where`` (the plan's field)."""
    from shardverify.plan.verify import plan_with_coverage

    given, goals = _asked(plan)
    try:
        return plan_with_coverage(module, inputs, mesh, given, capture=capture, goals=goals,
                                  cost_size=cost_size if given is None else None)
    except ShardVerifyError as error:
        raise _error(where, str(error)) from None


def _asked(plan: str | Mapping[str, str]) -> tuple[dict[str, str] | None, PlanGoals]:
    """A spec's plan as the plan maker takes it: (None, the goals) for the solver's (``"solver"``
    or a goal; parse_plan_spec allows no other word), (node -> strategy, no goals) for a given one."""
    if isinstance(plan, str):
        return None, GOALS.get(plan, PlanGoals())
    return dict(plan), PlanGoals()


def spec_plans(module: torch.nn.Module, inputs: Sequence[torch.Tensor], mesh: tuple[int, ...],
               plans: Sequence[str | Mapping[str, str]], wheres: Sequence[Where | None], capture: str = "fx") -> list:
    """:func:`spec_plan` of several plans of one model on one mesh, made from one capture and one
    account of its nodes (:func:`~shardverify.plan.verify.plans_with_coverage`): each place holds
    (plan, coverage), or the error naming its ``wheres`` entry."""
    from shardverify.plan.verify import plans_with_coverage

    asked = [_asked(plan) for plan in plans]
    try:
        made = plans_with_coverage(module, inputs, mesh, asked, capture=capture)
    except ShardVerifyError as error:   # the capture or the strategies: every plan's error
        made = [error] * len(asked)
    return [_error(where, str(found)) if isinstance(found, ShardVerifyError) else found
            for found, where in zip(made, wheres)]


def parse_plan_spec(root: Node) -> PlanSpec:
    """Read a plan spec without running it: the factory is found in its module's source and its
    keyword arguments bound to its parameters, but nothing is imported or called; the model is
    built, and its plans made, by the tests and `shardverify plan` (see :func:`build_spec_model`)."""
    fields = Fields(root)
    name = as_identifier(fields.required("name", str))
    description = fields.optional("description", str)
    model_node = fields.required("model", dict)
    model = Fields(model_node)
    factory_node = model.optional("factory", str)
    zoo_node = model.optional("zoo", str)
    kwargs_node = model.optional("kwargs", dict)
    model.finish()
    if (factory_node is None) == (zoo_node is None):
        raise model_node.error("give the model as 'factory' (a dotted path) or 'zoo' (a model of "
                               "shardverify.plan.hf_zoo), exactly one")
    kwargs = () if kwargs_node is None else tuple((k, v.plain()) for k, v in kwargs_node.value.items())
    factory, zoo = "", ""
    if factory_node is not None:
        factory = as_factory(factory_node, kwargs_node, dict(kwargs))
    else:
        from shardverify.plan.hf_zoo import HF_MODELS

        zoo = str(zoo_node.value)  # type: ignore[union-attr]
        if zoo not in HF_MODELS:
            raise zoo_node.error(f"no zoo model {zoo!r}; the zoo has {', '.join(HF_MODELS)}")  # type: ignore[union-attr]
        if kwargs_node is not None:
            raise kwargs_node.error("a zoo model takes no kwargs: its config is fixed (shardverify/plan/hf_zoo.py)")
    inputs_node = fields.optional("inputs", dict)
    if (inputs_node is None) != bool(zoo):
        raise (inputs_node or root).error("a zoo model brings its own inputs; a factory needs 'inputs' "
                                          "(forward argument -> shape)")
    inputs = () if inputs_node is None else \
        tuple((k, as_shape(v, allow_empty=False)) for k, v in inputs_node.value.items())
    problems = tensor_size_problems([(f"input {k!r}", shape) for k, shape in inputs])
    if problems:
        raise inputs_node.error("; ".join(problems))  # type: ignore[union-attr]
    capture_node = fields.optional("capture", str)
    capture = "export" if zoo else "fx"
    if capture_node is not None:
        capture = str(capture_node.value)
        if capture not in CAPTURES:
            raise capture_node.error(f"capture must be one of {', '.join(CAPTURES)}, got {capture!r}")
    mesh_node, meshes_node = fields.optional("mesh", list), fields.optional("meshes", list)
    if (mesh_node is None) == (meshes_node is None):
        raise root.error("give 'mesh' (one mesh shape) or 'meshes' (a list of them), exactly one")
    meshes = _meshes(mesh_node, meshes_node)
    plans_node = fields.required("plans", dict)
    plans = _plans(plans_node, meshes)
    beats_node = fields.optional("solver_beats", list)
    beats = () if beats_node is None else tuple(str(b.value) for b in beats_node.value)
    strict_node = fields.optional("strict", bool)
    suite_node = fields.optional("suite_meshes", list)
    suite_meshes = () if suite_node is None else tuple(as_mesh(m) for m in suite_node.value)  # type: ignore[union-attr]
    if suite_node is not None and (not suite_meshes or not set(suite_meshes) <= set(meshes)):
        raise suite_node.error(f"suite_meshes must name some of the spec's meshes {[list(m) for m in meshes]}")
    cost_size = _cost_size(fields.optional("cost_size", (str, dict)), zoo, capture_node)
    if cost_size is not None and capture_node is None:
        capture = "export"          # the real size is captured with export; the graphs are matched node by node
    fields.finish()
    names = [k for k, _ in plans]
    for b in beats:
        if b not in names:
            raise beats_node.error(f"solver_beats names {b!r}, which is not one of the plans {names}")  # type: ignore[union-attr]
    model_at = factory_node if factory_node is not None else zoo_node
    where = (("factory", model_at.where()), *((key, plans_node.value[key].where()) for key in names))  # type: ignore[union-attr]
    return PlanSpec(name, root.file, "" if description is None else str(description.value), factory,
                    kwargs, inputs, meshes, tuple(plans), beats, where, zoo, capture,
                    bool(strict_node.value) if strict_node is not None else False, cost_size, suite_meshes)


def _meshes(mesh_node: Node | None, meshes_node: Node | None) -> tuple[tuple[int, ...], ...]:
    """The spec's meshes: ``mesh`` (one) or ``meshes`` (distinct, at least one)."""
    meshes = (as_mesh(mesh_node),) if mesh_node is not None else \
        tuple(as_mesh(m) for m in meshes_node.value)  # type: ignore[union-attr]
    if not meshes or len(set(meshes)) != len(meshes):
        raise (meshes_node or mesh_node).error("meshes must be distinct, at least one")  # type: ignore[union-attr]
    return meshes


def _plans(plans_node: Node, meshes: tuple[tuple[int, ...], ...]) -> list[tuple[str, object]]:
    """Each plan by name: the solver or a goal (a word), or node name -> strategy name (one mesh only)."""
    plans: list[tuple[str, object]] = []
    for key, child in plans_node.value.items():  # type: ignore[union-attr]
        if isinstance(child.value, str) and (child.value == SOLVER or child.value in GOALS):
            plans.append((key, str(child.value)))
        elif isinstance(child.value, dict):
            if len(meshes) > 1:
                raise child.error("a plan that names strategies is for one mesh (their names differ between "
                                  "meshes); this spec lists several")
            plans.append((key, tuple((n, str(v.value)) for n, v in child.value.items())))
        else:
            raise child.error(f"a plan is one of {', '.join((SOLVER, *GOALS))} or a mapping node name -> "
                              f"strategy name, got {child.value!r}")
    return plans


def _positive_shape(node: Node) -> tuple[int, ...]:
    """A real-size shape: positive ints, no size limit (it is never allocated)."""
    if not isinstance(node.value, list) or not node.value or \
            any(isinstance(v.value, bool) or not isinstance(v.value, int) or v.value <= 0 for v in node.value):
        raise node.error(f"expected a shape of positive integers such as [8, 4096], got {node.plain()!r}")
    return tuple(int(v.value) for v in node.value)


def _cost_size(node: Node | None, zoo: str, capture_node: Node | None) -> tuple | None:
    """``cost_size``: ``real`` or {hidden, seq, batch} for a zoo model, {kwargs, inputs} for a factory."""
    if node is None:
        return None
    if capture_node is not None and capture_node.value != "export":
        raise capture_node.error("cost_size maps the plan from torch.export's graph of the real size: capture export")
    if zoo:
        if node.value == "real":
            return ()
        from shardverify.plan.hf_zoo import REAL_SIZE

        if not isinstance(node.value, dict):
            raise node.error(f"a zoo model's cost_size is 'real' or sizes {{{', '.join(REAL_SIZE)}}}")
        sizes = []
        for key, child in node.value.items():
            if key not in REAL_SIZE or isinstance(child.value, bool) or not isinstance(child.value, int) \
                    or child.value <= 0:
                raise child.error(f"a zoo model's cost_size takes positive {', '.join(REAL_SIZE)}, got {key}: "
                                  f"{child.plain()!r}")
            sizes.append((key, int(child.value)))
        return tuple(sizes)
    if not isinstance(node.value, dict):
        raise node.error("a factory's cost_size is {kwargs: {...}, inputs: {name: shape}}: the model at the size "
                         "it trains at")
    given = Fields(node)
    kwargs_node, inputs_node = given.optional("kwargs", dict), given.required("inputs", dict)
    given.finish()
    kwargs = () if kwargs_node is None else tuple((k, v.plain()) for k, v in kwargs_node.value.items())
    return (("kwargs", kwargs),
            ("inputs", tuple((k, _positive_shape(v)) for k, v in inputs_node.value.items())))


def simulated_runs(spec: PlanSpec) -> list[tuple[tuple[int, ...], str]]:
    """(mesh, plan) of every run on the simulated backend: every plan on every mesh (of
    ``suite_meshes`` where the spec names them)."""
    return [(mesh, name) for mesh in spec.suite_meshes or spec.meshes for name, _ in spec.plans]


def process_runs(spec: PlanSpec) -> list[tuple[tuple[int, ...], str]]:
    """(mesh, plan) of the runs on real process groups, which cost a start of processes each:
    every mesh once, the plans in turns (the simulated backend runs every pair, with the same
    semantics; what the real groups add depends on the mesh, not on the plan)."""
    names = [name for name, _ in spec.plans]
    return [(mesh, names[i % len(names)]) for i, mesh in enumerate(spec.suite_meshes or spec.meshes)]


def render_plan_spec(spec: PlanSpec, renderer: TemplateRenderer) -> dict[str, str]:
    plans = {k: (v if isinstance(v, str) else dict(v)) for k, v in spec.plans}
    return {f"generated_tests/test_plan_{spec.name}.py": renderer.render(
        "plan_test.py.j2", spec=spec, plans=plans, where=dict(spec.where), simulated=simulated_runs(spec),
        process=process_runs(spec))}


def summarize_plan_spec(spec: PlanSpec) -> dict[str, str]:
    return {"model": spec.factory or f"zoo:{spec.zoo}", "meshes": ", ".join(str(list(m)) for m in spec.meshes),
            "plans": ", ".join(k for k, _ in spec.plans)}
