"""ProcessBackend (gloo): every primitive against a reference and against the simulated mesh,
group order, counters, metadata checks, and each failure mode followed by a usable pool."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from shardverify.backends import SimulatedBackend, get_backend
from shardverify.backends.process import ProcessBackend
from shardverify.errors import BackendError, RankDied, RankError, RankTimeout
from shardverify.sharding.mesh import DeviceMesh

# one xdist group: under `--dist loadgroup` these pools live on a single worker
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("shardverify-backends-process")]

MESHES = [(2, 2), (4,), (3,)]
AXES = {(2, 2): [(0,), (1,), (0, 1), (1, 0)], (4,): [(0,)], (3,): [(0,)]}


@pytest.fixture
def pool(sv_backend):
    """The plugin's cached process pool for a mesh shape (gloo here, nccl on a GPU box)."""
    return lambda shape: sv_backend(shape, "process")


@pytest.fixture
def sim(sv_backend):
    return lambda shape: sv_backend(shape, "simulated")


def value_of(rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3) + 100.0 * rank


def to_cpu(obj):
    """Results travel back on CPU, so the parent never needs the workers' GPUs."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ---- SPMD bodies (module level: pickled by reference) ------------------------------------

def body_primitives(comm, axes):
    """Every collective once over ``axes``; returns results and counts."""
    n, r, mine = comm.mesh.axes_size(axes), comm.rank, value_of(comm.rank, comm.device)
    signed = mine * (-1) ** r
    out = {
        "sum": comm.all_reduce(signed, axes),
        "max": comm.all_reduce(signed, axes, op="max"),
        "min": comm.all_reduce(signed, axes, op="min"),
        "gather": comm.all_gather(mine, axes),
        "scatter": comm.reduce_scatter([mine + 10.0 * i for i in range(n)], axes),
        "a2a": comm.all_to_all([mine + 10.0 * i for i in range(n)], axes),
        "bcast": comm.broadcast(mine, axes, n - 1),
    }
    comm.barrier(axes)
    return to_cpu(out), dict(comm.counts)


def body_ring(comm):
    n, r = comm.mesh.size, comm.rank
    mine, got = value_of(r, comm.device), torch.empty(2, 3, device=comm.device)
    if r % 2 == 0:
        comm.send(mine, (r + 1) % n)
        got = comm.recv(got, (r - 1) % n)
    else:
        got = comm.recv(got, (r - 1) % n)
        comm.send(mine, (r + 1) % n)
    return got.cpu(), dict(comm.counts)


def body_rank(comm):
    return comm.rank


def body_groups(comm):
    return {axes: dist.get_process_group_ranks(comm.process_group(axes)) for axes in [(0,), (1,), (1, 0)]}


def body_mismatch(comm):
    return comm.all_reduce(torch.zeros(comm.rank + 1, device=comm.device), (0,))


def body_recv_mismatch(comm):
    if comm.rank == 0:
        comm.send(torch.zeros(3, device=comm.device), 1)
    elif comm.rank == 1:
        comm.recv(torch.zeros(4, device=comm.device), 0)
    return comm.rank


def body_raise_alone(comm, bad_rank):
    """``bad_rank`` raises; the others block in a collective waiting for it."""
    if comm.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {comm.rank}")
    return comm.all_reduce(torch.ones(1, device=comm.device), (0,)).cpu()


def body_raise_after(comm, bad_rank):
    """``bad_rank`` raises after the last collective, so the others finish."""
    comm.barrier()
    if comm.rank == bad_rank:
        raise ValueError(f"late failure on rank {comm.rank}")
    return comm.rank


def body_hang(comm, hung_rank):
    if comm.rank == hung_rank:
        time.sleep(120)
    comm.barrier()


def body_die(comm, dying_rank):
    if comm.rank == dying_rank:
        os._exit(7)
    comm.barrier()


def body_unpicklable(comm):
    return (lambda: None) if comm.rank == 1 else None


# ---- references ---------------------------------------------------------------------------

def check_primitives(mesh, axes, out):
    for rank, (res, counts) in enumerate(out):
        group = mesh.group_ranks(rank, axes)
        n, i = len(group), group.index(rank)
        signed = torch.stack([value_of(r) * (-1) ** r for r in group])
        torch.testing.assert_close(res["sum"], signed.sum(0))
        torch.testing.assert_close(res["max"], signed.amax(0))
        torch.testing.assert_close(res["min"], signed.amin(0))
        assert len(res["gather"]) == n
        for got, member in zip(res["gather"], group):
            torch.testing.assert_close(got, value_of(member))
        torch.testing.assert_close(res["scatter"], sum(value_of(r) + 10.0 * i for r in group))
        for got, member in zip(res["a2a"], group, strict=True):
            torch.testing.assert_close(got, value_of(member) + 10.0 * i)
        torch.testing.assert_close(res["bcast"], value_of(group[n - 1]))
        kinds = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
        assert counts == {**{(k, axes): 1 for k in kinds}, ("all_reduce", axes): 3}


@pytest.mark.parametrize("shape,axes", [(s, a) for s in MESHES for a in AXES[s]])
def test_primitives_match_reference_and_simulated(pool, sim, shape, axes):
    mesh = DeviceMesh(shape)
    real = pool(shape).run(body_primitives, axes)
    check_primitives(mesh, axes, real)
    simulated = sim(shape).run(body_primitives, axes)
    for (a, _), (b, _) in zip(real, simulated):
        for key in a:
            if isinstance(a[key], list):
                for x, y in zip(a[key], b[key], strict=True):
                    assert torch.equal(x, y), key
            else:
                assert torch.equal(a[key], b[key]), key


def test_group_order_axes_1_0(pool):
    gathered = pool((2, 2)).run(body_primitives, (1, 0))[0][0]["gather"]
    assert [int(t[0, 0].item()) // 100 for t in gathered] == [0, 2, 1, 3]


@pytest.mark.parametrize("shape", MESHES)
def test_send_recv_ring(pool, shape):
    n = DeviceMesh(shape).size
    for rank, (got, counts) in enumerate(pool(shape).run(body_ring)):
        torch.testing.assert_close(got, value_of((rank - 1) % n))
        assert counts == {("send", ()): 1, ("recv", ()): 1}


def test_process_groups_follow_mesh_axes(pool):
    out = pool((2, 2)).run(body_groups)
    mesh = DeviceMesh((2, 2))
    for rank, groups in enumerate(out):
        for axes, ranks in groups.items():
            assert ranks == sorted(mesh.group_ranks(rank, axes))


def test_metadata_mismatch_raises_without_rebuild(pool):
    backend = pool((3,))
    backend.start()
    starts = backend.starts
    with pytest.raises(RankError, match="CollectiveError: ranks disagree") as info:
        backend.run(body_mismatch)
    assert "float32[1]" in str(info.value) and "float32[3]" in str(info.value)
    with pytest.raises(RankError, match=r"rank 0 sent float32\[3\], rank 1 expects float32\[4\]"):
        backend.run(body_recv_mismatch)
    assert backend.run(body_rank) == [0, 1, 2]
    assert backend.starts == starts   # every rank raised or returned: no rebuild


def test_rank_error_with_stuck_peers_rebuilds(pool):
    backend = pool((2, 2))
    backend.start()
    starts = backend.starts
    with pytest.raises(RankError) as info:
        backend.run(body_raise_alone, 2)
    assert info.value.rank == 2
    assert "deliberate failure on rank 2" in str(info.value)
    assert "body_raise_alone" in info.value.traceback_text
    assert backend.run(body_rank) == [0, 1, 2, 3]
    assert backend.starts == starts + 1


def test_rank_error_after_collectives_keeps_pool(pool):
    backend = pool((2, 2))
    backend.start()
    starts = backend.starts
    with pytest.raises(RankError, match="late failure on rank 1"):
        backend.run(body_raise_after, 1)
    assert backend.run(body_rank) == [0, 1, 2, 3]
    assert backend.starts == starts


def test_hung_rank_times_out(pool):
    backend = pool((3,))
    started = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        backend.run(body_hang, 1, timeout=3.0)
    assert 2.5 < time.monotonic() - started < 10.0
    assert info.value.ranks == (1,)   # the others were waiting for it in a collective
    assert backend.run(body_rank) == [0, 1, 2]


def test_killed_rank_is_reported(pool):
    backend = pool((4,))
    with pytest.raises(RankDied) as info:
        backend.run(body_die, 3)
    assert info.value.rank == 3 and info.value.exitcode == 7
    assert backend.run(body_rank) == [0, 1, 2, 3]


def test_unpicklable_values_are_reported(pool):
    backend = pool((4,))
    with pytest.raises(BackendError, match="module-level function"):
        backend.run(lambda comm: comm.rank)
    with pytest.raises(RankError, match="rank 1 cannot be pickled") as info:
        backend.run(body_unpicklable)
    assert info.value.rank == 1
    assert backend.run(body_rank) == [0, 1, 2, 3]


def test_unchecked_pool_and_close_leaves_no_process():
    mesh = DeviceMesh((2,))
    backend = get_backend("gloo", mesh, timeout=20.0, check_metadata=False)
    check_primitives(mesh, (0,), backend.run(body_primitives, (0,)))
    for rank, (got, _) in enumerate(backend.run(body_ring)):
        torch.testing.assert_close(got, value_of(1 - rank))
    pids = backend.worker_pids()
    assert len(pids) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    backend.close()
    assert backend.worker_pids() == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    with pytest.raises(BackendError, match="closed"):
        backend.run(body_rank)


def body_modules(comm):
    return sorted(sys.modules)


def test_a_fresh_workers_first_check_imports_nothing_the_forkserver_could_have():
    """Each pool worker is forked from the forkserver with its preloads imported: a module the
    first check still has to import (torch._dynamo, which torch imports on the first call of
    a dynamo-disabled function, costs about a second of CPU) is paid by every worker of every
    pool, which on a busy machine made the process tests four times slower."""
    from test_verify_broken import LINEAR

    from shardverify.verify.engine import verify_case
    from shardverify.verify.report import assert_passed

    with ProcessBackend(DeviceMesh((2,)), timeout=60.0) as backend:
        before = backend.run(body_modules)[0]
        assert_passed(verify_case(backend, LINEAR))
        imported = sorted(set(backend.run(body_modules)[0]) - set(before))
    assert not [m for m in imported if m.startswith("torch")], imported


def body_thread_policies(comm):
    """(thread name, scheduling policy) of every thread of this worker."""
    from shardverify.backends.process_worker import thread_names

    return [(name, os.sched_getscheduler(tid)) for tid, name in thread_names().items()]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")
def test_gloo_io_threads_run_as_batch_and_the_ranks_do_not(pool):
    """Each worker's gloo I/O threads (one per process group) poll while a collective is
    pending; under SCHED_BATCH their wake-ups stop preempting the ranks doing the work (a
    linear check on a (2,2) pool of this 2-core machine: 5.8 ms -> 3.3 ms).  The rank's own
    threads must keep the normal policy, or a loaded machine slows the checks down."""
    from shardverify.backends.process_worker import GLOO_IO_THREAD

    backend = pool((2, 2))
    if backend.backend != "gloo":
        pytest.skip(f"the pool runs {backend.backend}, whose threads are its own")
    for threads in backend.run(body_thread_policies):
        io = [policy for name, policy in threads if name == GLOO_IO_THREAD]
        rest = [policy for name, policy in threads if name != GLOO_IO_THREAD]
        assert len(io) >= 3, threads   # the world group and one per mesh axis
        assert set(io) == {os.SCHED_BATCH}, threads
        assert set(rest) == {os.SCHED_OTHER}, threads


def body_cpus(comm):
    """The CPUs each thread of this worker may run on."""
    from shardverify.backends.process_worker import thread_names

    return {(tid, name): frozenset(os.sched_getaffinity(tid)) for tid, name in thread_names().items()}


def test_worker_cpus_keeps_blocks_of_ranks_only_when_workers_outnumber_cpus():
    """Oversubscribed, the OS moved woken workers between cores at every collective; a
    block of neighbouring ranks per CPU, every CPU used, and nothing kept otherwise."""
    from shardverify.backends.process_worker import worker_cpus

    assert worker_cpus(4, {0, 1}) == [0, 0, 1, 1]
    assert worker_cpus(8, {5, 3}) == [3, 3, 3, 3, 5, 5, 5, 5]
    assert worker_cpus(4, {0, 2, 7}) == [0, 0, 2, 7]
    assert worker_cpus(4, range(4)) == [None] * 4
    assert worker_cpus(2, range(16)) == [None] * 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_workers_keep_to_their_cpus_threads_included():
    """Each worker, gloo's threads included (they inherit it), keeps to worker_cpus' CPU;
    keep_cpus=False leaves every worker on the CPUs this process may use."""
    from shardverify.backends.process_worker import worker_cpus

    mine = os.sched_getaffinity(0)
    mesh = DeviceMesh((2, 2))
    wanted = worker_cpus(mesh.size, mine)
    with ProcessBackend(mesh, timeout=60.0) as kept:
        for rank, threads in enumerate(kept.run(body_cpus)):
            expected = mine if wanted[rank] is None else {wanted[rank]}
            assert set(threads.values()) == {frozenset(expected)}, (rank, threads)
    with ProcessBackend(mesh, timeout=60.0, keep_cpus=False) as free:
        for threads in free.run(body_cpus):
            assert set(threads.values()) == {frozenset(mine)}, threads


def body_collector(comm):
    import gc

    return gc.get_threshold()


def test_workers_collect_as_checking_processes(pool):
    """A check's short-lived objects reached the old generation under the default thresholds:
    a full collection walked the whole worker (torch, the verifier) again, 0.35 s per worker
    every few seconds of checks (see shardverify.backends.gc_policy)."""
    from shardverify.backends.gc_policy import CHECKING_THRESHOLDS

    assert pool((2,)).run(body_collector) == [CHECKING_THRESHOLDS] * 2


def test_spawned_pool_dies_with_its_backend():
    backend = ProcessBackend(DeviceMesh((2,)), timeout=60.0, start_method="spawn")
    assert backend.run(body_rank) == [0, 1]
    assert backend.startup_seconds > 0
    pids = backend.worker_pids()
    del backend
    gc.collect()
    deadline = time.monotonic() + 120   # a hang guard: a loaded machine may take seconds to end them
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_constructor_validation():
    mesh = DeviceMesh((2,))
    with pytest.raises(BackendError, match="backend must be one of"):
        ProcessBackend(mesh, backend="mpi")
    with pytest.raises(BackendError, match="device_ids only apply"):
        ProcessBackend(mesh, device_ids=[0, 1])
    with pytest.raises(BackendError, match="timeout"):
        ProcessBackend(mesh, timeout=-1)
    with pytest.raises(BackendError, match="start_method must be one of"):
        ProcessBackend(mesh, start_method="fork")
    with pytest.raises(BackendError, match="keep_cpus must be True or False, got 1"):
        ProcessBackend(mesh, keep_cpus=1)
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="this machine has 0"):
            ProcessBackend(mesh, backend="nccl")


TORCHRUN_SCRIPT = '''
import gc
import json
import os
import torch
from shardverify.backends import get_backend
from shardverify.errors import RankError
from shardverify.sharding.mesh import DeviceMesh


def gather(comm):
    return [t.item() for t in comm.all_gather(torch.tensor([10.0 * comm.rank]), (0,))]


def failing(comm):
    if comm.rank == 1:
        raise ValueError("torchrun failure on rank 1")
    return comm.rank


if __name__ == "__main__":
    backend = get_backend("torchrun", DeviceMesh((2,)), backend="gloo", timeout=30.0)
    out = backend.run(gather)
    try:
        backend.run(failing)
        err = None
    except RankError as exc:
        err = [exc.rank, str(exc)]
    again = backend.run(gather)
    line = f"RESULT {backend.rank} {json.dumps({'out': out, 'err': err, 'again': again})}\\n"
    os.write(1, line.encode())   # one write, atomic on the pipe: print's pieces interleaved across ranks
    backend.close()
'''


def test_torchrun_backend(tmp_path):
    """Two ranks started by torchrun (standalone: an OS-assigned port), results on every rank."""
    script = tmp_path / "check.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script)],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(int(rank) for _, rank, _ in lines) == [0, 1]
    for _, rank, payload in lines:
        got = json.loads(payload)
        expected = [[0.0, 10.0], [0.0, 10.0]]
        assert got["out"] == got["again"] == expected
        assert got["err"][0] == 1 and "torchrun failure on rank 1" in got["err"][1]
