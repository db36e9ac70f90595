"""What a checking process keeps between cases: the references within their byte budget, and
nothing of a case it is done with in the engine's tables (blocks, slices, bounds, pieces,
module copies), which were made from the tensors of a case and, kept, kept those tensors
alive: at 16x the grid's shapes a run of sum's cases grew by 1.85 GB a case."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.backends import SimulatedBackend
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.strategies.for_node import strategies_for_node
from shardverify.verify import memo, reference as reference_module
from shardverify.verify.engine import verify_case
from shardverify.verify.reference import reference

CPU = torch.device("cpu")
MM = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (6, 4)), InputDecl("b", (4, 6))))
LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (6, 8)),),
                module=ModuleDecl("torch.nn.Linear", (8, 4), ()))


def _sum_cases() -> list[OpCase]:
    """Two cases of the sum spec: a following op whose strategies hold partial sums (pieces)."""
    from shardverify.spec.catalogue import load_op_specs

    spec = load_op_specs(Path(__file__).resolve().parents[1], None, ["sum"])[0]
    return [case for _, case in list(spec.op_cases())[:2]]


def _checked(backend, case: OpCase) -> None:
    graph_module, node = case.build()
    results = verify_case(backend, case, list(strategies_for_node(graph_module, node, backend.mesh)))
    assert results and all(r.passed for r in results), [r.report() for r in results if not r.passed]


@pytest.mark.parametrize("which", ["sum", "linear"])
def test_a_case_done_with_is_let_go_by_every_table_of_the_engine(monkeypatch, which):
    monkeypatch.setattr(reference_module, "REFERENCE_BYTES", 0)   # the newest reference alone is kept
    monkeypatch.setattr(reference_module, "_REFERENCES", {})      # each built here, whatever ran before
    first, second = _sum_cases() if which == "sum" else (LINEAR, MM)
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=60) as backend:
        _checked(backend, first)
        ref = reference(first, None, CPU)
        watched = [weakref.ref(t) for t in (*ref.values.values(), *ref._typed.values(), *ref.outputs,
                                              *ref.grads.values())]
        assert any(memo._CASE_TABLES.values()), "the check made no block, slice or bound"
        del ref
        _checked(backend, second)
        gc.collect()   # with the backend's rank threads still running: their own tables too
        alive = [w() for w in watched if w() is not None]
    assert not alive, f"{len(alive)} of the first case's {len(watched)} tensors are still alive"


def test_building_a_reference_empties_the_case_tables(monkeypatch):
    monkeypatch.setattr(reference_module, "_REFERENCES", {})   # built here, whatever ran before
    table = memo.case_table()
    table["made from an earlier case"] = 1
    reference(OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (2, 3)), InputDecl("b", (3, 5)))), None, CPU)
    assert not table


def test_references_are_kept_within_their_bytes_the_newest_whatever_its_size(monkeypatch):
    monkeypatch.setattr(reference_module, "_REFERENCES", {})
    cases = [OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (8, n)), InputDecl("b", (n, 8))))
             for n in (5, 6, 7)]
    one = reference(cases[0], None, CPU).held_bytes()
    monkeypatch.setattr(reference_module, "REFERENCE_BYTES", 2 * one + one // 2)   # room for two of these
    refs = [reference(case, None, CPU) for case in cases]
    kept = list(reference_module._REFERENCES.values())
    assert kept == refs[1:], "the oldest goes first, and as many are kept as fit"
    monkeypatch.setattr(reference_module, "REFERENCE_BYTES", 0)
    big = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (64, 64)), InputDecl("b", (64, 64))))
    made = reference(big, None, CPU)
    assert list(reference_module._REFERENCES.values()) == [made]   # kept alone, over the budget


def test_a_references_bytes_count_the_values_converted_after_it_was_built(monkeypatch):
    monkeypatch.setattr(reference_module, "_REFERENCES", {})
    ref = reference(OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (8, 5)), InputDecl("b", (5, 8)))),
                    None, CPU)
    built = ref.held_bytes()
    assert built == sum(t.nbytes for t in ref.tensors())
    loc = next(iter(ref.values))
    converted = ref.typed(loc)   # float32 from the float64 value: held beside it from now on
    assert ref.held_bytes() == built + converted.nbytes == sum(t.nbytes for t in ref.tensors())


def test_the_dtypes_a_ranks_outputs_must_have_come_from_the_trace_in_the_traced_dtypes(monkeypatch):
    """In the traced dtypes the shapes' propagation ran the op on meta tensors of those dtypes
    already; in another check dtype the op runs on meta tensors of that one."""
    monkeypatch.setattr(reference_module, "_REFERENCES", {})
    case = OpCase(op="mm", target="torch.mm", inputs=(InputDecl("a", (4, 3)), InputDecl("b", (3, 5))))
    real = reference_module._result_dtypes
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference_module, "_result_dtypes", counted)
    assert reference(case, None, CPU).out_dtypes == (torch.float32,) and not calls
    assert reference(case, torch.float16, CPU).out_dtypes == (torch.float16,) and len(calls) == 1
