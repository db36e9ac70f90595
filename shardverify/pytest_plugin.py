"""pytest integration: markers, AUTO_PARALLEL gating, options, and the `sv_backend` fixture.

Why a plugin rather than conftest code: generated tests, the harness's own tests and users'
suites must all obey the same rules -- multi-process tests run only when asked for
(AUTO_PARALLEL=1), a hung collective fails one test instead of blocking CI, every worker
process is gone when the session ends, and `pytest -n 4` never shares a port or a GPU, nor
runs more torch threads than the workers have CPUs.

Loaded through the `pytest11` entry point when shardverify is installed, and by the
repository's top-level conftest.py from a plain checkout (same plugin name, so never twice).
"""

from __future__ import annotations

import atexit
import math
import os
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from shardverify.backends import registry
from shardverify.backends.cpus import thread_share
from shardverify.errors import BackendError, InvalidArgument, RankError, RankTimeout
from shardverify.sharding.mesh import DeviceMesh

if TYPE_CHECKING:
    from shardverify.backends.base import Backend

ENV_FLAG = "AUTO_PARALLEL"
#: the kinds a test may get: threads, or a pool the plugin places by --sv-device (backends/registry.py)
BACKEND_KINDS = registry.backend_names(registry.placed_by_policy)
DEVICE_POLICIES = registry.DEVICE_POLICIES
DEFAULT_BACKEND = registry.DEFAULT_KIND
DEFAULT_TIMEOUT = 60.0
DEFAULT_DEVICE = "auto"
# Process pools kept alive per xdist worker; the least recently used is closed beyond this,
# so a suite touching many mesh shapes holds a bounded number of processes (one per rank,
# about 70 MB each). The shipped specs use six shapes ((4,), (2, 2), (2, 3), (2, 2, 2), (1, 4),
# (2,)): with four, the process tests restarted 56 pools (3-5 s each, 4 min 51 s wall); with
# six, 23 (4 min 7 s), at a peak of 8.8 GB used on the 24 GB machine with four workers.
MAX_PROCESS_POOLS = 6

ENABLE_HINT = f"run them with {ENV_FLAG}=1 pytest ..."
SKIP_REASON = f"multi-process test (marked dist): {ENABLE_HINT}"
_DIST_SKIPPED = "shardverify_dist_skipped"


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class Settings:
    """The plugin's resolved configuration (command line over ini over defaults)."""

    auto_parallel: bool
    backend: str        # default kind for tests not marked dist: "simulated" | "process"
    timeout: float      # seconds per check (one backend.run)
    device: str         # process backend placement: "auto" | "cpu" | "cuda"


def parse_auto_parallel(value: str | None) -> bool:
    """AUTO_PARALLEL: unset or "0" skips dist tests, "1" runs them; anything else is a typo
    that would otherwise skip silently, so it is rejected."""
    if value is None or value == "0":
        return False
    if value == "1":
        return True
    raise pytest.UsageError(
        f"{ENV_FLAG}={value!r} is not a valid value: expected it unset, '0' (skip multi-process "
        f"tests) or '1' (run them), e.g. {ENV_FLAG}=1 pytest -n 4")


def parse_timeout(value: object, source: str) -> float:
    """A positive, finite number of seconds."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise pytest.UsageError(f"{source}={value!r} is not a valid timeout: expected a positive "
                                f"number of seconds, e.g. 60")
    return seconds


def parse_choice(value: str, choices: Sequence[str], source: str) -> str:
    if value not in choices:
        raise pytest.UsageError(f"{source}={value!r} is not valid: expected one of "
                                f"{', '.join(repr(c) for c in choices)}")
    return value


def resolve_settings(config: pytest.Config, environ: Mapping[str, str] = os.environ) -> Settings:
    """Read and validate every setting once, at startup, so mistakes stop the run."""
    def pick(option: str, ini: str) -> tuple[object, str]:
        value = config.getoption(option)
        if value is not None:
            return value, "--" + option.replace("_", "-")
        return config.getini(ini) or None, f"ini {ini}"

    backend, backend_src = pick("sv_backend", "sv_backend")
    backend = parse_choice(str(backend), BACKEND_KINDS, backend_src) if backend else DEFAULT_BACKEND
    device, src = pick("sv_device", "sv_device")
    device = parse_choice(str(device), DEVICE_POLICIES, src) if device else DEFAULT_DEVICE
    timeout, src = pick("sv_timeout", "sv_timeout")
    timeout = parse_timeout(timeout, src) if timeout is not None else DEFAULT_TIMEOUT
    settings = Settings(parse_auto_parallel(environ.get(ENV_FLAG)), backend, timeout, device)
    if registry.backend_kind(settings.backend).processes and not settings.auto_parallel:
        raise pytest.UsageError(f"{backend_src}={settings.backend!r} starts worker processes, which "
                                f"{ENV_FLAG}=1 must allow: {ENV_FLAG}=1 pytest --sv-backend process")
    return settings


# --------------------------------------------------------------------------- GPU placement

@dataclass(frozen=True)
class ProcessPlan:
    """Where a process pool runs: gloo on CPU, or NCCL on these (logical) CUDA devices."""

    backend: str                          # "gloo" | "nccl"
    device_ids: tuple[int, ...] | None    # one GPU per rank for nccl; None on CPU


class NotEnoughDevices(InvalidArgument):
    """--sv-device cuda asked for GPUs this xdist worker does not have (the test skips)."""


def worker_gpu_slice(device_count: int, worker: str | None,
                     worker_count: str | None) -> tuple[int, ...]:
    """The GPUs owned by this xdist worker: worker k of n gets the k-th of n disjoint, equal
    slices, so no two workers' pools ever share a device. Outside xdist: every GPU."""
    if device_count < 0:
        raise InvalidArgument(f"device_count={device_count!r} must be >= 0")
    identity = xdist_identity(worker, worker_count)
    if identity is None:
        return tuple(range(device_count))
    index, count = identity
    per_worker = device_count // count
    return tuple(range(index * per_worker, (index + 1) * per_worker))


def xdist_identity(worker: str | None, worker_count: str | None) -> tuple[int, int] | None:
    """(k, n) for xdist worker 'gw<k>' of n, from PYTEST_XDIST_WORKER and
    PYTEST_XDIST_WORKER_COUNT; None outside xdist."""
    if not worker:
        return None
    if not worker.startswith("gw") or not worker[2:].isdigit():
        raise InvalidArgument(f"PYTEST_XDIST_WORKER={worker!r}: expected 'gw<k>', e.g. 'gw0'")
    if not (worker_count or "").isdigit() or int(worker_count) < 1:  # type: ignore[arg-type]
        raise InvalidArgument(f"PYTEST_XDIST_WORKER_COUNT={worker_count!r}: expected a positive "
                              f"integer alongside PYTEST_XDIST_WORKER={worker!r}")
    index, count = int(worker[2:]), int(worker_count)  # type: ignore[arg-type]
    if index >= count:
        raise InvalidArgument(f"PYTEST_XDIST_WORKER={worker!r} is outside "
                              f"PYTEST_XDIST_WORKER_COUNT={count}")
    return index, count


#: where a user sets the intra-op thread count themselves; the plugin then leaves it alone
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """torch's intra-op threads for this xdist worker: its share of the CPUs among the
    workers (see shardverify.backends.cpus.thread_share). None outside xdist, or where the
    environment sets a thread count (THREAD_VARIABLES): the user's choice stands."""
    identity = xdist_identity(environ.get("PYTEST_XDIST_WORKER"), environ.get("PYTEST_XDIST_WORKER_COUNT"))
    if identity is None or any(environ.get(name) for name in THREAD_VARIABLES):
        return None
    return thread_share(identity[1])


def plan_process_backend(mesh_size: int, gpus: tuple[int, ...], device_count: int,
                         policy: str, workers: int = 1) -> ProcessPlan:
    """NCCL when this worker's GPU slice has one GPU per rank; otherwise gloo on CPU
    ("auto"), or NotEnoughDevices ("cuda"). "cpu" always uses gloo."""
    parse_choice(policy, DEVICE_POLICIES, "sv_device")
    if registry.choose_dist(mesh_size, len(gpus), policy) == "nccl":
        return ProcessPlan("nccl", tuple(gpus[:mesh_size]))
    if policy == "cuda":
        among = f" shared among {workers} xdist workers" if workers > 1 else ""
        raise NotEnoughDevices(
            f"a mesh of {mesh_size} ranks needs {mesh_size} GPUs, but this worker has "
            f"{len(gpus)} (of {device_count} visible{among}); use fewer xdist workers or "
            f"--sv-device auto to fall back to gloo on CPU")
    return ProcessPlan("gloo", None)


# --------------------------------------------------------------------------- backend pool

class BackendPool:
    """The backends of one pytest process (one xdist worker), cached per (kind, mesh shape)
    and all closed at session end -- by the session fixture, the session-finish hook, and
    atexit as a last resort (Ctrl-C, internal errors)."""

    def __init__(self, settings: Settings,
                 factory: Callable[..., Backend] | None = None) -> None:
        self.settings = settings
        self._factory = factory
        self._backends: OrderedDict[tuple[str, tuple[int, ...]], Backend] = OrderedDict()
        atexit.register(self.close_all)

    def get(self, mesh: DeviceMesh, kind: str) -> Backend:
        """The cached backend of this kind for `mesh.shape`, built on first use."""
        __tracebackhide__ = True
        key = (kind, mesh.shape)
        if key in self._backends:
            self._backends.move_to_end(key)
            return self._backends[key]
        backend = self._build(mesh, kind)
        self._backends[key] = backend
        if registry.backend_kind(kind).processes:
            self._evict_process_pools()
        return backend

    def _build(self, mesh: DeviceMesh, kind: str) -> Backend:
        build = self._factory
        if build is None:
            from shardverify.backends import get_backend as build
        timeout = self.settings.timeout
        if not registry.backend_kind(kind).processes:   # threads of this process
            return build(kind, mesh, timeout=timeout)
        count = registry.visible_gpus() if self.settings.device != "cpu" else 0
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
        gpus = worker_gpu_slice(count, worker, workers)
        plan = plan_process_backend(mesh.size, gpus, count, self.settings.device,
                                    int(workers) if worker else 1)
        # other xdist workers' pools share the CPUs: the OS must be free to balance them all
        keep_cpus = not worker or int(workers) == 1
        if plan.backend == "nccl":
            return build("nccl", mesh, device_ids=plan.device_ids, timeout=timeout, keep_cpus=keep_cpus)
        return build("gloo", mesh, timeout=timeout, keep_cpus=keep_cpus)

    def _evict_process_pools(self) -> None:
        process_keys = [k for k in self._backends if registry.backend_kind(k[0]).processes]
        for key in process_keys[:-MAX_PROCESS_POOLS]:
            self._backends.pop(key).close()

    def close_all(self) -> None:
        """Close every backend; idempotent, and one failing close does not stop the rest."""
        errors = []
        while self._backends:
            _, backend = self._backends.popitem()
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001 -- report after closing the others
                errors.append(exc)
        atexit.unregister(self.close_all)
        if errors:
            raise errors[0]


def resolve_kind(kind: str | None, is_dist: bool, settings: Settings, nodeid: str) -> str:
    """dist tests always get processes; other tests the --sv-backend default, and may ask
    for "process" explicitly only if they are marked dist (so AUTO_PARALLEL gates them)."""
    if kind is None:
        return "process" if is_dist else settings.backend
    if kind not in BACKEND_KINDS:
        raise InvalidArgument(f"kind={kind!r}: expected one of {BACKEND_KINDS} or None "
                              f"(the --sv-backend default, {settings.backend!r})")
    if registry.backend_kind(kind).processes and not is_dist and settings.backend != kind:
        raise InvalidArgument(f"{nodeid} asks for the {kind} backend but is not marked "
                              f"@pytest.mark.dist; mark it so that {ENV_FLAG} gates it")
    return kind


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"dist: needs real process groups (worker processes); skipped unless "
                   f"{ENV_FLAG}=1")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    # Registered by pytest-xdist too; repeated here so --strict-markers holds without xdist.
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")
    config.stash[_SETTINGS] = resolve_settings(config)
    # SIGTERM to the run (a CI timeout, `kill` of pytest -n 4's group) ends each process as an
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
        from shardverify.explore import load_profile

        load_profile()   # $SV_HYPOTHESIS_PROFILE, default "ci": bounded, derandomized, no deadline
    config.pluginmanager.register(_SkipSummary(), "shardverify-skip-summary")
    _session_verdict_cache(config)


_VERDICTS = pytest.StashKey[str]()


def _session_verdict_cache(config: pytest.Config) -> None:
    """Calls verified on demand keep their verdicts in a folder of this session's own, shared by
    its xdist workers (they inherit the variable) and removed at its end, unless
    $SHARDVERIFY_CACHE_DIR names one: a test run neither reads nor fills a user's cache."""
    from shardverify.verify.on_demand import CACHE_ENV

    if os.environ.get(CACHE_ENV) or hasattr(config, "workerinput"):
        return
    import tempfile

    config.stash[_VERDICTS] = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="shardverify-verdicts-")


def pytest_report_header(config: pytest.Config) -> str:
    s = config.stash[_SETTINGS]
    dist = "dist tests run" if s.auto_parallel else "dist tests skipped"
    return (f"shardverify: {ENV_FLAG}={int(s.auto_parallel)} ({dist}), "
            f"sv_backend={s.backend}, sv_timeout={s.timeout:g}s, sv_device={s.device}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.stash[_SETTINGS].auto_parallel:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("dist") is not None:
            item.add_marker(skip)


_BACKENDS_DIR = Path(__file__).resolve().parent / "backends"


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
    if _STOPPED and session.exitstatus == pytest.ExitCode.INTERRUPTED:
        session.exitstatus = _STOPPED[-1]   # stopped by SIGTERM or Ctrl-C: 128 + the signal, as the shell says
    _STOPPED.clear()


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
               sv_backend_pool: BackendPool) -> Callable[..., Backend]:
    """`sv_backend(mesh_shape, kind=None) -> Backend`: a cached backend for this mesh.

    kind None means processes for a test marked dist, else --sv-backend (default simulated).
    The factory is per test (it needs the test's markers); the backends behind it live for the
    session. The backend's default per-check timeout is --sv-timeout."""
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

    return factory
