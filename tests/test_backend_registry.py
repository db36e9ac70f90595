"""The backend registry (shardverify/backends/registry.py) is the one description of the backend
kinds: every front door reads it, a bad name is refused before any work, and a new kind is one
module plus one ``register`` call."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from shardverify.backends import get_backend, registry
from shardverify.backends.registry import BackendKind
from shardverify.cli.main import build_parser, main
from shardverify.errors import BackendError
from shardverify.sharding.mesh import DeviceMesh

ROOT = Path(__file__).resolve().parent.parent

#: a new backend kind's one module: simulated ranks that log each hand-over to them
TOY_MODULE = '''
from shardverify.backends.simulated import SimulatedBackend

RUNS = []


class LoggingBackend(SimulatedBackend):
    """Threads of this process, like simulated, that log each run and batch they are handed."""

    def run(self, fn, *args, **kwargs):
        RUNS.append(("run", fn.__qualname__))
        return super().run(fn, *args, **kwargs)

    def run_batch(self, fn, items, **kwargs):
        RUNS.append(("batch", fn.__qualname__))
        return super().run_batch(fn, items, **kwargs)
'''


def backend_choices(command: str) -> tuple[str, ...]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return tuple(next(a for a in sub._actions if a.dest == "backend").choices)


def test_every_front_door_reads_the_registry():
    from shardverify import pytest_plugin

    assert registry.backend_names() == ("simulated", "process", "gloo", "nccl", "torchrun")
    assert backend_choices("verify") == registry.backend_names()
    assert backend_choices("plan") == ("simulated", "process", "gloo", "nccl")    # any mesh: not torchrun's world
    assert backend_choices("calibrate") == ("process", "gloo", "nccl")           # real collectives
    assert pytest_plugin.BACKEND_KINDS == ("simulated", "process")               # placed by --sv-device


def test_nccl_or_gloo_is_decided_once():
    assert registry.choose_dist(4, 4) == "nccl" and registry.choose_dist(4, 3) == "gloo"
    assert registry.choose_dist(2, 8, "cpu") == "gloo" and registry.choose_dist(2, 1, "cuda") == "gloo"
    gpus = registry.visible_gpus()
    process, torchrun = registry.backend_kind("process"), registry.backend_kind("torchrun")
    assert process.dist_for(2) == ("nccl" if gpus >= 2 else "gloo")
    assert torchrun.dist_for(8) == ("nccl" if gpus >= 1 else "gloo")   # one GPU per rank of its host
    assert registry.backend_kind("nccl").default_device(2) == "cuda"
    assert registry.backend_kind("simulated").default_device(2) == "cpu"
    with pytest.raises(BackendError, match="device policy 'gpu'"):
        registry.choose_dist(2, 2, "gpu")


def test_world_and_reporting_come_from_the_kind():
    torchrun, simulated = registry.backend_kind("torchrun"), registry.backend_kind("simulated")
    assert torchrun.world_size({"WORLD_SIZE": "4"}) == 4 and simulated.world_size({"WORLD_SIZE": "4"}) is None
    assert torchrun.reporting({"RANK": "0"}) and not torchrun.reporting({"RANK": "1"})
    assert simulated.reporting({"RANK": "1"})


def test_a_bad_name_is_refused_before_any_work(capsys):
    from shardverify.plan.verify import verify_plan

    class Untouchable(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("the model was run: the backend name was checked too late")

    with pytest.raises(BackendError, match="unknown backend 'mpi'; expected one of"):
        verify_plan(Untouchable(), torch.ones(4, 4), (2,), backend="mpi")
    began = time.perf_counter()
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "specs/plans/mlp.yaml", "--backend", "mpi"])
    assert stopped.value.code == 2 and time.perf_counter() - began < 5
    assert "invalid choice: 'mpi'" in capsys.readouterr().err
    with pytest.raises(BackendError, match="registered already"):
        registry.register(BackendKind("gloo", "again", "shardverify.backends.process:ProcessBackend"))
    with pytest.raises(BackendError, match="world must be"):
        BackendKind("odd", "a world of its own", "m:f", world="cluster")


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The new kind: its module, and its one entry in the registry."""
    (tmp_path / "logging_backend.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    kind = registry.register(BackendKind("logging", "simulated ranks that log each run (a test's kind)",
                                         "logging_backend:LoggingBackend"))
    try:
        yield kind
    finally:
        registry.unregister("logging")
        sys.modules.pop("logging_backend", None)


def test_a_new_kind_is_one_module_plus_its_entry(toy_kind, capsys):
    backend = get_backend("logging", DeviceMesh((2,)))
    try:
        assert type(backend).__name__ == "LoggingBackend"
    finally:
        backend.close()
    assert "logging" in backend_choices("verify") and "logging" in backend_choices("plan")
    assert "logging" not in backend_choices("calibrate")   # threads have no wires to time
    # the CLI verifies a spec on it, and its ranks did the work
    status = main(["verify", "identity", "--backend", "logging", "--mesh", "2", "--root", str(ROOT)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("PASS  ") and "; logging backend; " in out.splitlines()[0]
    assert sys.modules["logging_backend"].RUNS, "the verify ran on another backend"
    registry.unregister("logging")
    with pytest.raises(BackendError, match="unknown backend 'logging'"):
        get_backend("logging", DeviceMesh((2,)))
