"""Tests of the pytest plugin: gating, markers, options, placement, pool lifecycle, timeouts,
and that no worker process outlives a session (after failures and Ctrl-C too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardverify.backends.cpus import can_keep
from shardverify.errors import InvalidArgument
from shardverify.sharding.mesh import DeviceMesh
from shardverify.pytest_plugin.placement import (
    THREAD_VARIABLES,
    NotEnoughDevices,
    ProcessPlan,
    plan_process_backend,
    worker_gpu_slice,
    worker_threads,
)
from shardverify.pytest_plugin.pool import MAX_PROCESS_POOLS, BackendPool, resolve_kind
from shardverify.pytest_plugin.settings import Settings, parse_auto_parallel

pytest_plugins = ["pytester"]

USAGE_ERROR = pytest.ExitCode.USAGE_ERROR
SETTINGS = Settings(auto_parallel=True, backend="simulated", timeout=5.0, device="auto")

GATED = """
import pytest

@pytest.mark.dist
def test_multi_process():
    pass

def test_single_process():
    pass
"""


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Inner runs must not inherit the outer session's flag or xdist identity."""
    for name in ("AUTO_PARALLEL", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                 "PYTEST_ADDOPTS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --------------------------------------------------------------------------- AUTO_PARALLEL

@pytest.mark.parametrize("value", [None, "0"])
def test_dist_tests_skip_with_a_reason_saying_how_to_enable_them(pytester, clean_env, value):
    if value is not None:
        clean_env.setenv("AUTO_PARALLEL", value)
    pytester.makepyfile(GATED)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "shardverify: 1 multi-process (dist) test(s) skipped because AUTO_PARALLEL is not 1; "
        "run them with AUTO_PARALLEL=1 pytest ...",
        "SKIPPED *.py:*: multi-process test (marked dist): run them with AUTO_PARALLEL=1 "
        "pytest ...",
    ])


def test_dist_tests_run_when_auto_parallel_is_1(pytester, clean_env):
    clean_env.setenv("AUTO_PARALLEL", "1")
    pytester.makepyfile(GATED)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)
    assert "skipped because AUTO_PARALLEL" not in result.stdout.str()


@pytest.mark.parametrize("value", ["yes", "", " 1"])
def test_any_other_flag_value_is_a_usage_error_naming_it(pytester, clean_env, value):
    clean_env.setenv("AUTO_PARALLEL", value)
    pytester.makepyfile(GATED)
    result = pytester.runpytest()
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: AUTO_PARALLEL={value!r} is not a valid value*"])


def test_parse_auto_parallel():
    assert parse_auto_parallel(None) is False
    assert parse_auto_parallel("0") is False
    assert parse_auto_parallel("1") is True
    with pytest.raises(pytest.UsageError, match="'on'"):
        parse_auto_parallel("on")


# --------------------------------------------------------------------------- markers, options

def test_markers_are_registered_under_strict_markers(pytester, clean_env):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.dist
        @pytest.mark.slow
        def test_marked():
            pass

        def test_unmarked():
            pass
    """)
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1, skipped=1)
    listing = pytester.runpytest("--markers")
    listing.stdout.fnmatch_lines(["@pytest.mark.dist:*AUTO_PARALLEL=1*", "@pytest.mark.slow:*"])


def test_slow_tests_run_first_each_group_in_its_order(pytester, clean_env):
    """pytest -n hands the first quarter of the tests out in turn: the slow ones first start at
    once on every worker, rather than one starting last and the session ending on it alone."""
    pytester.makepyfile(test_a="""
        def test_quick_one():
            pass

        def test_quick_two():
            pass
    """, test_b="""
        import pytest

        pytestmark = pytest.mark.slow

        def test_slow_one():
            pass

        def test_slow_two():
            pass
    """)
    result = pytester.runpytest("-v")
    names = [line.split("::")[1].split()[0] for line in result.stdout.lines if "::test_" in line and "PASSED" in line]
    assert names == ["test_slow_one", "test_slow_two", "test_quick_one", "test_quick_two"], result.stdout.str()


def test_strict_markers_still_rejects_unknown_markers(pytester, clean_env):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.distt
        def test_typo():
            pass
    """)
    result = pytester.runpytest("--strict-markers")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection error
    result.stdout.fnmatch_lines(["*'distt' not found in `markers`*"])


@pytest.mark.parametrize("args, ini, message", [
    (["--sv-timeout", "0"], "", "--sv-timeout='0' is not a valid timeout*"),
    ([], "sv_timeout = soon", "ini sv_timeout='soon' is not a valid timeout*"),
    ([], "sv_backend = mpi", "ini sv_backend='mpi' is not valid*'simulated', 'process'*"),
    ([], "sv_device = tpu", "ini sv_device='tpu' is not valid*"),
    (["--sv-backend", "process"], "", "--sv-backend='process' starts worker processes*AUTO_PARALLEL=1*"),
])
def test_bad_settings_are_usage_errors(pytester, clean_env, args, ini, message):
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(GATED)
    result = pytester.runpytest(*args)
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_settings_show_in_the_header_command_line_over_ini(pytester, clean_env):
    pytester.makeini("[pytest]\nsv_timeout = 7\nsv_device = cpu\n")
    pytester.makepyfile(GATED)
    result = pytester.runpytest("--sv-timeout", "3")
    result.stdout.fnmatch_lines([
        "shardverify: AUTO_PARALLEL=0 (dist tests skipped), sv_backend=simulated, "
        "sv_timeout=3s, sv_device=cpu"])


def test_plugin_loads_from_a_plain_checkout_conftest_and_never_twice(pytester, clean_env):
    pytester.makeconftest('pytest_plugins = ["shardverify.pytest_plugin"]')
    pytester.makepyfile(GATED)
    # Installed: the entry point registered it first; the conftest line must be a no-op.
    pytester.runpytest("--strict-markers").assert_outcomes(passed=1, skipped=1)
    # Plain checkout: no entry points at all, the conftest alone loads it.
    clean_env.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.runpytest("--strict-markers").assert_outcomes(passed=1, skipped=1)


def test_the_test_session_leaves_what_its_collection_loaded_out_of_the_collector():
    """conftest.py freezes the objects alive once the tests are collected (torch, the test
    modules: hundreds of thousands), so a full collection walks only what the tests made; a plan's
    collection after each capture cost 0.2-0.9 s in a worker before (see backends/gc_policy)."""
    import gc

    assert gc.get_freeze_count() > 100_000


# --------------------------------------------------------------------------- placement

def test_xdist_workers_get_disjoint_equal_gpu_slices():
    slices = [worker_gpu_slice(8, f"gw{k}", "4") for k in range(4)]
    assert slices == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert worker_gpu_slice(8, None, None) == tuple(range(8))
    assert worker_gpu_slice(3, "gw1", "2") == (1,)       # the odd GPU is left unused
    assert worker_gpu_slice(2, "gw3", "4") == ()          # never shared: too few to go round


@pytest.mark.parametrize("worker, count", [("worker1", "2"), ("gw2", "2"), ("gw0", "x")])
def test_bad_xdist_identity_is_rejected(worker, count):
    with pytest.raises(InvalidArgument, match="PYTEST_XDIST_WORKER"):
        worker_gpu_slice(4, worker, count)


def test_thread_share_splits_the_usable_cpus_among_the_processes(monkeypatch):
    from shardverify.backends import cpus

    monkeypatch.setattr(cpus, "usable_cpus", lambda: list(range(8)))
    assert [cpus.thread_share(n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(InvalidArgument, match=f"processes={bad!r}"):
            cpus.thread_share(bad)


def test_xdist_workers_get_their_share_of_the_cpus_unless_the_environment_sets_threads(monkeypatch):
    from shardverify.backends import cpus

    monkeypatch.setattr(cpus, "usable_cpus", lambda: list(range(8)))
    worker = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "4"}
    assert worker_threads(worker) == 2
    assert worker_threads({**worker, "PYTEST_XDIST_WORKER_COUNT": "16"}) == 1
    assert worker_threads({}) is None                  # not an xdist worker: torch's default
    for name in THREAD_VARIABLES:
        assert worker_threads({**worker, name: "3"}) is None
    assert worker_threads({**worker, "OMP_NUM_THREADS": ""}) == 2   # set but empty says nothing
    with pytest.raises(InvalidArgument, match="PYTEST_XDIST_WORKER_COUNT='0'"):
        worker_threads({**worker, "PYTEST_XDIST_WORKER_COUNT": "0"})


def test_pytest_n_gives_each_worker_its_share_of_torch_threads_and_of_the_slow_tests(pytester, clean_env):
    for name in THREAD_VARIABLES:
        clean_env.delenv(name, raising=False)
    # 20 tests marked slow among 160: pytest-xdist's own first block for each of 2 workers is 20
    # contiguous tests, which put every slow one on the first worker
    pytester.makepyfile(test_threads="""
        import os
        import pathlib

        import pytest
        import torch


        def _ran(kind):
            worker = os.environ['PYTEST_XDIST_WORKER']
            with open(f"{kind}_{worker}", "a") as record:
                record.write(f"{torch.get_num_threads()}\\n")


        @pytest.mark.parametrize("n", range(140))
        def test_fast(n):
            _ran("fast")


        @pytest.mark.slow
        @pytest.mark.parametrize("n", range(20))
        def test_slow(n):
            _ran("slow")
    """)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=160)
    from shardverify.backends.cpus import thread_share

    threads = {int(line) for path in pytester.path.glob("*_gw*") for line in path.read_text().split()}
    assert threads == {thread_share(2)}, threads
    slow = {path.name: len(path.read_text().split()) for path in pytester.path.glob("slow_gw*")}
    assert sorted(slow) == ["slow_gw0", "slow_gw1"] and min(slow.values()) >= 5, slow


def test_auto_workers_are_one_per_usable_cpu_unless_xdist_is_told_a_count(monkeypatch):
    from shardverify.pytest_plugin import placement

    monkeypatch.setattr(placement, "usable_cpus", lambda: [0, 3, 5])
    assert placement.auto_workers({}) == 3
    assert placement.auto_workers({"PYTEST_XDIST_AUTO_NUM_WORKERS": "5"}) is None   # xdist reads it
    assert placement.auto_workers({"PYTEST_XDIST_AUTO_NUM_WORKERS": ""}) == 3


@pytest.mark.skipif(not can_keep(), reason="this platform cannot keep a process on chosen CPUs")
def test_pytest_n_auto_starts_one_worker_per_cpu_this_process_may_use(pytester, clean_env):
    for name in THREAD_VARIABLES + ("PYTEST_XDIST_AUTO_NUM_WORKERS",):
        clean_env.delenv(name, raising=False)
    # pytest-xdist's own count asks psutil, where it is installed, for the machine's cores; this
    # stand-in answers 7, so a run that asked it would start 7 workers
    pytester.makepyfile(psutil="def cpu_count(logical=True):\n    return 7\n")
    pytester.makepyfile(test_auto="""
        import os

        import torch


        def test_worker():
            assert os.environ['PYTEST_XDIST_WORKER_COUNT'] == '1'
            assert torch.get_num_threads() == 1
    """)
    kept = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(kept)})     # the run, and the workers it starts, get one CPU
    try:
        result = pytester.runpytest_subprocess("-n", "auto", "-p", "no:cacheprovider", timeout=300)
    finally:
        os.sched_setaffinity(0, kept)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*created: 1/1 worker*"])


def test_process_plan_uses_nccl_only_when_the_slice_fits_the_mesh():
    assert plan_process_backend(4, (4, 5, 6, 7), 8, "auto") == ProcessPlan("nccl", (4, 5, 6, 7))
    assert plan_process_backend(2, (4, 5, 6, 7), 8, "cuda") == ProcessPlan("nccl", (4, 5))
    assert plan_process_backend(4, (0, 1), 8, "auto") == ProcessPlan("gloo", None)
    assert plan_process_backend(4, (0, 1, 2, 3), 4, "cpu") == ProcessPlan("gloo", None)
    with pytest.raises(NotEnoughDevices, match=r"needs 4 GPUs, but this worker has 2 \(of 8 "
                                               r"visible shared among 4 xdist workers\)"):
        plan_process_backend(4, (0, 1), 8, "cuda", workers=4)


def test_resolve_kind():
    assert resolve_kind(None, False, SETTINGS, "t") == "simulated"
    assert resolve_kind(None, True, SETTINGS, "t") == "process"
    assert resolve_kind("simulated", True, SETTINGS, "t") == "simulated"
    with pytest.raises(InvalidArgument, match="kind='gloo'"):
        resolve_kind("gloo", True, SETTINGS, "t")
    with pytest.raises(InvalidArgument, match="test_x asks for the process backend but is not "
                                              "marked @pytest.mark.dist"):
        resolve_kind("process", False, SETTINGS, "test_x")


# --------------------------------------------------------------------------- pool lifecycle

class FakeBackend:
    def __init__(self, kind: str, mesh: DeviceMesh, **options: object) -> None:
        self.kind, self.mesh, self.options, self.closed = kind, mesh, options, 0

    def close(self) -> None:
        self.closed += 1
        if self.options.get("fail_close"):
            raise RuntimeError("close failed")


def test_pool_caches_per_kind_and_shape_and_passes_the_timeout(clean_env):
    pool = BackendPool(SETTINGS, factory=FakeBackend)
    try:
        first = pool.get(DeviceMesh((2, 2)), "simulated")
        assert pool.get(DeviceMesh((2, 2)), "simulated") is first
        assert pool.get(DeviceMesh((4,)), "simulated") is not first
        process = pool.get(DeviceMesh((2, 2)), "process")
        assert process is not first
        assert (process.kind, process.options) == ("gloo", {"timeout": 5.0, "keep_cpus": True})
        assert first.options == {"timeout": 5.0}
    finally:
        pool.close_all()
    assert first.closed == 1 and process.closed == 1


def test_pool_places_process_pools_on_this_workers_gpus(clean_env):
    clean_env.setattr("shardverify.backends.registry.visible_gpus", lambda: 8)
    clean_env.setenv("PYTEST_XDIST_WORKER", "gw1")
    clean_env.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    pool = BackendPool(SETTINGS, factory=FakeBackend)
    try:
        fits = pool.get(DeviceMesh((2,)), "process")
        too_big = pool.get(DeviceMesh((2, 2)), "process")
    finally:
        pool.close_all()
    # other xdist workers' pools share the CPUs, so no pool keeps its workers in place
    assert (fits.kind, fits.options) == ("nccl", {"device_ids": (2, 3), "timeout": 5.0, "keep_cpus": False})
    assert (too_big.kind, too_big.options) == ("gloo", {"timeout": 5.0, "keep_cpus": False})   # documented fallback
    strict = BackendPool(Settings(True, "simulated", 5.0, "cuda"), factory=FakeBackend)
    with pytest.raises(NotEnoughDevices, match="needs 4 GPUs, but this worker has 2"):
        strict.get(DeviceMesh((4,)), "process")
    strict.close_all()


def test_pool_bounds_live_process_pools_closing_the_least_recent(clean_env):
    pool = BackendPool(SETTINGS, factory=FakeBackend)
    shapes = [(n,) for n in range(1, MAX_PROCESS_POOLS + 2)]
    built = [pool.get(DeviceMesh(s), "process") for s in shapes[:-1]]
    pool.get(DeviceMesh(shapes[0]), "process")          # the first is now the most recent
    newest = pool.get(DeviceMesh(shapes[-1]), "process")
    assert [b.closed for b in built] == [0, 1] + [0] * (len(built) - 2)
    pool.close_all()
    assert newest.closed == 1 and built[0].closed == 1


def test_a_process_pool_no_test_held_for_a_while_is_closed_before_the_next_test(clean_env):
    """An idle gloo rank polls (a transport thread per process group wakes every 10 ms): a pool
    no test has held for IDLE_SECONDS is closed as the next test begins, never while a test that
    held it runs, however long; the simulated backend (threads of this process) is kept."""
    from shardverify.pytest_plugin import pool as pool_module

    clock = [1000.0]
    clean_env.setattr(pool_module.time, "monotonic", lambda: clock[0])
    pool = BackendPool(SETTINGS, factory=FakeBackend)
    pool.test_began()
    long_held = pool.get(DeviceMesh((2, 2)), "process")
    simulated = pool.get(DeviceMesh((2, 2)), "simulated")
    clock[0] += 10 * pool_module.IDLE_SECONDS      # a long test: its pool stays its own
    assert pool.get(DeviceMesh((4,)), "process") is not long_held and long_held.closed == 0
    pool.test_ended()
    clock[0] += pool_module.IDLE_SECONDS / 2
    pool.test_began()                                # held until the last test ended: kept
    assert long_held.closed == 0
    assert pool.get(DeviceMesh((4,)), "process").closed == 0
    pool.test_ended()
    clock[0] += pool_module.IDLE_SECONDS / 2 + 1     # (2, 2)'s pool idle for longer than the limit
    pool.test_began()
    assert long_held.closed == 1 and simulated.closed == 0
    again = pool.get(DeviceMesh((2, 2)), "process")
    assert again is not long_held and again.closed == 0
    pool.test_ended()
    pool.close_all()


def test_close_all_closes_everything_even_when_one_close_fails():
    def factory(kind, mesh, **options):
        return FakeBackend(kind, mesh, fail_close=mesh.shape == (2,), **options)

    pool = BackendPool(SETTINGS, factory=factory)
    backends = [pool.get(DeviceMesh(s), "simulated") for s in [(1,), (2,), (3,)]]
    with pytest.raises(RuntimeError, match="close failed"):
        pool.close_all()
    assert [b.closed for b in backends] == [1, 1, 1]
    pool.close_all()                                   # idempotent: nothing left to close
    assert [b.closed for b in backends] == [1, 1, 1]


def test_sv_backend_fixture_caches_for_the_session_and_closes_at_the_end(pytester, clean_env):
    built: list[FakeBackend] = []

    def fake_get_backend(kind, mesh, **options):
        built.append(FakeBackend(kind, mesh, **options))
        return built[-1]

    clean_env.setattr("shardverify.backends.get_backend", fake_get_backend, raising=False)
    clean_env.setenv("AUTO_PARALLEL", "1")
    pytester.makepyfile("""
        import pytest
        seen = []

        @pytest.mark.parametrize("n", [0, 1])
        def test_cached(sv_backend, n):
            seen.append(sv_backend([2, 2]))
            assert seen[-1].kind == "simulated" and seen[-1].mesh.shape == (2, 2)
            assert all(b is seen[-1] for b in seen) and seen[-1].closed == 0

        @pytest.mark.dist
        def test_dist_gets_processes(sv_backend):
            assert sv_backend((2, 2)).kind == "gloo"
            assert sv_backend((2, 2), kind="simulated") is seen[-1]

        def test_bad_shape(sv_backend):
            sv_backend((2, 0))

        def test_bad_kind(sv_backend):
            sv_backend((2,), kind="mpi")

        def test_process_needs_the_dist_marker(sv_backend):
            sv_backend((2,), kind="process")
    """)
    result = pytester.inline_run("--sv-timeout", "9")
    result.assertoutcome(passed=3, failed=3)
    failures = "\n".join(str(r.longrepr) for r in result.getfailures())
    assert "mesh shape must contain positive ints, got (2, 0)" in failures
    assert "kind='mpi': expected one of ('simulated', 'process')" in failures
    assert "test_process_needs_the_dist_marker asks for the process backend" in failures
    assert [(b.kind, b.options) for b in built] == [
        ("simulated", {"timeout": 9.0}), ("gloo", {"timeout": 9.0, "keep_cpus": True})]
    assert [b.closed for b in built] == [1, 1]


def test_sv_backend_gives_a_working_simulated_backend(pytester, clean_env):
    pytester.makepyfile("""
        def spmd_rank(comm):
            return comm.rank, comm.mesh.coordinate(comm.rank)

        def test_ranks(sv_backend):
            assert sv_backend((2, 2)).run(spmd_rank) == [
                (0, (0, 0)), (1, (0, 1)), (2, (1, 0)), (3, (1, 1))]
    """)
    pytester.inline_run().assertoutcome(passed=1)


# --------------------------------------------------------------------------- processes

def _tagged_processes(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries `tag`: every descendant of an
    inner run inherits it, however it was started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if tag.encode() not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def _assert_no_process_left(tag: str) -> None:
    # A leaked worker stays forever; one already killed may take a moment to exit on a
    # loaded machine, so wait a while before calling it a leak.
    deadline = time.monotonic() + 30.0
    while (alive := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for pid in alive:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmdline = "?"
        described.append(f"{pid}: {cmdline[:200]}")
    assert not described, "processes left behind by the session:\n" + "\n".join(described)


needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="the leak check reads /proc (Linux)")

PROCESS_SUITE = """
import os
import time

import pytest

SLACK = 120  # only test_hangs runs under --sv-timeout 2; a loaded CI box can be slow


def spmd_pid(comm):
    return os.getpid()


def spmd_identity(comm):
    return os.getpid(), os.environ.get("SV_LEAK_TAG")


def spmd_hang(comm):
    time.sleep(60)


def spmd_raise_on_rank_1(comm):
    if comm.rank == 1:
        raise ValueError("bad shard on rank one")
    return comm.rank


@pytest.mark.dist
def test_hangs(sv_backend):
    sv_backend((2,)).run(spmd_hang)


@pytest.mark.dist
def test_fails_after_using_workers(sv_backend):
    pids, tags = zip(*sv_backend((2,)).run(spmd_identity, timeout=SLACK))
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert set(tags) == {os.environ["SV_LEAK_TAG"]}   # so the leak scan can see the workers
    with open("worker_pids", "w") as f:
        f.write(" ".join(map(str, pids)))
    assert pids == "deliberately wrong"


@pytest.mark.dist
def test_rank_error(sv_backend):
    sv_backend((2,)).run(spmd_raise_on_rank_1, timeout=SLACK)


@pytest.mark.dist
def test_pool_recovers_after_the_timeout(sv_backend):
    assert len(sv_backend((2,)).run(spmd_pid, timeout=SLACK)) == 2
"""


@needs_proc
@pytest.mark.dist
@pytest.mark.slow
def test_timeout_fails_naming_the_check_and_no_process_outlives_the_session(pytester, clean_env):
    tag = uuid.uuid4().hex
    clean_env.setenv("SV_LEAK_TAG", tag)
    clean_env.setenv("AUTO_PARALLEL", "1")
    pytester.makepyfile(test_suite=PROCESS_SUITE)
    result = pytester.runpytest_subprocess("--sv-timeout", "2", "-p", "no:cacheprovider",
                                           timeout=300)
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines([
        "*shardverify timeout*",
        "check test_suite.py::test_hangs timed out: *did not finish within 2s while running "
        "spmd_hang",
        "*shardverify rank 1 traceback*",
        "*in spmd_raise_on_rank_1*",
        "ValueError: bad shard on rank one",
    ])
    result.stdout.fnmatch_lines(["FAILED test_suite.py::test_hangs - *RankTimeout*",
                                 "FAILED test_suite.py::test_fails_after_using_workers - *",
                                 "FAILED test_suite.py::test_rank_error - *RankError: rank 1*"])
    assert "def _collect" not in result.stdout.str()   # the pool's relay frames are hidden
    worker_pids = [int(p) for p in (pytester.path / "worker_pids").read_text().split()]
    assert len(worker_pids) == 2
    _assert_no_process_left(tag)


CTRL_C_SUITE = """
import os
import pathlib
import time

import pytest


def spmd_signal_then_hang(comm, folder):
    # written beside the folder, then moved in whole: the test reads a signal as soon as it appears
    written = pathlib.Path(folder).parent / f"rank{comm.rank}.written"
    written.write_text(os.environ.get("SV_LEAK_TAG", "no tag"))
    os.replace(written, pathlib.Path(folder, f"rank{comm.rank}"))
    time.sleep(60)


@pytest.mark.dist
def test_interrupted(sv_backend):
    sv_backend((2,)).run(spmd_signal_then_hang, FOLDER, timeout=120)
"""


def _terminal_sigint() -> None:
    """Give the inner run the SIGINT handling a terminal gives its programs. A shell that
    starts this test run in the background (`cmd &` without job control) ignores SIGINT, the
    children inherit that, and Python then never turns Ctrl-C into KeyboardInterrupt."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@needs_proc
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("sig, status, said", [(signal.SIGINT, 130, "KeyboardInterrupt"),
                                               (signal.SIGTERM, 143, "stopped by SIGTERM; exit 143")],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_a_check_leaves_no_process_behind(pytester, clean_env, sig, status, said):
    """Ctrl-C or SIGTERM mid-check: the session's teardown closes the pool, the run exits with
    128 + the signal and no traceback (SIGTERM raised SystemExit in pytest's main loop: an
    INTERNALERROR with a traceback, exit 3)."""
    tag = uuid.uuid4().hex
    clean_env.setenv("SV_LEAK_TAG", tag)
    ready = pytester.mkdir("ready")
    pytester.makepyfile(test_suite=f"FOLDER = {str(ready)!r}\n{CTRL_C_SUITE}")
    env = {**os.environ, "AUTO_PARALLEL": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                             "test_suite.py"], cwd=pytester.path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_terminal_sigint)
    try:
        deadline = time.monotonic() + 240
        while len(list(ready.iterdir())) < 2:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "workers never started the check"
            time.sleep(0.1)
        proc.send_signal(sig)
        output = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, output    # 128 + the signal, as a shell reports it (pytest's own: 2)
    assert {f.read_text() for f in ready.iterdir()} == {tag}   # the workers carry the tag
    assert said in output and "Traceback" not in output and "INTERNALERROR" not in output, output
    _assert_no_process_left(tag)
