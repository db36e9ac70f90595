"""`shardverify verify --cluster` and `dtensor --cluster`: rows and cases as units
(backends/units.py) on the actors of a Ray cluster (backends/ray_units.py), checked on a real
cluster of two nodes of one CPU each (``ray.cluster_utils.Cluster``, started once for the module
and shut down after it): the report of the local pool, a DTensor sweep's stored results and report
after a stop and a resume, a node removed mid-sweep, a unit that kills every worker it runs in,
workers on other versions refused.  The cluster tests are marked dist (run with AUTO_PARALLEL=1); the node
removal comes last, since it leaves the cluster one node."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from test_cli_verify import _without_seconds

from shardverify.backends.units import InProcess, Unit, UnitFailed, run_units
from shardverify.cli import verify_cmd
from shardverify.cli.catalogue import load_op_specs
from shardverify.cli.verify_cluster import _start_actor, verify_rows_on_cluster
from shardverify.cli.verify_rows import Progress, row_label, worker_row
from shardverify.errors import ShardVerifyError

REPO = Path(__file__).resolve().parents[1]


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="shardverify")
    verify_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", *argv, "--root", str(REPO)])
    return args.func(args)


def _mm_plan(meshes=((2,), (2, 2))) -> list[tuple]:
    spec, = load_op_specs(REPO, None, ["mm"])
    return [("mm", case_id, case, mesh) for case_id, case in spec.op_cases() for mesh in meshes]


# ------------------------------------------------------------------ the seam, no Ray needed
def _twice(x: int) -> int:
    if x < 0:
        raise ValueError(f"negative: {x}")
    return 2 * x


def test_units_come_back_in_order_and_a_raising_unit_fails_alone():
    done = []
    results = run_units([Unit(_twice, (i,), f"u{i}") for i in (3, -1, 5)], InProcess(),
                        lambda index, value: done.append(index))
    assert results[0] == 6 and results[2] == 10 and done == [0, 1, 2]
    assert isinstance(results[1], UnitFailed) and results[1].error == "ValueError: negative: -1"
    assert not results[1].died


class _Careless:
    """An engine that reports its first unit twice and never its last."""

    def run(self, units, done):
        done(0, "a")
        done(0, "a")
        return ["a"] * (len(units) - 1)


def test_an_engine_that_loses_or_repeats_a_unit_is_an_error():
    with pytest.raises(ShardVerifyError, match=r"without a result: b, c; reported twice: a"):
        run_units([Unit(_twice, (1,), name) for name in "abc"], _Careless())


def test_without_ray_the_cluster_option_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` raises ImportError
    assert cli("mm", "--mesh", "2", "--cluster", "local") == 2
    assert "pip install 'shardverify[cluster]'" in capsys.readouterr().err


def test_audit_and_sweep_jobs_need_a_cluster_and_one_plan_check_runs_here(capsys):
    from shardverify.cli.main import main

    assert main(["audit", "relu", "--mesh", "2", "--jobs", "2", "--root", str(REPO)]) == 2
    assert "--jobs N is the number of Ray workers of --cluster" in capsys.readouterr().err
    assert main(["parallelize", "--sweep-hf", "--only", "llama", "--jobs", "2"]) == 2
    assert "--jobs N is the number of Ray workers of --cluster" in capsys.readouterr().err
    assert main(["parallelize", "hf:llama", "--cluster", "local"]) == 2
    assert "--cluster runs the rows of --sweep-hf; one check runs here" in capsys.readouterr().err


def test_the_cluster_runs_simulated_ranks(capsys):
    assert cli("mm", "--mesh", "2", "--cluster", "local", "--backend", "gloo") == 2
    assert "--cluster runs the rows on workers of simulated ranks; the gloo backend" in capsys.readouterr().err


# ------------------------------------------------------------------ on a two-node cluster
@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="ray is not installed: pip install 'shardverify[cluster]'")
    from ray.cluster_utils import Cluster

    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = started.add_node(num_cpus=1)
        started.wait_for_nodes()
        yield started, worker
    finally:
        started.shutdown()


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_the_cluster_gives_the_report_of_the_local_pool(cluster, capsys):
    """The same --json document, row for row, but for the timings."""
    head, _ = cluster
    reports = []
    for where in (["--jobs", "2"], ["--cluster", head.address, "--jobs", "2"]):
        assert cli("mm", "relu", "--mesh", "2", "--mesh", "2,2", "--json", *where) == 0
        reports.append(_without_seconds(json.loads(capsys.readouterr().out)))
    assert reports[0] == reports[1]
    assert len(reports[0]["rows"]) == 16 and reports[0]["strategies"] > 0


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_a_unit_that_kills_every_worker_fails_after_two_deaths(cluster, tmp_path):
    """The planted row runs on two workers (one at a time: each started when the last died), kills
    both, and fails with the local pool's words; every other row is verified and keeps its place."""
    head, _ = cluster

    class KillsItsProcess:
        """A case whose build ends the process that builds it (an op crashing the interpreter)."""

        def __init__(self, folder: str) -> None:
            self.folder = folder

        def build(self):
            Path(self.folder, str(os.getpid())).touch()
            os._exit(3)

    plan = _mm_plan(((2,),))
    plan.insert(1, ("mm", "killer", KillsItsProcess(str(tmp_path)), (2,)))
    rows = verify_rows_on_cluster(plan, head.address, 1, device=None, timeout=60.0, progress=Progress(0))
    assert [(r.case, r.mesh) for r in rows] == [(case_id, mesh) for _, case_id, _, mesh in plan]
    killed = rows[1]
    assert killed.failures == 1 and killed.verified == 0
    assert killed.error.startswith("its worker process died, also when it ran alone: ActorDiedError"), killed.error
    assert len(list(tmp_path.iterdir())) == 2, "the planted row ran other than twice, each on a worker of its own"
    for row in rows[:1] + rows[2:]:
        assert row.error == "" and row.failures == 0 and row.verified > 0, row


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_workers_on_other_versions_refuse_the_run(cluster, monkeypatch, capsys):
    head, _ = cluster
    from shardverify.backends import ray_units

    def elsewhere() -> dict:   # what a node with another torch says (sent to the worker by value)
        return {**ray_units.installed_versions(), "torch": "2.99.0+elsewhere"}

    monkeypatch.setattr(ray_units, "actor_versions", elsewhere)
    assert cli("mm", "--mesh", "2", "--cluster", head.address, "--jobs", "1") == 2
    captured = capsys.readouterr()
    assert "runs torch 2.99.0+elsewhere and shardverify" in captured.err, captured.err
    assert "never mixed in one report" in captured.err and captured.out == ""


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_a_dtensor_sweep_interrupted_and_resumed_on_the_cluster_stores_and_reports_a_run_here(cluster, tmp_path,
                                                                                             capsys):
    """cumsum on (2, 2), here and on the cluster, each stopped (as Ctrl-C stops it) once three cases
    were stored and resumed with the command line: the stored files and the --json reports are the
    same but for the seconds, and on the cluster the three stored cases did not run again.  (Both
    stop at the same case: a resumed run may attribute a class again that a run from the start
    attributed once, since the stored findings keep the attribution, not what it replaced.)"""
    from shardverify.backends.ray_units import RayEngine
    from shardverify.cli.dtensor_cluster import WORKER_SETUP
    from shardverify.cli.main import main
    from shardverify.features.dtensor.run import run_spec
    from shardverify.features.dtensor.sweep import sweep
    from test_dtensor_sweep import stored, without_seconds

    head, _ = cluster
    spec, = load_op_specs(REPO, None, ["cumsum"])
    argv = ["dtensor", "cumsum", "--mesh", "2,2", "--limit", "4", "--json", "--quiet", "--root", str(REPO)]

    def stop_after_three(settled: list):
        def stop(result) -> None:
            settled.append(result)
            if len(settled) == 3:
                raise KeyboardInterrupt
        return stop

    here, there = tmp_path / "here", tmp_path / "there"
    with pytest.raises(KeyboardInterrupt):
        run_spec(spec, [(2, 2)], limit=4, store=here, root=REPO, on_result=stop_after_three([]))
    status = main([*argv, "--results", str(here)])
    report = without_seconds(json.loads(capsys.readouterr().out))

    settled: list = []
    with pytest.raises(KeyboardInterrupt), RayEngine(head.address, 2, setup=WORKER_SETUP) as engine:
        sweep([spec], [(2, 2)], engine, limit=4, store=there, root=REPO, on_result=stop_after_three(settled))
    (file,) = there.rglob("*.json")
    first = json.loads(file.read_text())
    assert first["done"] == [r.case for r in settled]
    assert main([*argv, "--results", str(there), "--cluster", head.address, "--jobs", "2"]) == status
    assert without_seconds(json.loads(capsys.readouterr().out)) == report
    assert stored(here) == stored(there)
    resumed = json.loads(file.read_text())
    assert [resumed["results"][case]["seconds"] for case in first["done"]] == \
           [first["results"][case]["seconds"] for case in first["done"]], "a stored case ran again"
    assert len(resumed["done"]) == len(report["results"]) > 3


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_an_opinfo_sweep_on_the_cluster_stores_and_reports_a_sweep_here(cluster, tmp_path, capsys):
    """relu's and mm's OpInfo entries: the table and each stored entry (but for its seconds) are a
    sweep here's, and the cluster's results folder holds no lock file."""
    head, _ = cluster
    argv = ["relu", "mm", "--opinfo", "--opinfo-samples", "4", "--mesh", "2"]
    tables, folders = [], []
    for where, extra in (("here", []), ("there", ["--cluster", head.address, "--jobs", "1"])):
        folders.append(tmp_path / where)
        assert cli(*argv, "--opinfo-results", str(folders[-1]), *extra) == 0
        tables.append([line for line in capsys.readouterr().out.splitlines() if " swept in " not in line])
    assert tables[0] == tables[1] and "nn.functional.relu" in "\n".join(tables[0])
    entries = [{path.name: _without_seconds(json.loads(path.read_text())) for path in folder.glob("*.json")}
               for folder in folders]
    assert entries[0] == entries[1] and sorted(entries[0]) == ["mm.json", "nn.functional.relu.json"]
    assert sorted(path.name for path in folders[1].iterdir()) == sorted(entries[1]), "more than results there"


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_an_audit_on_the_cluster_gives_the_report_of_one_here(cluster, capsys):
    """The --json document, row for row, but for the timings."""
    from shardverify.cli.main import main

    head, _ = cluster
    reports = []
    for where in ([], ["--cluster", head.address, "--jobs", "2"]):
        assert main(["audit", "relu", "mm", "--mesh", "2", "--json", "--root", str(REPO), *where]) == 0
        report = _without_seconds(json.loads(capsys.readouterr().out))
        report.pop("ms_per_decided_combination")
        reports.append(report)
    assert reports[0] == reports[1] and len(reports[0]["rows"]) == 8


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_a_shipped_plan_sweep_on_the_cluster_stores_what_a_sweep_here_does(cluster, tmp_path, capsys):
    """llama's own tp_plan on (2,), inference: the verdict line and the stored rows (but for their
    CPU seconds) are a sweep here's."""
    pytest.importorskip("transformers")
    from shardverify.cli.main import main

    head, _ = cluster
    argv = ["parallelize", "--sweep-hf", "--only", "llama", "--mesh", "2", "--mode", "inference"]
    outs, stored = [], []
    for where, extra in (("here", []), ("there", ["--cluster", head.address, "--jobs", "1"])):
        assert main([*argv, "--results", str(tmp_path / where), *extra]) == 0
        outs.append(capsys.readouterr().out)
        stored.append({p.name: {k: v for k, v in json.loads(p.read_text()).items() if k != "cpu_seconds"}
                       for p in (tmp_path / where).glob("*.json")})
    assert outs[0] == outs[1] and outs[0].startswith("PASS: 1 of 1 rows right")
    assert stored[0] == stored[1] and sorted(stored[0]) == ["llama--2--inference.json", "llama--plan.json"]


@pytest.mark.dist
@pytest.mark.slow   # the module's cluster start-up is paid once: its tests sorted first, together
@pytest.mark.xdist_group("shardverify-cluster")
def test_a_node_removed_mid_sweep_loses_no_unit(cluster, tmp_path):
    """The worker node goes while one of its units is running: that unit runs again on the head
    node's worker, and every unit has exactly one result, in order."""
    head, worker = cluster
    from shardverify.backends.ray_units import RayEngine

    def marked_row(folder: str, index: int, item: tuple, worker_node: str):
        """Says where it runs, then takes a while. A unit elsewhere than the worker node waits
        until the worker node has taken one: at load 25 its actor started after the head node's
        worker had run every unit (a hang guard of 600 s only)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        marker = Path(folder, f"{index}.{os.getpid()}.tmp")
        marker.write_text(here)
        marker.rename(marker.with_suffix(""))     # whole, for the watcher to read
        deadline = time.monotonic() + 600
        while here != worker_node and time.monotonic() < deadline and \
                not any(m.suffix != ".tmp" and m.read_text() == worker_node for m in Path(folder).iterdir()):
            time.sleep(0.05)
        time.sleep(1.5)
        return worker_row(item, None, 60.0, False)

    removed: list[str] = []

    def remove_when_busy() -> None:
        deadline = time.monotonic() + 900    # a hang guard, past a unit's wait for the worker node
        while time.monotonic() < deadline and not removed:
            for marker in tmp_path.iterdir():
                if marker.suffix != ".tmp" and marker.read_text() == worker.node_id:
                    head.remove_node(worker)
                    removed.append(marker.name)
                    return
            time.sleep(0.05)

    plan = _mm_plan()
    units = [Unit(marked_row, (str(tmp_path), i, item, worker.node_id), row_label(item))
             for i, item in enumerate(plan)]
    watcher = threading.Thread(target=remove_when_busy, daemon=True)
    watcher.start()
    counts = [0] * len(units)
    with RayEngine(head.address, 2, setup=_start_actor) as engine:
        rows = run_units(units, engine, lambda index, value: counts.__setitem__(index, counts[index] + 1))
    watcher.join(5)
    assert removed, "no unit ran on the worker node"
    assert engine.retried >= 1 and counts == [1] * len(units)
    assert [(r.case, r.mesh) for r in rows] == [(case_id, mesh) for _, case_id, _, mesh in plan]
    for row in rows:
        assert row.error == "" and row.failures == 0 and row.verified > 0, row
