"""The solver's plan written as a PyTorch parallelize plan (``shardverify plan --export-parallelize``)
and checked by the shipped-plan checker against the single device: a tensor-parallel MLP exports as
Colwise + Rowwise and passes; the same file with one layout wrong fails; a plan some of whose nodes no
ParallelStyle expresses lists each of them, in the file, on stderr and in --json."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from shardverify.cli.main import main
from shardverify.errors import InvalidArgument
from shardverify.features.parallelize import check_parallelize
from shardverify.features.parallelize.models import from_factory
from shardverify.features.parallelize.names import file_plan_name
from shardverify.features.parallelize.report import render
from shardverify.plan import verify_plan, zoo
from shardverify.plan.export import WHOLE, export_parallelize
from shardverify.plan.export_code import render_parallelize
from shardverify.plan.inputs import parse_input

MLP = "shardverify.plan.zoo.mlp_block"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The current folder a fresh one, on the path for this test only, its exported modules forgotten after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("exported_")]:
        del sys.modules[name]


def _mlp_export():
    torch.manual_seed(0)
    result = verify_plan(zoo.mlp_block(), torch.randn(8, 32), (2,), shard_weights=True)
    assert result.passed
    return export_parallelize(result.plan, result.graph_facts)


def test_the_solvers_tensor_parallel_mlp_exports_as_colwise_rowwise_and_the_checker_passes_it(in_tmp, capsys):
    assert main(["plan", MLP, "--input", "8,32", "--mesh", "2", "--shard-weights",
                 "--export-parallelize", "exported_mlp_tp.py"]) == 0
    assert "2 module(s) as ParallelStyles on mesh axis 0; 0 not expressible" in capsys.readouterr().err
    text = (in_tmp / "exported_mlp_tp.py").read_text()
    assert "'fc1': ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)" in text
    assert "'fc2': RowwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()" in text
    result = check_parallelize(MLP, "exported_mlp_tp.py", (2,), steps=1, inputs=["x=8,32"])
    assert result.verdict == "right", render(result)
    assert result.compared > 10 and not result.findings


def test_the_check_fails_when_the_export_writes_a_layout_wrong(in_tmp):
    export = _mlp_export()
    rowwise = next(s for s in export.styles if s.style == "rowwise")
    planted = dataclasses.replace(export, styles=tuple(
        dataclasses.replace(s, input_layout=WHOLE) if s is rowwise else s for s in export.styles))
    (in_tmp / "exported_mlp_wrong.py").write_text(render_parallelize(planted, MLP))
    result = check_parallelize(MLP, "exported_mlp_wrong.py", (2,), steps=1, inputs=["x=8,32"])
    assert result.verdict != "right"


def test_nodes_no_parallel_style_expresses_are_listed_never_dropped(in_tmp, capsys):
    code = main(["plan", "shardverify.plan.zoo.transformer_block", "--input", "2,8,32", "--mesh", "2",
                 "--shard-weights", "--json", "--export-parallelize", "exported_block.py"])
    assert code == 0
    out, err = capsys.readouterr()
    listed = json.loads(out)["parallelize_export"]
    missing = {item["where"]: item["reason"] for item in listed["not_expressible"]}
    # the heads' reshapes keep the traced global sizes while they run on a shard
    assert "reshape" in missing and "sizes of the whole tensor" in missing["reshape"]
    text = (in_tmp / "exported_block.py").read_text()
    for where in missing:
        assert f"#   {where!r}: " in text and f"    ({where!r}, " in text
        assert f"not expressible: {where}: " in err
    assert {s["module"] for s in listed["styles"]} >= {"q", "k", "v"}
    namespace: dict = {}
    exec(compile(text, "exported_block.py", "exec"), namespace)   # the file is valid Python
    assert len(namespace["NOT_EXPRESSED"]) == len(listed["not_expressible"])


class NormedMLP(torch.nn.Module):
    """Two MLPs with a LayerNorm between them: Megatron's sequence parallelism around the norm."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)
        self.norm = torch.nn.LayerNorm(16)
        self.fc3, self.fc4 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.norm(self.fc2(torch.relu(self.fc1(x))))
        return self.fc4(torch.relu(self.fc3(h)))


#: the row-parallel fc2's reduction left to a reduce-scatter over the sequence, the norm on sequence shards
SEQUENCE_PARALLEL = {"fc1": "RS0 = RR x RS0", "relu": "RRS0 -> RRS0",
                     "fc2": {"strategy": "RR = RS0 x S0R", "defer": True}, "norm": "RS0R x R x R -> RS0R",
                     "fc3": "RS0 = RR x RS0", "relu_1": "RRS0 -> RRS0", "fc4": "RR = RS0 x S0R"}


def test_a_norm_on_sequence_shards_exports_as_sequence_parallel_and_leaving_it_out_is_caught(in_tmp):
    torch.manual_seed(0)
    result = verify_plan(NormedMLP(), torch.randn(2, 8, 16), (2,), SEQUENCE_PARALLEL)
    export = export_parallelize(result.plan, result.graph_facts)
    assert result.passed and not export.inexpressible
    assert [(s.module, s.style, str(s.input_layout), str(s.output_layout)) for s in export.styles] == [
        ("fc1", "colwise", "Replicate()", "Shard(2)"), ("fc2", "rowwise", "Shard(2)", "Shard(1)"),
        ("norm", "sequence", "Shard(1)", "Shard(1)"), ("fc3", "colwise", "Shard(1)", "Shard(2)"),
        ("fc4", "rowwise", "Shard(2)", "Replicate()")]
    source = from_factory("NormedMLP", NormedMLP, [parse_input("x=2,8,16")])
    (in_tmp / "exported_sp.py").write_text(render_parallelize(export, "NormedMLP"))
    right = check_parallelize(source, "exported_sp.py", (2,), steps=1)
    assert right.verdict == "right", render(right)
    # the norm left out: its replicated weight's gradient stays each rank's part
    left_out = dataclasses.replace(export, styles=tuple(s for s in export.styles if s.style != "sequence"))
    (in_tmp / "exported_sp_left_out.py").write_text(render_parallelize(left_out, "NormedMLP"))
    wrong = check_parallelize(source, "exported_sp_left_out.py", (2,), steps=1)
    assert wrong.verdict == "silently wrong" and wrong.culprit.module == "norm", render(wrong)


def test_names_in_the_file_are_written_as_data():
    export = _mlp_export()
    hostile = "fc1': 0}; RAN = True; {'\n#"
    planted = dataclasses.replace(export, styles=(dataclasses.replace(export.styles[0], module=hostile),))
    text = render_parallelize(planted, "a'\nRAN = True\n")
    namespace: dict = {}
    exec(compile(text, "exported.py", "exec"), namespace)
    assert list(namespace["PLAN"]) == [hostile] and "RAN" not in namespace


def test_a_plan_file_must_lie_under_the_current_folder(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "my_plan.py").write_text("")
    assert file_plan_name("pkg/my_plan.py", tmp_path) == "pkg.my_plan:parallelize"
    assert file_plan_name("pkg/my_plan.py:PLAN", tmp_path) == "pkg.my_plan:PLAN"
    assert file_plan_name("mypkg.plans.parallelize", tmp_path) == "mypkg.plans.parallelize"
    with pytest.raises(InvalidArgument, match="under the current folder"):
        file_plan_name("../elsewhere.py", tmp_path / "pkg")
    with pytest.raises(InvalidArgument, match="no such file"):
        file_plan_name("absent.py", tmp_path)


@pytest.mark.dist
def test_a_2x2_plan_exports_as_data_parallel_by_tensor_parallel_and_is_right_on_gloo_processes(in_tmp):
    # the batch split over axis 0 (weights whole there), Colwise + Rowwise over axis 1
    (in_tmp / "dptp.yaml").write_text('fc1: "S0S1 = S0R x RS1_0"\nact: "S0S1 -> S0S1"\nfc2: "S0R = S0S1 x S1R_0"\n')
    assert main(["plan", MLP, "--input", "8,32", "--mesh", "2,2", "--plan", "dptp.yaml",
                 "--export-parallelize", "exported_dptp.py"]) == 0
    text = (in_tmp / "exported_dptp.py").read_text()
    assert "TENSOR_PARALLEL_AXIS = 1" in text and "DATA_PARALLEL_AXES = (0,)" in text
    result = check_parallelize(MLP, "exported_dptp.py", (2, 2), steps=1, inputs=["x=8,32"])
    assert result.verdict == "right", render(result)
    # without the data parallelism each data-parallel rank keeps the gradient of its own rows
    (in_tmp / "exported_tp_only.py").write_text(text.replace("DATA_PARALLEL_AXES = (0,)", "DATA_PARALLEL_AXES = ()"))
    assert check_parallelize(MLP, "exported_tp_only.py", (2, 2), steps=1, inputs=["x=8,32"]).verdict != "right"
