"""A case's checks run in a child process, where the op's kernel may end the process it runs in.

A wrong layout hands a kernel local shapes that no single-device call pairs. Most kernels check
their arguments and raise, which is a verdict like any other; a few CPU kernels do not and write
or read out of bounds: ``_adaptive_avg_pool2d_backward`` and ``avg_pool2d_backward`` given a
``grad_output`` whose shape does not match ``self``'s (glibc's heap check aborts the process:
SIGABRT, or SIGSEGV), ``max_pool2d_with_indices_backward`` given indices into a plane it holds
part of, ``_pdist_backward`` on an input without rows (SIGFPE). Run in the checking process, such
a strategy ends it, and every verdict of the run with it. A crash is a verdict: here the case's
strategies are checked together in one child process, and when that child dies each strategy is
checked again alone in a child of its own; a strategy whose own child dies fails with a mismatch
naming the signal, every other one keeps the result its own child gave.

Which cases run here (:func:`needs_isolation`), on the in-process simulated backend only (the
process backend's ranks are processes already: a rank that dies is reported as its error):

- the spec says so: ``verify: isolate: true`` (OpCase's and CallCase's ``isolate``);
- the op has been seen to die of a kernel's signal in this process: in a child here, or as a
  rank of a process backend (:func:`remember_deaths`). Remembered until the process ends.

What cannot be isolated: an op neither flagged nor remembered is checked in the checking
process itself, and when its kernel crashes there nothing is left to see it or say so. That is
what the flag and the memory are for. (The memory is not kept on disk: a process sees a death
only in a child, here or a process backend's rank, and an op seen dying is one to flag in its spec.)

The child is started by multiprocessing's forkserver (the caller may hold threads, which a
plain fork would copy in whatever state they were), with torch and the engine preloaded; the
case, the strategies and the backend's settings travel pickled (an fx graph with its nodes'
metadata, ATen overloads by name), the results come back as they are. A child's results equal
the in-process check's in everything but the seconds. A rank that waits in a collective in a child
is given up after the backend's timeout, as in process; a child that makes no reply at all (a
kernel deadlocked on memory it corrupted) is killed after a generous hang guard, its check failed
naming the hang, and the op is not run again in this process.
A child that ends with no signal failed to run at all (it could not start or import): that is an
error (ShardVerifyError), not a verdict.

A script that verifies calls on demand guards its top level with ``if __name__ == "__main__":``,
as multiprocessing asks of every program that starts processes this way (the process backend's
too): the child imports the caller's main module.

Cost, measured on adaptive_avg_pool2d_backward's grid on mesh (4,) (3 strategies, 2 shared
CPUs): the forkserver's start, once per process, about 2 s (more on a loaded machine: it
imports torch); then about 70 ms a case isolated against 2 ms in process once the process has
checked the case before (0.8 s the first time: tracing, the reference, torch's warm-up; a child
rebuilds the case every time, but from a forkserver that is warm already). After a death, one
child per strategy: the 3 strategies and a crashing one took 0.33 s.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import fx

from shardverify.backends.process import FORKSERVER_PRELOAD
from shardverify.backends.signals import signals_held, start_forkserver
from shardverify.backends.simulated import SimulatedBackend
from shardverify.errors import BackendError, RankDied, ShardVerifyError
from shardverify.sharding.strategy import ShardingStrategy
from shardverify.verify.report import CheckResult, Mismatch

__all__ = ["KERNEL_SIGNALS", "needs_isolation", "remember_crash", "remember_deaths", "crashed_ops",
           "verify_isolated", "run_isolated", "isolates"]

#: the signals a kernel raises on itself (a bad access, a failed heap check, a division by zero):
#: a death by SIGKILL or SIGTERM came from outside (the OOM killer, a stop) and says nothing of the op
KERNEL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT,
                            signal.SIGTRAP})
#: what the forkserver imports once, so no child imports it again
PRELOAD = (*FORKSERVER_PRELOAD, __name__)
#: how long a child whose pipe has closed may take to report its exit status through the forkserver
REAP_SECONDS = 10.0
#: hang guards, generous: a child that makes no reply in this long is killed and said to hang (a
#: kernel that corrupted memory can deadlock its threads instead of crashing): a case's check, and
#: one call run on the data drawn for it
CHECK_SECONDS = 600.0
CALL_SECONDS = 120.0
#: the variable the engine appends its check counts to: the parent counts a child's checks
CHECK_LOG_ENV = "SHARDVERIFY_CHECK_LOG"

_crashed: set[str] = set()   # ops seen to die of a kernel's signal in this process
_hung: set[str] = set()      # ops whose kernel hung in a child in this process
_in_child = False            # this process is a child checking a case: checks run here


def crashed_ops() -> frozenset[str]:
    """The ops seen to die of a kernel's signal in this process."""
    return frozenset(_crashed)


def remember_crash(op: str) -> None:
    """Check ``op`` isolated for the rest of this process."""
    _crashed.add(op)


def remember_deaths(op: str, error: BackendError) -> None:
    """Remember ``op`` when a rank running its check died of a kernel's signal (a process
    backend's rank: its exit code is minus the signal)."""
    for failure in (error, *getattr(error, "failures", ())):
        code = getattr(failure, "exitcode", None) if isinstance(failure, RankDied) else None
        if isinstance(code, int) and -code in KERNEL_SIGNALS:
            remember_crash(op)


def needs_isolation(case, backend) -> bool:
    """Does ``case`` run in a child on ``backend``: an in-process simulated backend, and
    :func:`isolates` ``case``."""
    return isinstance(backend, SimulatedBackend) and isolates(case)


def isolates(case) -> bool:
    """Does what runs ``case``'s op run in a child: its spec flags it or its op died before, and
    this is not already such a child."""
    return not _in_child and (getattr(case, "isolate", False) is True or case.op in _crashed)


# ------------------------------------------------------------------------- what travels

def _overload(namespace: str, name: str, overload: str) -> object:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _packet(namespace: str, name: str) -> object:
    return getattr(getattr(torch.ops, namespace), name)


def _graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(root, graph)


class _Pickler(pickle.Pickler):
    """Pickles what the default pickler cannot or does not keep: an ATen overload (by name), an
    fx GraphModule (whose own pickling re-traces its code and drops every node's metadata, which
    the check reads) as the attributes its graph reads and a copy of the graph."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, _, name = obj._qualified_op_name.partition("::")
            return _packet, (namespace, name)
        if isinstance(obj, fx.GraphModule):
            return _graph_module, (_attributes(obj), _detached(obj.graph))
        return NotImplemented


def _dumps(value: object) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _attributes(graph_module: fx.GraphModule) -> torch.nn.Module:
    """A plain module holding what ``graph_module``'s graph reads (get_attr, call_module), under the
    same names, parameters and buffers kept as such."""
    root = torch.nn.Module()
    for node in graph_module.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        *path, name = str(node.target).split(".")
        source, target = graph_module, root
        for part in path:
            source = getattr(source, part)
            if not hasattr(target, part):
                target.add_module(part, torch.nn.Module())
            target = getattr(target, part)
        value = getattr(source, name)
        if name in source._parameters:
            target.register_parameter(name, value)
        elif name in source._buffers:
            target.register_buffer(name, value)
        elif isinstance(value, torch.nn.Module):
            target.add_module(name, value)
        else:
            setattr(target, name, value)
    return root


def _detached(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` owned by no module, each node's metadata that can travel kept (a fake
    tensor a capture left cannot, and no check reads one)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    for node in copy.nodes:
        kept = {}
        for key, value in node.meta.items():
            try:
                _dumps(value)
            except Exception:  # noqa: BLE001 - what cannot be pickled stays behind
                continue
            kept[key] = value
        node.meta = kept
    return copy


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The parent's simulated backend, as the child makes its own."""

    mesh: object
    device: str
    timeout: float
    same_cpu: bool
    stacked: bool


# ------------------------------------------------------------------------- the child

def _child(conn) -> None:  # noqa: ANN001 - a multiprocessing Connection
    """Check what the parent sends, send back ("results", [CheckResult]) or ("error", exception),
    and leave without the interpreter's teardown (a kernel may have left the heap corrupt)."""
    global _in_child
    _in_child = True
    os.environ.pop(CHECK_LOG_ENV, None)   # the parent counts these checks
    _thread_lock_for_bars()
    try:
        verify, settings, case, strategies, options = pickle.loads(conn.recv_bytes())
        backend = SimulatedBackend(settings.mesh, settings.device, settings.timeout, same_cpu=settings.same_cpu,
                                   stacked=settings.stacked)
        reply: tuple = ("results", verify(backend, case, strategies, **options))
    except BaseException as error:  # noqa: BLE001 - said to the parent, which raises it
        reply = ("error", error)
    try:
        data = _dumps(reply)
        pickle.loads(data)   # an exception whose arguments do not rebuild it would fail in the parent
    except Exception:  # noqa: BLE001 - what cannot travel travels as text
        data = _dumps(("error", ShardVerifyError(f"{type(reply[1]).__name__}: {reply[1]}")))
    try:
        conn.send_bytes(data)
        conn.close()
    except OSError:   # the parent is gone (stopped by a signal): no one is left to tell
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _thread_lock_for_bars() -> None:
    """torch.fx's Interpreter opens a (disabled) tqdm bar on every run, and tqdm's first bar makes
    its lock a multiprocessing RLock: a named semaphore, which a child killed by its op's kernel
    never unlinks (the resource tracker then warns of it when the caller exits). No bar is
    shared between processes here: a thread lock does."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


@dataclasses.dataclass(frozen=True)
class _Death:
    """How a child ended without a reply: the signal that killed it, else its exit status."""

    signum: int | None
    status: int | None
    hung: float | None = None    # the seconds it made no reply in before it was killed

    def detail(self) -> str:
        if self is HUNG_BEFORE:
            return "the op's kernel hung in this process before (its checking process was killed): not run again"
        if self.hung is not None:
            return (f"the op's kernel hung: the checking process made no reply in {self.hung:.0f} s and was "
                    f"killed (a kernel that corrupted memory may deadlock instead of crashing)")
        if self.signum is None:
            shown = "no exit status" if self.status is None else f"exit status {self.status}"
            return f"the checking process ended before it reported, with {shown}"
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = "a signal"
        if self.signum in KERNEL_SIGNALS:
            return f"the op's kernel killed the checking process with {name} (signal {self.signum})"
        return f"the checking process was killed by {name} (signal {self.signum}) from outside it"


#: an op whose kernel hung in a child before: not run again in this process
HUNG_BEFORE = _Death(None, None, hung=0.0)


def _in_a_child(payload: bytes, limit: float) -> tuple | _Death:
    """The child's reply to ``payload``, or how it died or that it made none in ``limit`` seconds."""
    ctx = multiprocessing.get_context("forkserver")
    start_forkserver(ctx, PRELOAD)   # deaf to the terminal's Ctrl-C (backends/signals.py)
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_end,), name="shardverify-isolated", daemon=True)
    replied = False
    try:
        with signals_held():   # started and known, or not started: the finally below reaches it
            proc.start()
        child_end.close()
        try:
            parent_end.send_bytes(payload)
            if not parent_end.poll(limit):   # a hang guard: the child is killed below
                return _Death(None, None, hung=limit)
            reply = pickle.loads(parent_end.recv_bytes())
            replied = True
            return reply
        except (EOFError, OSError):   # the pipe closed: the child died
            proc.join(REAP_SECONDS)
            code = proc.exitcode
            return _Death(-code if code is not None and code < 0 else None,
                          code if code is not None and code >= 0 else None)
    finally:   # a child that replied leaves at once; one cut short (Ctrl-C) is killed now
        if proc.pid is not None:
            if replied:
                proc.join(REAP_SECONDS)
            if proc.is_alive():
                proc.kill()
            proc.join()
        parent_end.close()
        child_end.close()


def _run(verify: Callable, backend: SimulatedBackend, case, strategies: Sequence[ShardingStrategy],
         options: dict) -> list[CheckResult] | _Death:
    settings = _Settings(backend.mesh, str(backend.device), backend.timeout, backend.same_cpu, backend.stacked)
    reply = _in_a_child(_dumps((verify, settings, case, list(strategies), options)), CHECK_SECONDS)
    if isinstance(reply, _Death):
        if reply.hung is not None:
            _hung.add(case.op)
            return reply
        if reply.signum is None:   # no signal: the child failed on its own (it could not start, or import)
            raise ShardVerifyError(f"{case.op}: the isolated check of {case.describe()} could not run: "
                                   f"{reply.detail()}")
        if reply.signum in KERNEL_SIGNALS:
            remember_crash(case.op)
        return reply
    kind, value = reply
    if kind == "error":
        raise value
    return value


def _call_alone(function: Callable, backend: SimulatedBackend, case, strategies, **options):
    """``function(case)`` in the child's frame, which hands every call a backend and strategies."""
    return function(case)


def run_isolated(function: Callable, case) -> object:
    """``function(case)`` in a child (a top-level function, ``case`` picklable), as a check is
    run there: its return value, its exception raised here, or ShardVerifyError saying how the
    child died (the op remembered as crashing)."""
    from shardverify.sharding.mesh import DeviceMesh

    if case.op in _hung:
        raise ShardVerifyError(HUNG_BEFORE.detail())
    settings = _Settings(DeviceMesh((1,)), "cpu", 60.0, False, False)
    reply = _in_a_child(_dumps((functools.partial(_call_alone, function), settings, case, [], {})), CALL_SECONDS)
    if isinstance(reply, _Death):
        if reply.hung is not None:
            _hung.add(case.op)
        if reply.signum in KERNEL_SIGNALS:
            remember_crash(case.op)
        raise ShardVerifyError(reply.detail())
    kind, value = reply
    if kind == "error":
        raise value
    return value


def verify_isolated(verify: Callable, backend: SimulatedBackend, case, strategies: Sequence[ShardingStrategy], *,
                    shown_dtype: str, backend_name: str, **options) -> list[CheckResult]:
    """``verify(backend, case, strategies, **options)`` (the engine's verify_case) in a child on a
    simulated backend like ``backend``; when the child dies, each strategy alone in a child of its
    own, and each whose child dies fails naming how (``shown_dtype``, ``backend_name``: the
    dtype and backend its result names, as the in-process check's would)."""
    strategies = list(strategies)

    def failed(strategy: ShardingStrategy, death: _Death, seconds: float) -> CheckResult:
        return CheckResult(op=case.op, case=case.describe(), strategy=strategy.name,
                           mesh_shape=tuple(backend.mesh.shape), backend=backend_name, dtype=shown_dtype,
                           mismatches=(Mismatch("error", -1, "process", detail=death.detail()),), seconds=seconds)

    together = HUNG_BEFORE if case.op in _hung else _run(verify, backend, case, strategies, options)
    if not isinstance(together, _Death):
        return together
    if together.hung is not None:   # not each alone: each could hang as long again
        return [failed(strategy, together, 0.0) for strategy in strategies]
    results, deaths = [], 0
    for strategy in strategies:
        start = time.perf_counter()
        alone = _run(verify, backend, case, [strategy], options)
        if isinstance(alone, _Death):
            deaths += 1
            results.append(failed(strategy, alone, time.perf_counter() - start))
        else:
            results.append(alone[0])
    if not deaths:   # corrupt memory that only some order of checks turns into a crash
        said = (f"{together.detail()} while it checked every strategy together, and no strategy alone "
                f"killed it: each result is from a process of its own")
        results[0] = dataclasses.replace(results[0], note="; ".join(p for p in (results[0].note, said) if p))
    return results
