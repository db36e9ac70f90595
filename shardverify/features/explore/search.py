"""Running what :mod:`shardverify.features.explore.draw` draws: every strategy of a drawn example
verified (after checking that each divides its operands' shapes), a failure replayed from its
``verify:`` block, and :func:`search`, the hypothesis-driven loop of ``shardverify explore``."""

from __future__ import annotations

import dataclasses

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import hypothesis
from hypothesis import HealthCheck, Verbosity, settings

import torch

from shardverify.errors import InvalidArgument, ShardVerifyError
from shardverify.features.explore.draw import Example, examples
from shardverify.features.explore.meshes import DEFAULT_MESH_MAX_SIZE
from shardverify.spec.op import OpSpec

__all__ = ["layout_problems", "check_example", "replay", "Failure", "search"]


# --------------------------------------------------------------------------- checking

def layout_problems(strategies, mesh) -> list[str]:
    """Every layout of ``strategies`` that is not a layout of its operand on ``mesh``, or that
    splits a dim of one element (one rank holds it, the others nothing: no sharding at all).
    A size that does not divide is no problem: its blocks are cut as DTensor cuts them."""
    problems = []
    for strategy in strategies:
        for data in strategy.operands:
            layout = strategy.get_sharding_spec_by_name(data.name)
            where = f"strategy {strategy.name!r}, operand {data.name!r} {tuple(data.shape)}"
            if tuple(layout.tensor_shape) != tuple(data.shape) or tuple(layout.mesh_shape) != tuple(mesh.shape):
                problems.append(f"{where}: layout {layout} is for tensor {tuple(layout.tensor_shape)} on mesh "
                                f"{tuple(layout.mesh_shape)}, not for this operand on mesh {tuple(mesh.shape)}")
            for dim, axes in layout.partition_dict().items():
                ways = math.prod(mesh.shape[a] for a in axes if 0 <= a < mesh.ndim)
                size = data.shape[dim] if dim < len(data.shape) else None
                if size is None or (size < 2 and ways > 1):
                    problems.append(f"{where}: dim {dim} of size {size} is split {ways} ways over "
                                    f"mesh axes {axes} of mesh {tuple(mesh.shape)}")
    return problems


def check_example(backend, example: Example, *, first_failure: bool = False) -> list:
    """Every strategy of the example's op node fits its operands and passes on ``backend``;
    raises AssertionError naming the drawn call, with the report, otherwise (the reproduction
    is a hypothesis note). A call the harness or the op's handler refuses is rejected, never
    a failure (the handler serves only the parameter values its rule was verified on).
    ``first_failure`` stops at the first failing strategy (a search shrinks much faster)."""
    __tracebackhide__ = True
    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.verify.engine import verify_case
    from shardverify.verify.on_demand import every_strategy
    from shardverify.verify.reference import reference
    from shardverify.verify.report import assert_passed

    if tuple(backend.mesh.shape) != example.mesh_shape:
        raise InvalidArgument(f"backend mesh {tuple(backend.mesh.shape)} is not the example's mesh "
                              f"{example.mesh_shape}")
    case = example.case()
    try:
        graph_module, node_name = case.build()
    except Exception as exc:  # noqa: BLE001 -- sizes the harness itself refuses are not a case
        _note(f"the harness refuses these sizes: {type(exc).__name__}: {exc}")
        hypothesis.reject()
    try:      # meta kernels let some calls through that the op refuses (a conv's out-channels not a multiple of groups)
        reference(case, None, torch.device("cpu"))
    except RuntimeError as exc:
        if isinstance(exc, ShardVerifyError):
            raise
        _note(f"the op refuses these inputs: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        hypothesis.reject()
    why = _refused(graph_module, node_name, example.spec)
    if why is not None:   # a call outside what the rule was verified on is no failure of it
        _note(f"the handler refuses the drawn call: {why}")
        hypothesis.reject()
    try:
        # every strategy the rule yields at the drawn call, a call outside the grid included: the
        # explorer verifies them all (what on demand would verify before serving them)
        strategies = strategies_for_node(graph_module, node_name, backend.mesh, on_demand=every_strategy)
        problems = layout_problems(strategies, backend.mesh)
        if problems:
            raise AssertionError(f"{example.spec.name}: {len(problems)} layout(s) do not fit their tensor; "
                                 "such strategies must be left out of the vector:\n  " + "\n  ".join(problems))
        results = []
        for strategy in strategies:
            results += verify_case(backend, case, [strategy])
            if first_failure and not results[-1].passed:
                break
        assert_passed(results)
    except hypothesis.errors.HypothesisException:
        raise
    except Exception as exc:
        _note(example.reproduction())   # printed with hypothesis' falsifying example
        raise _naming_the_call(example, exc) from (None if isinstance(exc, AssertionError) else exc)
    return results


def _naming_the_call(example: Example, exc: Exception) -> AssertionError:
    """The failure as an AssertionError whose message starts with the drawn call (target,
    shapes, parameter values, mesh), then the report or the error raised."""
    text = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
    return AssertionError(f"drawn call: {example.describe()}\n{text}")


def _refused(graph_module, node_name: str, spec) -> str | None:
    """Why the op's node is no case of the spec's rule, or None: its handler refuses the call
    (see ``refusal``), or the call is outside the grid in a parameter the rule is bound to (a
    value drawn beyond the grid of one declared ``serves: any`` is a case: the claim is tested)."""
    from shardverify.strategies.for_node import find_node
    from shardverify.strategies.handlers.serving import handler_for_node, off_grid, outside_grid, refusal

    node = find_node(graph_module, node_name)
    handler = handler_for_node(node, graph_module)
    if handler is None:
        return None
    why = refusal(handler, node, graph_module)
    if why is not None:
        return why
    if any(not spec.serves_every_value(name) for name in off_grid(handler, node, graph_module)):
        return outside_grid(handler, node, graph_module)
    return outside_grid(dataclasses.replace(handler, bindings=()), node, graph_module)   # undeclared arguments


def _note(text: str) -> None:
    """hypothesis.note inside a test, nothing outside one (check_example is callable directly)."""
    try:
        hypothesis.note(text)
    except hypothesis.errors.InvalidArgument:
        pass


def replay(case, mesh_shape: Sequence[int], backend: str = "simulated") -> list:
    """Verify one case on one mesh and fail with the report (the reproduction line calls it)."""
    from shardverify.backends import get_backend
    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.verify.engine import verify_case
    from shardverify.verify.reference import reference
    from shardverify.verify.report import assert_passed

    runner = get_backend(backend, DeviceMesh(tuple(mesh_shape)))
    try:
        results = verify_case(runner, case)
    finally:
        runner.close()
    assert_passed(results)
    return results


@dataclass(frozen=True)
class Failure:
    """The shrunk failing example of a search, the error it raised and its reproduction."""

    example: Example
    error: str
    reproduction: str


def search(spec: OpSpec, *, examples_count: int = 50, mesh_max_size: int = DEFAULT_MESH_MAX_SIZE,
           seed: int | None = None, backend_factory: Callable | None = None,
           on_example: Callable[[Example], None] | None = None) -> Failure | None:
    """Run the property over ``examples_count`` drawn examples on the simulated backend (or
    ``backend_factory(mesh_shape)``); the shrunk failure, or None when every example passed.
    Without ``seed`` the search is derandomized (the same examples every run)."""
    if isinstance(examples_count, bool) or not isinstance(examples_count, int) or examples_count < 1:
        raise InvalidArgument(f"examples_count={examples_count!r} must be a positive int")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument(f"seed={seed!r} must be an int or None")
    strategy = examples(spec, mesh_max_size=mesh_max_size)
    failures: list[tuple[Example, BaseException]] = []
    with _backends(backend_factory) as backend_for:

        @settings(max_examples=examples_count, derandomize=seed is None, database=None, deadline=None,
                  verbosity=Verbosity.quiet, report_multiple_bugs=False,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        @hypothesis.given(strategy)
        def prop(example: Example) -> None:
            if on_example is not None:
                on_example(example)
            try:
                check_example(backend_for(example.mesh_shape), example, first_failure=True)
            except Exception as exc:
                if not isinstance(exc, hypothesis.errors.HypothesisException):
                    failures.append((example, exc))
                raise

        if seed is not None:
            prop = hypothesis.seed(seed)(prop)
        try:
            prop()
        except Exception:
            if not failures:
                raise
            example, error = failures[-1]   # hypothesis replays the shrunk example last
            message = str(error) if isinstance(error, AssertionError) else f"{type(error).__name__}: {error}"
            return Failure(example, message, example.reproduction())
    return None


class _backends:
    """Simulated backends per mesh shape for one search, closed at the end."""

    def __init__(self, factory: Callable | None) -> None:
        self.factory = factory
        self.made: dict[tuple[int, ...], object] = {}

    def __enter__(self) -> Callable[[tuple[int, ...]], object]:
        def backend_for(mesh_shape: tuple[int, ...]):
            if mesh_shape not in self.made:
                if self.factory is not None:
                    self.made[mesh_shape] = self.factory(mesh_shape)
                else:
                    from shardverify.backends import get_backend
                    from shardverify.sharding.mesh import DeviceMesh

                    self.made[mesh_shape] = get_backend("simulated", DeviceMesh(mesh_shape))
            return self.made[mesh_shape]
        return backend_for

    def __exit__(self, *exc_info) -> None:
        if self.factory is None:
            for backend in self.made.values():
                backend.close()
        self.made.clear()
