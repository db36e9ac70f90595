"""A crash is a verdict (shardverify/verify/isolated.py): a case whose op's CPU kernel can corrupt
memory or trap is checked in a child process, and a strategy that kills its own child fails
naming the signal while every other strategy keeps its result.

The crashes here are real: a layout of ``_adaptive_avg_pool2d_backward`` (or ``avg_pool2d_backward``)
whose ``self`` is sharded and whose ``grad_output`` is whole makes the CPU kernel write out of
bounds. Run in this process it would end pytest, so every check that holds such a layout first
asserts that it will run isolated (:func:`needs_isolation`), and fails instead when it would not.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from shardverify import DeviceMesh, trace
from shardverify.backends.simulated import SimulatedBackend
from shardverify.errors import RankDied, SpecError
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.spec.catalogue import load_op_specs
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.strategies.for_node import UnverifiedCall, handler_strategies, strategies_for_node
from shardverify.strategies.handlers.serving import handler_for_node
from shardverify.verify import isolated
from shardverify.verify.engine import verify_case
from shardverify.verify.isolated import needs_isolation, remember_deaths, verify_isolated
from shardverify.verify.on_demand import OnDemandVerifier, checkable_case, every_strategy

ROOT = Path(__file__).resolve().parents[1]
MESH = DeviceMesh((4,))
#: how a result names a strategy that killed its checking process
KILLED = re.compile(r"the op's kernel killed the checking process with (SIGABRT|SIGSEGV|SIGBUS) \(signal \d+\)")


@pytest.fixture(scope="module")
def backend():
    with SimulatedBackend(MESH) as simulated:
        yield simulated


@pytest.fixture
def forget_crashes():
    """The ops this test makes crash are forgotten after it: the memory is the process's."""
    before = isolated.crashed_ops()
    yield
    isolated._crashed.intersection_update(before)


def _case(spec_name: str):
    spec = load_op_specs(ROOT, None, [spec_name])[0]
    return spec.op_cases()[0][1]


def _whole_grad_output(strategy, operand: str = "grad_output"):
    """``strategy`` with ``operand`` replicated and the others as they were: ``self`` sharded
    over the batch while the gradient is whole, local shapes the kernel never checks."""
    specs = tuple((name, ShardingSpec.from_partition(spec.mesh_shape, spec.tensor_shape, {}) if name == operand
                   else spec) for name, spec in strategy.sharding_specs)
    return dataclasses.replace(strategy, name=f"{strategy.name} ({operand} as R)", sharding_specs=specs)


def _sharded_and_mutant(strategies):
    sharded = next(s for s in strategies if str(dict(s.sharding_specs)["grad_output"]).startswith("[S0"))
    return _whole_grad_output(sharded)


def _timeless(results):
    return [dataclasses.replace(result, seconds=0.0) for result in results]


@pytest.mark.parametrize("spec_name", ["adaptive_avg_pool2d_backward", "avg_pool2d_backward"])
def test_a_layout_whose_kernel_crashes_fails_naming_the_signal_and_the_others_keep_their_results(backend, spec_name,
                                                                                                  forget_crashes):
    case = _case(spec_name)
    graph_module, node = case.build()
    strategies = strategies_for_node(graph_module, node, MESH)
    mutant = _sharded_and_mutant(strategies)
    assert case.isolate and needs_isolation(case, backend), "the spec flags the op: its checks run in a child"

    results = verify_case(backend, case, [*strategies, mutant])

    assert [r.strategy for r in results] == [s.name for s in strategies] + [mutant.name]
    *kept, crashed = results
    assert not crashed.passed and len(crashed.mismatches) == 1, crashed
    assert KILLED.fullmatch(crashed.mismatches[0].detail), crashed
    assert crashed.mismatches[0].kind == "error" and "killed the checking process" in str(crashed)
    assert all(result.passed for result in kept), [str(r) for r in kept if not r.passed]
    # the same content as the check in this process (the real strategies alone are safe here)
    in_process = verify_case(backend, dataclasses.replace(case, isolate=False), strategies)
    assert _timeless(kept) == _timeless(in_process)
    assert spec_name in isolated.crashed_ops()


def test_the_on_demand_path_isolates_a_flagged_op_and_serves_the_strategies_that_live(forget_crashes):
    """A captured call of the op: its CallCase carries the handler's flag, travels to the child with
    its nodes' metadata, and a strategy that kills the child is a rule defect, not served."""
    class Backward(torch.nn.Module):
        def forward(self, grad_output, x):
            return torch.ops.aten._adaptive_avg_pool2d_backward.default(grad_output, x)

    graph_module = trace(Backward(), meta_args={"grad_output": torch.empty(4, 6, 2, 3, device="meta"),
                                                "x": torch.empty(4, 6, 6, 6, device="meta")})
    node = next(n for n in graph_module.graph.nodes if n.op == "call_function")
    handler = handler_for_node(node, graph_module)
    assert handler is not None and handler.isolate
    operands, strategies = handler_strategies(handler, graph_module, node, MESH, every_strategy)
    case = checkable_case(handler, graph_module, node, operands)
    mutant = _sharded_and_mutant(strategies)
    with OnDemandVerifier(cache_dir=None) as verifier:
        assert case.isolate and needs_isolation(case, verifier.backend(MESH))
        served = verifier(UnverifiedCall(handler, graph_module, node, MESH, operands, (*strategies, mutant),
                                         "a layout outside the rule"))
        results = verify_case(verifier.backend(MESH), case, strategies)
        in_process = verify_case(verifier.backend(MESH), dataclasses.replace(case, isolate=False), strategies)
    assert [s.name for s in served] == [s.name for s in strategies]
    (record,) = verifier.records
    assert [name for name, _ in record.failed] == [mutant.name]
    assert KILLED.search(record.failed[0][1]), record.failed
    assert all(result.passed for result in results) and _timeless(results) == _timeless(in_process)


def test_an_op_that_crashed_once_is_isolated_for_the_rest_of_the_process(backend, forget_crashes):
    """The same op under another name and without the flag: checked in this process until one of
    its checks kills a child, isolated after."""
    flagged = _case("adaptive_avg_pool2d_backward")
    case = dataclasses.replace(flagged, op="adaptive_avg_pool2d_backward_unflagged", isolate=False)
    graph_module, node = case.build()
    strategies = strategies_for_node(graph_module, node, MESH)
    mutant = _sharded_and_mutant(strategies)
    assert not needs_isolation(case, backend)

    (crashed,) = verify_isolated(verify_case, backend, case, [mutant], shown_dtype="float32",
                                 backend_name="simulated")
    assert KILLED.fullmatch(crashed.mismatches[0].detail), crashed
    assert "adaptive_avg_pool2d_backward_unflagged" in isolated.crashed_ops()
    assert needs_isolation(case, backend), "one crash: isolated from now on"

    results = verify_case(backend, case, [*strategies, mutant])
    assert [r.passed for r in results] == [True] * len(strategies) + [False]
    assert KILLED.fullmatch(results[-1].mismatches[0].detail)


def test_a_process_backend_rank_killed_by_a_kernel_signal_is_remembered(forget_crashes):
    remember_deaths("op_killed_from_outside", RankDied(0, -9, "a check"))      # SIGKILL: the OOM killer, a stop
    assert "op_killed_from_outside" not in isolated.crashed_ops()
    remember_deaths("op_that_faulted", RankDied(2, -11, "a check"))            # SIGSEGV: the kernel's own
    assert "op_that_faulted" in isolated.crashed_ops()


def test_only_the_in_process_simulated_backend_isolates(backend):
    case = _case("adaptive_avg_pool2d_backward")
    assert needs_isolation(case, backend)
    assert not needs_isolation(case, object())                     # a process backend's ranks are processes
    assert not needs_isolation(dataclasses.replace(case, isolate=False), backend)


SPEC = """\
op: relu
targets: [torch.relu]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
generator:
  family: rules
  options: {pointwise: true}
verify:
  inputs:
    input: {shape: [4, 4]}
  meshes: [[2]]
"""


def test_the_spec_flag_is_parsed_into_every_case():
    spec = parse_op_spec(load_yaml_text(SPEC.replace("  meshes:", "  isolate: true\n  meshes:"), "specs/relu.yaml"))
    assert spec.verify.isolate and all(case.isolate for _, case in spec.op_cases())
    plain = parse_op_spec(load_yaml_text(SPEC, "specs/relu.yaml"))
    assert not plain.verify.isolate and not any(case.isolate for _, case in plain.op_cases())


def test_a_spec_flag_that_is_no_boolean_names_its_line():
    with pytest.raises(SpecError, match=r"specs/relu\.yaml:12.*isolate"):
        parse_op_spec(load_yaml_text(SPEC.replace("  meshes:", "  isolate: yes please\n  meshes:"),
                                     "specs/relu.yaml"))


@dataclasses.dataclass(frozen=True)
class _Stuck:
    """A call whose kernel never returns (as a kernel deadlocked on memory it corrupted)."""

    op: str = "stuck_op"


def _never_returns(case: _Stuck) -> None:
    import time

    while True:
        time.sleep(1)


def test_a_child_that_makes_no_reply_is_killed_said_to_hang_and_not_run_again(monkeypatch):
    monkeypatch.setattr(isolated, "CALL_SECONDS", 3.0)
    monkeypatch.setattr(isolated, "_hung", set())
    with pytest.raises(isolated.ShardVerifyError, match=r"the op's kernel hung: the checking process made no reply "
                                                        r"in 3 s and was killed"):
        isolated.run_isolated(_never_returns, _Stuck())
    with pytest.raises(isolated.ShardVerifyError, match="hung in this process before"):
        isolated.run_isolated(_never_returns, _Stuck())
