"""Outputs an op leaves undefined are never compared: batch norm's saved statistics in
eval mode, _embedding_bag's scratch outputs outside the modes that fill them. The op's own call
says which (capture/uninitialised.py); the defined ones, integers included, compare exactly.
Also: an input given its exact values (``data:``), where no draw makes valid data (bag offsets)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import fx

from shardverify.capture.uninitialised import undefined_outputs
from shardverify.cli.main import main
from shardverify.errors import InvalidArgument
from shardverify.spec.case import InputDecl

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten


def _node(target, *args) -> fx.Node:
    graph = fx.Graph()
    return graph.call_function(target, args)


@pytest.mark.parametrize("mode, undefined", [(0, {1, 2, 3}), (1, {3}), (2, set())])
def test_embedding_bag_defines_its_scratch_outputs_by_mode(mode, undefined):
    assert undefined_outputs(_node(aten._embedding_bag.default, None, None, None, False, mode)) == undefined


def test_embedding_bag_sum_mode_is_the_default():
    assert undefined_outputs(_node(aten._embedding_bag.default, None, None, None)) == {1, 2, 3}


def test_batch_norm_saved_statistics_are_undefined_in_eval_mode_only():
    assert undefined_outputs(_node(aten._native_batch_norm_legit_no_training.default)) == {1, 2}
    args = (None,) * 5
    assert undefined_outputs(_node(aten._native_batch_norm_legit.default, *args, False, 0.1, 1e-5)) == {1, 2}
    assert undefined_outputs(_node(aten._native_batch_norm_legit.default, *args, True, 0.1, 1e-5)) == set()
    assert undefined_outputs(_node(aten.topk.default, None, 2)) == set()


def test_torch_fxs_builtin_of_batch_norm_is_read_as_its_aten_op():
    args = (None,) * 5
    assert undefined_outputs(_node(torch.native_batch_norm, *args, False, 0.1, 1e-5)) == {1, 2}
    assert undefined_outputs(_node(torch.native_batch_norm, *args, True, 0.1, 1e-5)) == set()
    assert undefined_outputs(_node(torch.topk, None, 2)) == set()


def test_the_cpu_kernel_really_leaves_them_unlike_meta():
    """Why they cannot be compared: the CPU and meta kernels disagree on their shapes."""
    weight, ids, offsets = torch.randn(10, 4), torch.tensor([1, 2, 4, 5, 9]), torch.tensor([0, 3])
    cpu = aten._embedding_bag.default(weight, ids, offsets, False, 0)
    meta = aten._embedding_bag.default(weight.to("meta"), ids.to("meta"), offsets.to("meta"), False, 0)
    assert [tuple(t.shape) for t in cpu[1:]] != [tuple(t.shape) for t in meta[1:]]


def test_input_data_gives_exact_values_and_is_validated():
    assert InputDecl("offsets", (3,), "int64", data=[0, 4, 6]).data == (0, 4, 6)
    with pytest.raises(InvalidArgument, match="3 finite number"):
        InputDecl("offsets", (3,), "int64", data=[0, 4])
    with pytest.raises(InvalidArgument, match="integers"):
        InputDecl("offsets", (2,), "int64", data=[0, 1.5])


def test_a_spec_with_bad_data_is_an_error_at_its_line(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    text = (REPO / "specs/embedding_bag_max.yaml").read_text()
    (specs / "embedding_bag_max.yaml").write_text(text.replace("data: [0, 4, 6]", "data: [0, 4]"))
    assert main(["list", "--specs-dir", str(specs)]) == 2
    err = capsys.readouterr().err
    assert "embedding_bag_max.yaml:" in err and "3 finite number" in err and "Traceback" not in err


class _Bags(torch.nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bags, self.proj = torch.nn.EmbeddingBag(20, 8, mode=mode), torch.nn.Linear(8, 8)

    def forward(self, ids):
        return self.proj(self.bags(ids))


@pytest.mark.parametrize("mode", ["sum"])   # its scratch outputs undefined: the other modes alike, cheaper left out
def test_an_embedding_bag_model_plans_strictly(sv_backend, mode):
    """torch.export keeps embedding_bag.padding_idx (not core), decomposed into _embedding_bag, whose
    undefined scratch outputs are left out; the decomposition is traced with gradients (before, its
    forward-only kernel was picked and every plan failed in backward: no autograd for Long)."""
    from shardverify.plan import verify_plan

    torch.manual_seed(0)
    result = verify_plan(_Bags(mode), (torch.randint(0, 20, (4, 5)),), (2,), capture="export", strict=True,
                         min_sharded=1, backend=sv_backend((2,), "simulated"))
    assert result.passed, result.summary()
    assert any("aten._embedding_bag.default" in line for line in result.coverage.lines())


def test_integer_outputs_compare_exactly_whatever_the_tolerance(sv_backend):
    """A rank sorting its own block of the sorted dim: under a tolerance that lets any float pass, its
    values pass, but its int64 indices (positions in its block, not in the dim) fail exactly."""
    import dataclasses

    from shardverify.sharding.sharding_spec import ShardingSpec
    from shardverify.spec.case import OpCase
    from shardverify.verify.engine import verify_case
    from shardverify.verify.tolerance import Tolerance

    case = OpCase(op="sort", target="torch.sort", inputs=(InputDecl("input", (6, 4, 4), "float32"),),
                  params=(("dim", 2), ("descending", False)), seed=0)
    backend = sv_backend((2,), "simulated")
    graph_module, name = case.build()
    from shardverify.strategies.for_node import strategies_for_node

    right = next(s for s in strategies_for_node(graph_module, name, backend.mesh) if s.name.startswith("S0RR"))
    wrong = dataclasses.replace(right, name="RRS0 -> RRS0, RRS0", sharding_specs=tuple(
        (n, ShardingSpec.from_partition((2,), spec.tensor_shape, {2: (0,)})) for n, spec in right.sharding_specs))
    loose = Tolerance(rtol=1e9, atol=1e9)
    assert verify_case(backend, case, [right], tol=loose)[0].passed
    found = verify_case(backend, case, [wrong], tol=loose)[0]
    assert not found.passed
    values = [m for m in found.mismatches if m.kind == "values"]
    assert values and all("indices" in m.tensor or m.tensor.startswith("output 1") for m in values), values
