"""The handler interface: declarations are data, registration is by torch target."""

import pytest
import torch

from shardverify.strategies.rules.sources import parse_rule
from shardverify import DeviceMesh, HandlerError, strategies_for_node, trace
from shardverify.strategies.generators import generator_names, get_generator
from shardverify.strategies.handlers import (
    HandlerDef,
    OperandDecl,
    ParamDecl,
    handler_for_node,
    register_handler,
    registered_handlers,
    resolve_params,
)
from shardverify.strategies.handlers.base import target_key, unregister_handler


def test_generated_handlers_are_registered_on_import():
    handlers = registered_handlers()
    assert {"linear", "sum"} <= set(handlers)
    assert handlers["linear"].generator == "rules"
    assert "rules" in generator_names() and "replicated" not in generator_names()


def test_targets_map_to_fx_node_targets():
    assert target_key(torch.Tensor.sum) == "sum"
    assert target_key(torch.sum) is torch.sum
    assert target_key(torch.nn.Linear) is torch.nn.Linear


def test_handler_for_node_by_module_class_function_and_method():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.sum(self.proj(x), 0) + self.proj(x).sum() + torch.sinc(x).sum(0)

    gm = trace(M(), meta_args={"x": torch.empty(2, 4, device="meta")})
    found = {n.name: getattr(handler_for_node(n, gm), "name", None) for n in gm.graph.nodes}
    assert found["proj"] == "linear" and found["sum_1"] == "sum" and found["sum_2"] == "sum"
    assert found["sinc"] is None and found["x"] is None
    sum_node = next(n for n in gm.graph.nodes if n.name == "sum_1")
    assert resolve_params(registered_handlers()["sum"], sum_node) == {"dim": 0, "keepdim": False}


def test_a_spec_only_op_needs_no_engine_change():
    """torch.nansum registered purely as data reuses the rules engine (a reduction following its input)."""
    defn = HandlerDef(name="nansum_test", targets=(torch.nansum,),
                      operands=(OperandDecl("input", "input", index=0), OperandDecl("output", "output")),
                      params=(ParamDecl("dim", 1, "dim", None), ParamDecl("keepdim", 2, "keepdim", False)),
                      generator="rules", rule=parse_rule({"follow": "input", "reduce_dims_param": "dim",
                                                          "keepdim_param": "keepdim"}))
    register_handler(defn)
    try:
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(16, 32)

            def forward(self, x):
                return torch.nansum(self.linear(x), dim=1, keepdim=True)
        gm = trace(M(), meta_args={"x": torch.empty(4, 4, 16, device="meta")})
        vector = strategies_for_node(gm, "nansum", DeviceMesh((2, 2)))
        assert vector[0].name == "[S0, R, S1] -> [S0, R, S1]_0"
    finally:
        unregister_handler("nansum_test")


def test_conflicting_registration_is_rejected():
    clash = HandlerDef(name="other_sum", targets=("sum",),
                       operands=(OperandDecl("input", "input", index=0), OperandDecl("output", "output")),
                       generator="rules")
    with pytest.raises(HandlerError, match="'sum'.*already handled by 'sum'"):
        register_handler(clash)


@pytest.mark.parametrize("build,needle", [
    (lambda: OperandDecl("x", "tensor", index=0), "kind 'tensor'"),
    (lambda: OperandDecl("x", "input"), "index or a keyword"),
    (lambda: HandlerDef("h", (), (OperandDecl("o", "output"),), generator="rules"), "no targets"),
    (lambda: HandlerDef("h", (torch.sum,), (OperandDecl("i", "input", 0),), generator="rules"), "an output"),
    (lambda: HandlerDef("h", (torch.sum,), (OperandDecl("o", "output"),)), "no generator"),
    (lambda: get_generator("nope"), "unknown strategy generator 'nope'"),
])
def test_bad_declarations_are_rejected(build, needle):
    with pytest.raises(HandlerError, match=needle):
        build()


def test_handlers_of_one_target_told_apart_by_where_a_tensor_is_passed():
    """torch.max(x, dim) is max.yaml's, torch.max(a, b) binary_monotone.yaml's; torch.clamp with
    number bounds clamp.yaml's, with a tensor bound clamp_tensor.yaml's: each call is served by the
    declaration that takes a tensor where the call passes one (and strategies come from it)."""
    class M(torch.nn.Module):
        def forward(self, a, b):
            return (torch.max(a, 1)[0], torch.max(a, b), a.min(b), torch.clamp(a, -0.5, 0.5),
                    torch.clamp(a, b), torch.clamp(a, max=b))

    shapes = {"a": torch.empty(4, 6, device="meta"), "b": torch.empty(4, 6, device="meta")}
    gm = trace(M(), meta_args=shapes)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
             and n.target is not __import__("operator").getitem]
    found = [handler_for_node(n, gm).name for n in calls]
    assert found == ["max", "binary_monotone", "binary_monotone", "clamp", "clamp_tensor", "clamp_tensor"]
    assert {s.name for s in strategies_for_node(gm, calls[1].name, DeviceMesh((4,)))} >= {"S0R x S0R -> S0R"}


def test_a_second_handler_of_a_target_must_take_a_tensor_where_the_first_takes_a_number():
    from shardverify.strategies.handlers.base import signature_apart

    number = (OperandDecl("input", "input", index=0), OperandDecl("output", "output"))
    tensor = (OperandDecl("input", "input", index=0), OperandDecl("other", "input", index=1),
              OperandDecl("output", "output"))
    assert signature_apart(number, (ParamDecl("dim", 1, "dim"),), tensor, ())
    assert not signature_apart(number, (ParamDecl("dim", 1, "dim"),), number, (ParamDecl("dim", 1, "dim"),))
    clash = HandlerDef(name="number_max", targets=(torch.max,), operands=number,
                       params=(ParamDecl("k", 2, "k"),), generator="rules")
    with pytest.raises(HandlerError, match="already handled by .*tensor where the other takes a number"):
        register_handler(clash)


def test_rules_of_one_target_are_told_apart_by_a_flag_and_by_the_result():
    # torch.var(x, True) passes a flag where var.yaml reads a dim; torch.max(x) returns one tensor
    # where max.yaml reads values and indices: each call is the other rule's (var_all, max_all)
    calls = {"var_all": [lambda x: torch.var(x, True), lambda x: x.var(False)],
             "var": [lambda x: torch.var(x, 1), lambda x: torch.var(x, [0, 1])],
             "max_all": [lambda x: torch.max(x), lambda x: x.min()],
             "max": [lambda x: torch.max(x, 1), lambda x: torch.max(x, dim=0)],
             "binary_monotone": [lambda x: torch.max(x, x)]}

    class One(torch.nn.Module):
        def __init__(self, call):
            super().__init__()
            self.call = call

        def forward(self, x):
            return self.call(x)

    for expected, functions in calls.items():
        for call in functions:
            gm = trace(One(call), {"x": torch.randn(4, 6)})
            node = next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                        and "getitem" not in str(n.target))
            assert handler_for_node(node, gm).name == expected, node.format_node()
