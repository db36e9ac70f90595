"""Rule sources as registered units: a new one is one module plus its registry entry, a spec
selecting it parses once into the rule it carries (its parameters declared, so explore draws
them as the source says), and its strategies verify."""

from __future__ import annotations

import pytest

from rule_source_along import AlongDim
from shardverify.features.audit.run import spec_handler
from shardverify.backends.simulated import SimulatedBackend
from shardverify.errors import SpecError
from shardverify.features.explore.params import param_draws
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.strategies.for_node import find_node, handler_strategies
from shardverify.strategies.rules.sources import parse_rule, register_source, source_keys, unregister_source
from shardverify.verify.engine import verify_case

SPEC = """\
op: softmax_along
targets: [torch.softmax]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
params:
  dim: {index: 1, keyword: dim}
generator:
  family: rules
  options:
    along_param: dim
verify:
  inputs:
    input: {shape: [4, 6, 8], dtype: float32}
  grid:
    dim: [1, -1]
  meshes: [[2]]
"""


@pytest.fixture
def along():
    register_source(AlongDim)       # the registry entry: all a new source needs besides its module
    try:
        yield
    finally:
        unregister_source(AlongDim.key)


def test_a_new_source_is_one_module_and_a_registry_entry(along):
    spec = parse_op_spec(load_yaml_text(SPEC, "specs/softmax_along.yaml"))
    assert isinstance(spec.rule.source, AlongDim) and spec.rule.source.along_param == "dim"
    assert spec.read_params() == {"dim"}                       # so the handler serves every dim
    assert [(d.key, d.kind) for d in param_draws(spec)] == [("dim", "dims")]
    handler = spec_handler(spec)
    backend = SimulatedBackend(DeviceMesh((2,)))
    try:
        for (case_id, case), whole in zip(spec.op_cases(), (1, 2)):
            graph_module, node = case.build()
            _, strategies = handler_strategies(handler, graph_module, find_node(graph_module, node), backend.mesh)
            names = [s.name for s in strategies]
            assert names == [n for d, n in enumerate(("S0RR -> S0RR", "RS0R -> RS0R", "RRS0 -> RRS0")) if d != whole] \
                + ["RRR -> RRR"], case_id
            if whole == 2:        # verified on one grid point: each strategy computes softmax right
                assert all(r.passed for r in verify_case(backend, case, strategies)), case_id
    finally:
        backend.close()


def test_without_its_registry_entry_the_key_is_unknown():
    assert "along_param" not in source_keys()
    with pytest.raises(SpecError, match=r"softmax_along.yaml:11: .*unknown rule option 'along_param'; known: "):
        parse_op_spec(load_yaml_text(SPEC, "specs/softmax_along.yaml"))


def test_a_source_declares_what_its_keys_name():
    rule = parse_rule({"view": "permute", "dims_param": "dims", "linear_in": ["input"], "monotone_in": ["-input"]})
    assert {(r.key, r.kind, r.name, r.draw) for r in rule.refs} == {
        ("dims_param", "param", "dims", "permutation"), ("linear_in", "operand", "input", ""),
        ("monotone_in", "operand", "input", "")}
    rule = parse_rule({"einsum": "b i, b j -> i j", "size_params": {"n": "b"}, "indices": {"ids": "i"}})
    assert {(r.key, r.at, r.name) for r in rule.refs} == {("size_params", ("n",), "n"), ("indices", ("ids",), "ids")}
