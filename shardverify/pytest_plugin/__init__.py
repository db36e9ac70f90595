"""pytest integration: markers, AUTO_PARALLEL gating, options, and the `sv_backend` fixture.

Why a plugin rather than conftest code: generated tests, the harness's own tests and users'
suites must all obey the same rules -- multi-process tests run only when asked for
(AUTO_PARALLEL=1), a hung collective fails one test instead of blocking CI, every worker
process is gone when the session ends, and `pytest -n auto` starts a worker per CPU, never
shares a port or a GPU, nor runs more torch threads than the workers have CPUs.

Loaded through the `pytest11` entry point when shardverify is installed, and by the
repository's top-level conftest.py from a plain checkout (same plugin name, so never twice).
This module holds the hooks and fixtures; ``settings`` reads the options, ``placement`` puts
process pools on GPUs or CPUs per xdist worker, ``pool`` caches and closes the backends.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from shardverify.errors import BackendError, RankError, RankTimeout
from shardverify.pytest_plugin.placement import NotEnoughDevices, auto_workers, worker_threads
from shardverify.pytest_plugin.pool import BackendPool, resolve_kind
from shardverify.pytest_plugin.settings import (BACKEND_KINDS, DEFAULT_BACKEND, DEFAULT_DEVICE, DEFAULT_TIMEOUT,
                                                DEVICE_POLICIES, ENABLE_HINT, ENV_FLAG, SKIP_REASON, Settings,
                                                resolve_settings)
from shardverify.sharding.mesh import DeviceMesh

if TYPE_CHECKING:
    from shardverify.backends.base import Backend

_DIST_SKIPPED = "shardverify_dist_skipped"


# --------------------------------------------------------------------------- hooks

_SETTINGS = pytest.StashKey[Settings]()
_POOL = pytest.StashKey[BackendPool]()
_STOPPED: list[int] = []   # the exit status of a session stopped by SIGTERM (143) or Ctrl-C (130)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardverify", "shardverify sharding verification")
    group.addoption("--sv-backend", dest="sv_backend", default=None, choices=BACKEND_KINDS,
                    help=f"backend for tests not marked dist (default {DEFAULT_BACKEND}); "
                         "dist tests always use processes")
    group.addoption("--sv-timeout", dest="sv_timeout", default=None, metavar="SECONDS",
                    help=f"seconds one check may run before it fails (default {DEFAULT_TIMEOUT:g})")
    group.addoption("--sv-device", dest="sv_device", default=None, choices=DEVICE_POLICIES,
                    help="process backend placement: auto = NCCL when this xdist worker's GPU "
                         "share fits the mesh, else gloo on CPU; cpu = always gloo; cuda = NCCL "
                         "or skip (default auto)")
    parser.addini("sv_backend", f"default of --sv-backend ({DEFAULT_BACKEND})", default="")
    parser.addini("sv_timeout", f"default of --sv-timeout ({DEFAULT_TIMEOUT:g})", default="")
    parser.addini("sv_device", f"default of --sv-device ({DEFAULT_DEVICE})", default="")


#: tests pytest-xdist hands a worker at a time. Its load scheduling otherwise starts each worker
#: on one contiguous quarter of its share and refills in blocks as large: with 8,050 tests on 4
#: workers the first worker's block of 503 held every test marked slow, and it ran 1,700 s while
#: the others were done after 1,070 s. A few at a time, a worker takes the next tests as it frees.
SCHEDULE_CHUNK = 8


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``pytest -n auto``: one worker per CPU this process may use (:func:`auto_workers`), before
    pytest-xdist's own count, which takes psutil's count of the machine's cores where psutil is
    installed, whatever CPUs this process may use. None leaves the count to pytest-xdist: for
    ``-n logical``, or where its own PYTEST_XDIST_AUTO_NUM_WORKERS sets it."""
    if config.option.numprocesses == "logical":
        return None
    return auto_workers(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"dist: needs real process groups (worker processes); skipped unless "
                   f"{ENV_FLAG}=1")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    # Registered by pytest-xdist too; repeated here so --strict-markers holds without xdist.
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")
    config.stash[_SETTINGS] = resolve_settings(config)
    if getattr(config.option, "maxschedchunk", False) is None:   # pytest -n, no --maxschedchunk given
        config.option.maxschedchunk = SCHEDULE_CHUNK
    # SIGTERM to the run (a CI timeout, `kill` of pytest -n auto's group) ends each process as an
    # interrupt: the session's teardown runs, its pools close and their folders go
    # (backends/signals.py), and the run exits 143 (Ctrl-C: 130; pytest_sessionfinish below)
    from shardverify.backends.signals import interrupt_on_sigterm, keep_interrupts

    interrupt_on_sigterm()
    _STOPPED.clear()
    keep_interrupts()   # an interrupt raised in a finalizer is raised again, not lost
    threads = worker_threads()
    if threads is not None:
        import torch  # an xdist worker runs tests that import it anyway

        # n workers on fewer cores, each with torch's default of a thread per core, make every
        # OpenMP team wait on members whose core another worker holds
        torch.set_num_threads(threads)
    if config.getoption("hypothesis_profile", None) is None:
        from shardverify.features.explore import load_profile

        load_profile()   # $SV_HYPOTHESIS_PROFILE, default "ci": bounded, derandomized, no deadline
    config.pluginmanager.register(_SkipSummary(), "shardverify-skip-summary")
    _session_verdict_cache(config)
    _session_plans(config)


_VERDICTS = pytest.StashKey[str]()
_PLANS = pytest.StashKey[str]()


def _session_verdict_cache(config: pytest.Config) -> None:
    """Calls verified on demand keep their verdicts in a folder of this session's own, shared by
    its xdist workers (they inherit the variable) and removed at its end, unless
    $SHARDVERIFY_CACHE_DIR names one: a test run neither reads nor fills a user's cache."""
    from shardverify.verify.on_demand import CACHE_ENV

    if os.environ.get(CACHE_ENV) or hasattr(config, "workerinput"):
        return
    import tempfile

    config.stash[_VERDICTS] = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="shardverify-verdicts-")


def _session_plans(config: pytest.Config) -> None:
    """The folder where the session's plans are made once and shared by its xdist workers
    (:mod:`shardverify.pytest_plugin.made_plans`), removed at its end."""
    from shardverify.pytest_plugin.made_plans import PLANS_ENV

    if hasattr(config, "workerinput"):
        return
    import tempfile

    config.stash[_PLANS] = os.environ[PLANS_ENV] = tempfile.mkdtemp(prefix="shardverify-plans-")


def pytest_report_header(config: pytest.Config) -> str:
    s = config.stash[_SETTINGS]
    dist = "dist tests run" if s.auto_parallel else "dist tests skipped"
    return (f"shardverify: {ENV_FLAG}={int(s.auto_parallel)} ({dist}), "
            f"sv_backend={s.backend}, sv_timeout={s.timeout:g}s, sv_device={s.device}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the tests marked slow first, each group in its own order: handed out a few at a time
    # (SCHEDULE_CHUNK), the long ones start at once on every worker instead of one of them
    # starting last and the session ending on it alone (the suite's 4-minute no-orphans test,
    # collected late, ran alone at the end of every run)
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slow") is None)
    if config.stash[_SETTINGS].auto_parallel:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("dist") is not None:
            item.add_marker(skip)


_BACKENDS_DIR = Path(__file__).resolve().parent.parent / "backends"


def _without_backend_frames(excinfo: pytest.ExceptionInfo) -> pytest.ExceptionInfo:
    """A failed rank is explained by its message (and the rank's own traceback, added as a
    report section); the frames of the pool machinery that relayed it only bury that.
    pytest re-walks the raw traceback when it cuts it, so the chain itself is rebuilt."""
    kept = []
    tb = excinfo.tb
    while tb is not None:
        if _BACKENDS_DIR not in Path(tb.tb_frame.f_code.co_filename).resolve().parents:
            kept.append(tb)
        tb = tb.tb_next
    if not kept:
        return excinfo
    chain = None
    for tb in reversed(kept):
        chain = types.TracebackType(chain, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return pytest.ExceptionInfo.from_exc_info((excinfo.type, excinfo.value, chain))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    if (call.excinfo is not None and isinstance(call.excinfo.value, BackendError)
            and not item.config.getoption("fulltrace", False)):
        call.excinfo = _without_backend_frames(call.excinfo)
    report = yield
    settings = item.config.stash[_SETTINGS]
    if (report.skipped and call.when == "setup" and not settings.auto_parallel
            and item.get_closest_marker("dist") is not None):
        report.user_properties.append((_DIST_SKIPPED, True))  # travels back from xdist workers
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, RankTimeout):
        report.sections.append((
            "shardverify timeout",
            f"check {item.nodeid} timed out: {exc}\n"
            f"a hang or deadlock in a collective, or a check slower than sv_timeout="
            f"{settings.timeout:g}s (raise it with --sv-timeout SECONDS if the check is just slow)"))
    elif isinstance(exc, RankError) and exc.traceback_text:
        report.sections.append((f"shardverify rank {exc.rank} traceback", exc.traceback_text))
    elif isinstance(exc, BackendError):
        report.sections.append(("shardverify backend", f"check {item.nodeid}: {exc}"))
    return report


class _SkipSummary:
    """Counts dist tests skipped for want of AUTO_PARALLEL=1 (also those reported by xdist
    workers) and says so at the end of the run, so such skips never go unnoticed."""

    def __init__(self) -> None:
        self.nodeids: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if any(prop[0] == _DIST_SKIPPED for prop in report.user_properties):
            self.nodeids.append(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.nodeids:
            terminalreporter.write_line(
                f"shardverify: {len(self.nodeids)} multi-process (dist) test(s) skipped because "
                f"{ENV_FLAG} is not 1; {ENABLE_HINT}", yellow=True)


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo) -> None:
    from shardverify.backends.signals import Terminated   # not pytest's Interrupted (collection errors)

    _STOPPED.extend([143] if excinfo.errisinstance(Terminated) else [130] if excinfo.type is KeyboardInterrupt else [])


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    pool = session.config.stash.get(_POOL, None)
    if pool is not None:
        pool.close_all()
    if _STOPPED:
        _remove_multiprocessing_folder()
    if _STOPPED and session.exitstatus == pytest.ExitCode.INTERRUPTED:
        session.exitstatus = _STOPPED[-1]   # stopped by SIGTERM or Ctrl-C: 128 + the signal, as the shell says
    _STOPPED.clear()


def _remove_multiprocessing_folder() -> None:
    """A stopped session's ``pymp-*`` folder, removed as soon as its pools are closed, not at exit: a
    pytest-xdist worker stopped with its controller (a group SIGTERM) may be killed by the controller
    before its exit handlers run, and the pool workers that would remove it after it are gone."""
    from multiprocessing import util

    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:
            finalizer()     # multiprocessing's own removal, run now and once (it unregisters itself)


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(_POOL, None)
    if pool is not None:
        pool.close_all()
    folder = config.stash.get(_VERDICTS, None)
    if folder is not None:
        import shutil

        from shardverify.verify.on_demand import CACHE_ENV

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(CACHE_ENV, None)
    plans = config.stash.get(_PLANS, None)
    if plans is not None:
        import shutil

        from shardverify.pytest_plugin.made_plans import PLANS_ENV

        shutil.rmtree(plans, ignore_errors=True)
        os.environ.pop(PLANS_ENV, None)


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def sv_backend_pool(pytestconfig: pytest.Config) -> Iterator[BackendPool]:
    """This worker's backends, cached per (kind, mesh shape), closed at session end."""
    pool = pytestconfig.stash.get(_POOL, None)
    if pool is None:
        pool = pytestconfig.stash[_POOL] = BackendPool(pytestconfig.stash[_SETTINGS])
    yield pool
    pool.close_all()


@pytest.fixture
def sv_backend(request: pytest.FixtureRequest,
               sv_backend_pool: BackendPool) -> Iterator[Callable[..., Backend]]:
    """`sv_backend(mesh_shape, kind=None) -> Backend`: a cached backend for this mesh.

    kind None means processes for a test marked dist, else --sv-backend (default simulated).
    The factory is per test (it needs the test's markers); the backends behind it are kept for
    later tests, but a process pool no test has held for ``pool.IDLE_SECONDS`` is closed before
    the next test begins. The backend's default per-check timeout is --sv-timeout."""
    is_dist = request.node.get_closest_marker("dist") is not None
    settings = sv_backend_pool.settings

    def factory(mesh_shape: Sequence[int], kind: str | None = None) -> Backend:
        __tracebackhide__ = True
        mesh = DeviceMesh(mesh_shape)  # validates the shape, naming the bad value
        resolved = resolve_kind(kind, is_dist, settings, request.node.nodeid)
        try:
            return sv_backend_pool.get(mesh, resolved)
        except NotEnoughDevices as exc:
            pytest.skip(str(exc))

    sv_backend_pool.test_began()   # pools idle too long are closed between tests, never during one
    yield factory
    sv_backend_pool.test_ended()


@pytest.fixture
def parallel_plan(sv_backend_pool: BackendPool) -> Callable[..., object]:
    """`parallel_plan(model, plan, mesh=(2,), **options)`: "my plan equals the single device" as one
    test. Runs :func:`shardverify.features.parallelize.check_parallelize` and fails the test with the verdict,
    the first culprit and the values outside their budget unless the run is right; returns the
    result. In-process runs always run; a run on gloo processes (a 2-D mesh, ``backend="gloo"``)
    only with AUTO_PARALLEL=1, as multi-process tests do."""
    from shardverify.features.parallelize import check_parallelize
    from shardverify.features.parallelize.report import render

    def check(model, plan, mesh: Sequence[int] = (2,), **options):
        __tracebackhide__ = True
        processes = options.get("backend") == "gloo" or (len(tuple(mesh)) > 1 and options.get("backend") != "local")
        if processes and not sv_backend_pool.settings.auto_parallel:
            pytest.skip(SKIP_REASON)
        result = check_parallelize(model, plan, tuple(mesh), **options)
        if not result.passed:
            pytest.fail(render(result), pytrace=False)
        return result

    return check
