"""Calibration: the alpha-beta fit, the file DeviceMesh.calibrated loads, the rank correlation,
and (dist) `shardverify calibrate` on gloo."""

from __future__ import annotations

import json

import pytest

from shardverify import DeviceMesh
from shardverify.backends.calibration import (
    ENV_VAR,
    Sample,
    calibration_path,
    fit_axis,
    fit_mesh,
    load_calibration,
    save_calibration,
    spearman,
)
from shardverify.errors import MeshError

PAYLOADS = (1024, 4096, 65536, 1 << 20)


def model_samples(mesh: DeviceMesh) -> list[Sample]:
    """Timings exactly as ``mesh``'s own model prices them."""
    return [Sample(axis, kind, p, mesh.collective_cost(kind, p, (axis,)))
            for axis in range(mesh.ndim) for kind in ("all_reduce", "all_gather") for p in PAYLOADS]


def test_fit_recovers_the_model_per_axis():
    truth = DeviceMesh((2, 4), alpha=(3e-5, 7e-6), beta=(2e-9, 5e-10))
    fits = fit_mesh(truth.shape, model_samples(truth))
    assert [f.axis for f in fits] == [0, 1]
    for fit in fits:
        assert fit.alpha == pytest.approx(truth.alpha[fit.axis], rel=1e-6)
        assert fit.beta == pytest.approx(truth.beta[fit.axis], rel=1e-6)
        assert fit.rel_rms < 1e-6 and fit.points == 2 * len(PAYLOADS)


def test_fit_never_goes_negative():
    flat = [Sample(0, "all_reduce", p, 1e-3) for p in PAYLOADS]   # pure latency, no bandwidth term
    fit = fit_axis((4,), flat, 0)
    assert fit.alpha > 0 and fit.beta == 0.0
    assert fit.alpha * 2 * 3 == pytest.approx(1e-3)   # all-reduce over 4 ranks: 2 (n - 1) steps


def test_an_axis_of_one_rank_costs_nothing_and_too_few_timings_are_refused():
    assert fit_mesh((1, 2), model_samples(DeviceMesh((1, 2))))[0].alpha == 0.0
    with pytest.raises(MeshError, match="at least 2 timings"):
        fit_axis((2,), [Sample(0, "all_reduce", 1024, 1e-4)], 0)


def test_saved_calibration_is_what_the_mesh_loads(tmp_path, monkeypatch):
    truth = DeviceMesh((2, 2), alpha=(4e-5, 1e-5), beta=(3e-9, 1e-9))
    path = tmp_path / "cal.json"
    save_calibration(truth.shape, fit_mesh(truth.shape, model_samples(truth)), backend="gloo", device="cpu",
                     path=path)
    other = DeviceMesh((4,), alpha=(2e-5,), beta=(1e-9,))
    save_calibration(other.shape, fit_mesh(other.shape, model_samples(other)), backend="gloo", device="cpu",
                     path=path)
    assert sorted(json.loads(path.read_text())["meshes"]) == ["2,2", "4"]   # entries are added, not replaced
    mesh = DeviceMesh.calibrated((2, 2), path=str(path))
    assert mesh.alpha == pytest.approx(truth.alpha) and mesh.beta == pytest.approx(truth.beta)
    assert mesh.all_reduce_cost(1 << 20, (0,)) == pytest.approx(truth.all_reduce_cost(1 << 20, (0,)))
    monkeypatch.setenv(ENV_VAR, str(path))
    assert calibration_path() == path
    assert DeviceMesh.calibrated((4,)).alpha == pytest.approx(other.alpha)


def test_loading_errors_name_the_file_and_what_is_there(tmp_path):
    with pytest.raises(MeshError, match="no calibration file at .*missing.json; run `shardverify calibrate"):
        load_calibration((2, 2), tmp_path / "missing.json")
    path = tmp_path / "cal.json"
    save_calibration((4,), fit_mesh((4,), model_samples(DeviceMesh((4,)))), backend="gloo", device="cpu", path=path)
    with pytest.raises(MeshError, match=r"no entry for mesh 2,2; it has \['4'\]"):
        load_calibration((2, 2), path)
    path.write_text('{"format": 1, "meshes": {"4": {"alpha": [1], "beta": "x"}}}')
    with pytest.raises(MeshError, match="beta must be a list of 1 numbers"):
        load_calibration((4,), path)
    path.write_text("not json")
    with pytest.raises(MeshError, match="cannot read it as JSON"):
        load_calibration((4,), path)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([0, 0, 1, 2], [5, 6, 7, 8]) == pytest.approx(0.9486833, rel=1e-6)   # ties share ranks
    with pytest.raises(ValueError, match="equally long"):
        spearman([1, 2], [1])


@pytest.mark.dist
def test_calibrate_on_gloo_writes_a_loadable_file(tmp_path, capsys, monkeypatch):
    from shardverify.cli.main import main
    from shardverify.plan.device import device_profile

    path = tmp_path / "cal.json"
    assert main(["calibrate", "--backend", "gloo", "--mesh", "2,2", "--out", str(path), "--max-bytes", "4096",
                 "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mesh = DeviceMesh.calibrated((2, 2), path=str(path))
    assert [a["alpha_s"] for a in report["axes"]] == list(mesh.alpha)
    assert all(a >= 0 for a in mesh.alpha + mesh.beta) and any(a > 0 for a in mesh.alpha + mesh.beta)
    monkeypatch.setenv(ENV_VAR, str(path))      # plan --device calibrated: the links and the arithmetic measured
    profile = device_profile("calibrated", (2, 2))
    assert report["multiply_adds_per_s"] > 0 and profile.multiply_adds_per_s == report["multiply_adds_per_s"]
    assert profile.mesh((2, 2)).beta == mesh.beta and "float32 matmul" in profile.about
    ranking = report["ranking"]
    assert len(ranking["strategies"]) > 10 and -1.0 <= ranking["spearman"] <= 1.0
