"""Batched runs (several checks in one hand-over to the ranks) on both backends: each outcome
belongs to its own item, a hang times out its own item only, and later items still run.
Also: timeouts name the ranks that never entered the collective the others wait in, a worker
killed between checks is not blamed on the next one, and frozen arguments are shared."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from shardverify.backends import SimulatedBackend
from shardverify.backends.base import is_frozen, private_copy
from shardverify.errors import RankDied, RankError, RankTimeout
from shardverify.sharding.mesh import DeviceMesh


# ---- SPMD bodies (module level: the process pool imports them) ---------------------------------

def body_item(comm, what: str, value: float):
    """One batch item: ``ok`` all-reduces, ``raise`` fails on rank 1 after the collective,
    ``raise_alone`` fails on rank 1 before it (the others wait), ``hang`` sleeps on rank 2,
    ``slow`` sleeps ``value`` seconds on rank 0, ``skip`` leaves rank 3 out of the collective
    the others enter."""
    if what == "raise_alone" and comm.rank == 1:
        raise ValueError("rank 1 fails before the collective")
    if what == "hang" and comm.rank == 2:
        time.sleep(30)
    if what == "slow" and comm.rank == 0:
        time.sleep(value)
    if what == "skip" and comm.rank == 3:
        return None
    out = comm.all_reduce(torch.full((2,), value), (0, 1))
    if what == "raise" and comm.rank == 1:
        raise ValueError("rank 1 fails after the collective")
    return float(out[0])


def body_rank(comm):
    return comm.rank


def body_skip(comm):
    """Rank 3 never enters the all-reduce the others wait in."""
    if comm.rank != 3:
        comm.all_reduce(torch.ones(1), (0, 1))
    return comm.rank


ITEMS = [("ok", 1.0), ("raise", 2.0), ("ok", 3.0), ("raise_alone", 4.0), ("ok", 5.0)]


def check_outcomes(outcomes) -> None:
    assert len(outcomes) == len(ITEMS)
    assert outcomes[0] == [4.0] * 4
    assert isinstance(outcomes[1], RankError) and outcomes[1].rank == 1
    assert "after the collective" in str(outcomes[1])
    assert outcomes[2] == [12.0] * 4
    assert isinstance(outcomes[3], RankError) and "before the collective" in str(outcomes[3])
    assert outcomes[4] == [20.0] * 4


# ---- simulated ---------------------------------------------------------------------------------

def test_simulated_batch_attributes_each_failure_to_its_item():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=10.0) as backend:
        check_outcomes(backend.run_batch(body_item, ITEMS))
        assert backend.run(body_rank) == [0, 1, 2, 3]


def test_simulated_batch_hang_times_out_its_item_only():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=10.0) as backend:
        started = time.monotonic()
        outcomes = backend.run_batch(body_item, [("ok", 1.0), ("hang", 2.0), ("ok", 3.0)], timeout=0.5)
        assert time.monotonic() - started < 5.0
        assert outcomes[0] == [4.0] * 4
        assert isinstance(outcomes[1], RankTimeout) and outcomes[1].ranks == (2,)
        assert outcomes[2] == [12.0] * 4


def test_simulated_batch_gives_each_item_its_timeout_from_the_last_finish():
    """The caller is not woken per check, yet every check keeps its whole timeout from the
    moment the one before it finished: slow checks that together outlast the timeout pass,
    and a hang after checks the caller slept through still times out, alone."""
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=10.0) as backend:
        outcomes = backend.run_batch(body_item, [("slow", 0.25)] * 4, timeout=0.6)
        assert outcomes == [[1.0] * 4] * 4
        started = time.monotonic()
        outcomes = backend.run_batch(body_item, [("ok", 1.0)] * 3 + [("hang", 2.0), ("ok", 3.0)], timeout=0.5)
        assert time.monotonic() - started < 5.0
        assert outcomes[:3] == [[4.0] * 4] * 3 and outcomes[4] == [12.0] * 4
        assert isinstance(outcomes[3], RankTimeout) and outcomes[3].ranks == (2,)


def test_the_caller_is_woken_when_the_check_it_unwinds_is_over():
    """After a failure the caller waits for the check's other ranks to unwind: it must be
    woken when they have, not sleep out its grace period (nor, here, the minute it allows)."""
    from shardverify.backends.simulated import _Batch

    batch = _Batch(world=2, size=3)
    batch.grace = 0
    unwinding = threading.Timer(0.05, lambda: [batch.finish(0, rank, None) for rank in (0, 1)])
    unwinding.start()
    started = time.monotonic()
    assert batch.wait(lambda: batch.done(0), started + 60.0)
    assert time.monotonic() - started < 30.0
    unwinding.join()
    assert batch.finished_at[0] is not None and batch.started(1, started) == batch.finished_at[0]


def test_simulated_timeout_names_ranks_that_never_entered():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=10.0) as backend:
        with pytest.raises(RankTimeout) as info:
            backend.run(body_skip, timeout=0.3)
    assert info.value.ranks == (0, 1, 2)
    assert info.value.never_entered == (3,)
    assert "rank(s) [3] never entered it" in str(info.value)
    assert "rank(s) [0, 1, 2] wait in all_reduce" in str(info.value)


@dataclass(frozen=True)
class _Frozen:
    name: str
    sizes: tuple


@dataclass(frozen=True)
class _FrozenHoldingList:
    items: list


@dataclass(frozen=True)
class _FrozenSlots:
    __slots__ = ("sizes",)
    sizes: tuple


def test_frozen_values_are_shared_and_the_rest_copied():
    frozen, box = _Frozen("a", (1, (2, 3))), []
    assert is_frozen(frozen) and is_frozen((frozen, torch.float32, None, "x"))
    assert not is_frozen(box) and not is_frozen(_FrozenHoldingList([1])) and not is_frozen(torch.ones(1))
    copied = private_copy((frozen, box, _FrozenHoldingList([1])))
    assert copied[0] is frozen and copied[1] is not box and copied[2].items is not None
    assert copied[2] is not None and copied[2].items == [1]


def test_a_frozen_dataclass_is_only_frozen_all_the_way_down():
    """Field names are remembered per type, never the verdict: each instance is walked (its
    fields, any attribute set besides them, slots too)."""
    assert is_frozen(_Frozen("a", (1, 2))) and not is_frozen(_Frozen("a", (1, [2])))
    smuggled = _Frozen("b", ())
    object.__setattr__(smuggled, "extra", [])   # an attribute that is not a field
    assert not is_frozen(smuggled)
    assert is_frozen(_FrozenSlots((1, "x", 2.0, None, True))) and not is_frozen(_FrozenSlots(({},)))
    assert is_frozen(((1, "x"), frozenset({2.5}), _Frozen("c", ((None,),))))


# ---- process pool ------------------------------------------------------------------------------

@pytest.fixture
def pool(sv_backend):
    return lambda shape: sv_backend(shape, "process")


@pytest.mark.dist
def test_process_batch_attributes_each_failure_to_its_item(pool):
    backend = pool((2, 2))
    check_outcomes(backend.run_batch(body_item, ITEMS))
    assert backend.run(body_rank) == [0, 1, 2, 3]


@pytest.mark.dist
def test_process_batch_hang_times_out_its_item_and_the_rest_runs(pool):
    backend = pool((2, 2))
    backend.start()
    starts = backend.starts
    outcomes = backend.run_batch(body_item, [("ok", 1.0), ("hang", 2.0), ("ok", 3.0)], timeout=3.0)
    assert outcomes[0] == [4.0] * 4
    assert isinstance(outcomes[1], RankTimeout) and outcomes[1].ranks == (2,)
    assert outcomes[2] == [12.0] * 4   # on the rebuilt pool
    assert backend.starts == starts + 1


@pytest.mark.dist
def test_process_timeout_names_ranks_that_never_entered(pool):
    backend = pool((2, 2))
    with pytest.raises(RankTimeout) as info:
        backend.run(body_skip, timeout=3.0)
    assert info.value.never_entered == (3,)
    assert "rank(s) [3] never entered it" in str(info.value)


@pytest.mark.dist
def test_worker_killed_between_checks_is_not_blamed_on_the_next(pool):
    backend = pool((2, 2))
    assert backend.run(body_rank) == [0, 1, 2, 3]
    backend.take_notices()
    victim = backend.worker_pids()[2]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{victim}") and time.monotonic() < deadline:
        try:
            os.waitpid(victim, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) \[2\] were found dead"):
        assert backend.run(body_rank) == [0, 1, 2, 3]   # the check itself passes
    notices = backend.take_notices()
    assert len(notices) == 1 and "pool was rebuilt" in notices[0]


def test_a_reaped_worker_counts_as_dead_before_its_exit_status_arrives():
    """The forkserver reaps a killed worker, then writes its exit status: in between,
    ``is_alive()`` still says True, and a check sent then was blamed for the death."""
    from shardverify.backends.process import _Pool

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)   # reaped by run(): that pid no longer exists

    class StatusNotYetWritten:
        pid = int(done.stdout)

        def is_alive(self) -> bool:
            return True

    class Alive:
        pid = os.getpid()

        def is_alive(self) -> bool:
            return True

    pool = object.__new__(_Pool)
    pool.procs = [Alive(), StatusNotYetWritten()]
    assert pool.dead() == [1]


def test_the_pool_waits_only_for_the_ranks_it_is_told_to():
    """``_Pool.ready`` reports the ranks waited for that sent something or whose process
    ended, never another rank (a rank already answered may have sent its next results, or
    died: waking for it would spin), follows a changing set of ranks, and takes any timeout."""
    import multiprocessing

    from shardverify.backends.process import _Pool

    class Proc:
        def __init__(self) -> None:
            self.sentinel, self._end = os.pipe()   # readable once "the process ended"

        def end(self) -> None:
            os.close(self._end)
            self._end = None

        def close(self) -> None:
            for fd in (self.sentinel, self._end):
                if fd is not None:
                    os.close(fd)

    pipes = [multiprocessing.Pipe() for _ in range(3)]
    pool = object.__new__(_Pool)
    pool.conns, pool.procs = [parent for parent, _ in pipes], [Proc() for _ in pipes]
    pool._poller, pool._watched, pool._pipes = None, {}, {}
    try:
        assert pool.ready({0, 1, 2}, 0.0) == [] and not pool.has_message(1)
        pipes[1][1].send_bytes(b"next")
        pool.procs[2].end()
        assert pool.ready({0}, 0.05) == []   # rank 1's message and rank 2's end are not waited for
        assert pool.ready({0, 1, 2}, 1e12) == [1, 2]   # a timeout beyond poll's range is waited in slices
        assert pool.has_message(1) and pool.conns[1].recv_bytes() == b"next" and not pool.has_message(1)
        assert pool.ready({1, 2}, 0.0) == [2]
        pipes[0][1].close()   # the worker's end of its pipe is gone: readable, and reading says EOF
        assert pool.ready({0}, 0.0) == [0] and pool.has_message(0)
    finally:
        for (parent, child), proc in zip(pipes, pool.procs):
            parent.close()
            child.close()
            proc.close()


@pytest.mark.dist
def test_worker_dying_inside_a_check_is_still_blamed(pool):
    backend = pool((2, 2))
    outcomes = backend.run_batch(body_item, [("ok", 1.0)])
    assert outcomes == [[4.0] * 4]
    with pytest.raises(RankDied):
        backend.run(_die_on_rank_1)


def _die_on_rank_1(comm):
    if comm.rank == 1:
        os._exit(3)
    comm.barrier()


# ---- a case's strategies as one batch: verdicts stay with their strategy ------------------------

def mixed_strategies(mesh):
    """Good, broken (its output all-reduce dropped), good, broken, good."""
    from test_verify_broken import LINEAR, drop_required_all_reduces, generated

    good = generated(LINEAR, mesh)
    broken = [b for b, _ in drop_required_all_reduces(good)]
    return LINEAR, [good[0], broken[0], good[1], broken[-1], good[-1]]


def check_mixed(backend) -> None:
    from shardverify.verify.engine import verify_case

    case, strategies = mixed_strategies(backend.mesh)
    results = verify_case(backend, case, strategies)
    assert [r.strategy for r in results] == [s.name for s in strategies]
    assert [r.passed for r in results] == [True, False, True, False, True], [r.report() for r in results]


def test_simulated_batch_keeps_verdicts_with_their_strategy():
    with SimulatedBackend(DeviceMesh((2, 2)), timeout=30.0) as backend:
        check_mixed(backend)


@pytest.mark.dist
def test_process_batch_keeps_verdicts_with_their_strategy(pool):
    check_mixed(pool((2, 2)))
