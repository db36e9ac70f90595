"""SimulatedBackend: every primitive against a reference computed from the mesh, plus failures."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from shardverify.backends import SimulatedBackend, get_backend
from shardverify.backends.base import Backend, Communicator
from shardverify.backends.simulated import _current_cpu
from shardverify.errors import BackendError, RankError, RankTimeout
from shardverify.sharding.mesh import DeviceMesh

MESHES = [(2, 2), (4,), (3,)]
AXES = {(2, 2): [(0,), (1,), (0, 1), (1, 0)], (4,): [(0,)], (3,): [(0,)]}


def cases():
    return [(shape, axes) for shape in MESHES for axes in AXES[shape]]


@pytest.fixture(scope="module")
def backends():
    made = {shape: SimulatedBackend(DeviceMesh(shape), timeout=10.0) for shape in MESHES}
    yield made
    for backend in made.values():
        backend.close()


def value_of(rank: int, shape=(2, 3)) -> torch.Tensor:
    """A tensor that differs per rank and per element."""
    return torch.arange(6, dtype=torch.float32).reshape(shape) + 100.0 * rank


# ---- SPMD bodies (module level so the process tests can reuse them) --------------------

def body_all_reduce(comm, axes, op):
    return comm.all_reduce(value_of(comm.rank) * (-1) ** comm.rank, axes, op), dict(comm.counts)


def body_all_gather(comm, axes):
    return comm.all_gather(value_of(comm.rank), axes)


def body_reduce_scatter(comm, axes):
    n = comm.mesh.axes_size(axes)
    chunks = [value_of(comm.rank) + 10.0 * i for i in range(n)]
    return comm.reduce_scatter(chunks, axes)


def body_all_to_all(comm, axes):
    n = comm.mesh.axes_size(axes)
    return comm.all_to_all([value_of(comm.rank) + 10.0 * i for i in range(n)], axes)


def body_broadcast(comm, axes, src):
    return comm.broadcast(value_of(comm.rank), axes, src)


def body_ring(comm):
    """Send to the next rank, receive from the previous (odd/even order avoids deadlock)."""
    n, r = comm.mesh.size, comm.rank
    mine, got = value_of(r), torch.empty(2, 3)
    if r % 2 == 0:
        comm.send(mine, (r + 1) % n)
        got = comm.recv(got, (r - 1) % n)
    else:
        got = comm.recv(got, (r - 1) % n)
        comm.send(mine, (r + 1) % n)
    comm.barrier()
    return got, dict(comm.counts)


def body_fresh(comm):
    """Results must not alias the inputs or each other."""
    t = value_of(comm.rank)
    gathered = comm.all_gather(t, (0,))
    reduced = comm.all_reduce(t, (0,))
    t.add_(1000.0)
    gathered[0].mul_(0)
    comm.barrier()
    return gathered, reduced


def body_fail_on(comm, bad_rank):
    comm.barrier()
    if comm.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {comm.rank}")
    return comm.all_reduce(torch.ones(1), tuple(range(comm.mesh.ndim)))


def body_mismatch(comm):
    return comm.all_reduce(torch.zeros(comm.rank + 1), (0,))


def body_wrong_kind(comm):
    t = torch.zeros(2)
    return comm.all_reduce(t, (0,)) if comm.rank == 0 else comm.all_gather(t, (0,))


def body_recv_mismatch(comm):
    if comm.rank == 0:
        comm.send(torch.zeros(3), 1)
    elif comm.rank == 1:
        comm.recv(torch.zeros(4), 0)


def body_hang(comm, hung_rank, seconds):
    if comm.rank == hung_rank:
        time.sleep(seconds)
    comm.barrier()
    return comm.rank


def body_deadlock(comm):
    if comm.rank == 0:
        comm.recv(torch.zeros(1), 1)
    else:
        comm.recv(torch.zeros(1), 0)


def body_rank(comm):
    return comm.rank


def body_bad_axes(comm):
    return comm.all_reduce(torch.ones(1), (5,))


# ---- references -----------------------------------------------------------------------

def groups(mesh, axes):
    return [mesh.group_ranks(r, axes) for r in mesh.ranks]


def test_protocols(backends):
    backend = backends[(2, 2)]
    assert isinstance(backend, Backend)
    comm_types = backend.run(lambda comm: isinstance(comm, Communicator))
    assert comm_types == [True] * 4


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("shape,axes", cases())
def test_all_reduce(backends, shape, axes, op):
    mesh = DeviceMesh(shape)
    out = backends[shape].run(body_all_reduce, axes, op)
    reduce = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[op]
    for rank, (result, counts) in enumerate(out):
        inputs = torch.stack([value_of(r) * (-1) ** r for r in mesh.group_ranks(rank, axes)])
        torch.testing.assert_close(result, reduce(inputs, dim=0))
        assert counts == {("all_reduce", axes): 1}


@pytest.mark.parametrize("shape,axes", cases())
def test_all_gather_in_group_order(backends, shape, axes):
    mesh = DeviceMesh(shape)
    out = backends[shape].run(body_all_gather, axes)
    for rank, gathered in enumerate(out):
        expected = [value_of(r) for r in mesh.group_ranks(rank, axes)]
        assert len(gathered) == len(expected)
        for got, want in zip(gathered, expected):
            torch.testing.assert_close(got, want)


def test_group_order_axes_1_0():
    # S10 on a (2, 2) mesh: axis 1 most significant, so rank 1 (coord (0, 1)) is member 2
    mesh = DeviceMesh((2, 2))
    with SimulatedBackend(mesh) as backend:
        out = backend.run(body_all_gather, (1, 0))
    firsts = [int(t[0, 0].item()) // 100 for t in out[0]]
    assert firsts == [0, 2, 1, 3]


@pytest.mark.parametrize("shape,axes", cases())
def test_reduce_scatter(backends, shape, axes):
    mesh = DeviceMesh(shape)
    out = backends[shape].run(body_reduce_scatter, axes)
    for rank, result in enumerate(out):
        group = mesh.group_ranks(rank, axes)
        i = group.index(rank)
        torch.testing.assert_close(result, sum(value_of(r) + 10.0 * i for r in group))


@pytest.mark.parametrize("shape,axes", cases())
def test_all_to_all(backends, shape, axes):
    mesh = DeviceMesh(shape)
    out = backends[shape].run(body_all_to_all, axes)
    for rank, received in enumerate(out):
        group = mesh.group_ranks(rank, axes)
        i = group.index(rank)
        for got, sender in zip(received, group, strict=True):
            torch.testing.assert_close(got, value_of(sender) + 10.0 * i)


@pytest.mark.parametrize("shape,axes", cases())
def test_broadcast(backends, shape, axes):
    mesh = DeviceMesh(shape)
    src = mesh.axes_size(axes) - 1
    out = backends[shape].run(body_broadcast, axes, src)
    for rank, result in enumerate(out):
        torch.testing.assert_close(result, value_of(mesh.group_ranks(rank, axes)[src]))


@pytest.mark.parametrize("shape", MESHES)
def test_send_recv_ring_and_counts(backends, shape):
    n = DeviceMesh(shape).size
    out = backends[shape].run(body_ring)
    for rank, (got, counts) in enumerate(out):
        torch.testing.assert_close(got, value_of((rank - 1) % n))
        assert counts == {("send", ()): 1, ("recv", ()): 1}


def test_results_are_fresh(backends):
    out = backends[(4,)].run(body_fresh)
    for rank, (gathered, reduced) in enumerate(out):
        torch.testing.assert_close(gathered[0], torch.zeros(2, 3))
        for r in range(1, 4):
            torch.testing.assert_close(gathered[r], value_of(r))
        torch.testing.assert_close(reduced, sum(value_of(r) for r in range(4)))


def test_counts_are_per_run_and_per_axes(backends):
    def body(comm):
        comm.all_reduce(torch.ones(1), (0,))
        comm.all_reduce(torch.ones(1), (0,))
        comm.all_gather(torch.ones(1), (1, 0))
        comm.barrier()
        return dict(comm.counts)

    for _ in range(2):
        for counts in backends[(2, 2)].run(body):
            assert counts == {("all_reduce", (0,)): 2, ("all_gather", (1, 0)): 1}


def test_backward_runs_on_the_rank_thread(backends):
    """A differentiable all-reduce whose backward all-reduces from inside the rank's backward."""

    class AllReduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, comm, t):
            ctx.comm = comm
            return comm.all_reduce(t, (0,))

        @staticmethod
        def backward(ctx, grad):
            ctx.threads = threading.current_thread().name
            return None, ctx.comm.all_reduce(grad, (0,))

    def body(comm):
        x = torch.full((3,), float(comm.rank + 1), requires_grad=True)
        y = AllReduce.apply(comm, x * x)
        (y * (comm.rank + 1)).sum().backward()
        return threading.current_thread().name, y.grad_fn.threads, x.grad

    out = backends[(4,)].run(body)
    total = sum(r + 1 for r in range(4))
    for rank, (thread, backward_thread, grad) in enumerate(out):
        assert backward_thread == thread == f"shardverify-rank{rank}"
        torch.testing.assert_close(grad, torch.full((3,), 2.0 * (rank + 1) * total))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backward_runs_on_the_rank_thread():
    """On one GPU all ranks share the device; backward collectives must still not deadlock."""

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, comm, t):
            ctx.comm = comm
            return comm.all_reduce(t, (0,))

        @staticmethod
        def backward(ctx, grad):
            return None, ctx.comm.all_reduce(grad, (0,))

    def body(comm):
        x = torch.ones(4, device=comm.device, requires_grad=True)
        Reduce.apply(comm, x * (comm.rank + 1)).sum().backward()
        return x.grad.cpu()

    with SimulatedBackend(DeviceMesh((4,)), device="cuda:0", timeout=30.0) as backend:
        for rank, grad in enumerate(backend.run(body)):   # d/dx of sum_r (r + 1) x, seen by 4 ranks
            torch.testing.assert_close(grad, torch.full((4,), 4.0 * (rank + 1)))


# ---- failures -------------------------------------------------------------------------

def test_rank_error_names_rank_and_backend_recovers(backends):
    backend = backends[(2, 2)]
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        backend.run(body_fail_on, 2)
    assert time.monotonic() - start < 2.0   # the others were unblocked, not timed out
    assert info.value.rank == 2
    assert "deliberate failure on rank 2" in str(info.value)
    assert "body_fail_on" in info.value.traceback_text
    assert backend.run(body_rank) == [0, 1, 2, 3]


def test_mismatched_shapes_raise_collective_error(backends):
    with pytest.raises(RankError, match=r"CollectiveError.*disagree") as info:
        backends[(3,)].run(body_mismatch)
    assert "float32[1]" in str(info.value.traceback_text) and "float32[3]" in info.value.traceback_text


def test_mismatched_kinds_raise_collective_error(backends):
    with pytest.raises(RankError, match="CollectiveError"):
        backends[(4,)].run(body_wrong_kind)


def test_recv_mismatch_raises(backends):
    with pytest.raises(RankError, match=r"rank 0 sent float32\[3\], rank 1 expects float32\[4\]"):
        backends[(4,)].run(body_recv_mismatch)
    assert backends[(4,)].run(body_rank) == [0, 1, 2, 3]


def test_hung_rank_times_out_naming_it(backends):
    backend = backends[(4,)]
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        backend.run(body_hang, 3, 5.0, timeout=0.5)
    assert time.monotonic() - start < 3.0
    assert info.value.ranks == (3,)
    assert backend.run(body_rank) == [0, 1, 2, 3]   # a fresh thread replaced the stuck one


def test_deadlock_times_out_naming_all(backends):
    with pytest.raises(RankTimeout) as info:
        backends[(2, 2)].run(body_deadlock, timeout=0.3)
    assert info.value.ranks == (0, 1, 2, 3)


def test_local_argument_errors(backends):
    with pytest.raises(RankError, match="mesh axis 5 is out of range"):
        backends[(4,)].run(body_bad_axes)

    def bad_chunks(comm):
        comm.reduce_scatter([torch.ones(1)], (0,))

    with pytest.raises(RankError, match=r"one chunk per group member \(4\), got 1"):
        backends[(4,)].run(bad_chunks)

    def bad_op(comm):
        comm.all_reduce(torch.ones(1), (0,), op="avg")

    with pytest.raises(RankError, match="op must be one of"):
        backends[(4,)].run(bad_op)


def test_constructor_and_run_validation():
    with pytest.raises(BackendError, match="DeviceMesh"):
        SimulatedBackend((2, 2))
    with pytest.raises(BackendError, match="timeout"):
        SimulatedBackend(DeviceMesh((2,)), timeout=0)
    with pytest.raises(BackendError, match="unknown backend 'mpi'"):
        get_backend("mpi", DeviceMesh((2,)))
    backend = get_backend("simulated", DeviceMesh((2,)))
    with pytest.raises(BackendError, match="callable"):
        backend.run(42)
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        backend.run(body_rank)


def test_each_rank_gets_its_own_args(backends):
    def body(comm, box):
        box.append(comm.rank)
        comm.barrier()
        return list(box)

    assert backends[(3,)].run(body, []) == [[0], [1], [2]]


def body_cpu_set(comm, caller: int | None = None):
    """This rank thread's CPU set, and the calling thread's (by native id) while the batch runs."""
    mine = sorted(os.sched_getaffinity(0))
    return mine if caller is None else (mine, sorted(os.sched_getaffinity(caller)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU placement is Linux-only")
def test_rank_threads_share_one_cpu_unless_told_not_to():
    """One rank runs at a time, so they are kept on one CPU (hand-overs never wait for another
    core to wake), and so is the caller while the batch runs (it wakes when the batch ends),
    its own CPU set given back afterwards; ``same_cpu=False`` leaves every thread wherever
    the OS puts it."""
    allowed = sorted(os.sched_getaffinity(0))
    caller = threading.get_native_id()
    mesh = DeviceMesh((2, 2))
    with SimulatedBackend(mesh) as kept:
        placed = kept.run(body_cpu_set, caller)
        assert all(found == placed[0] for found in placed) and len(placed[0][0]) == 1, placed
        assert placed[0][0][0] in allowed and placed[0][1] == placed[0][0], placed
        assert sorted(os.sched_getaffinity(0)) == allowed
        assert kept.run(lambda comm: comm.all_reduce(torch.ones(2), (0, 1)).tolist()) == [[4.0, 4.0]] * 4
    with SimulatedBackend(mesh, same_cpu=False) as free:
        assert free.run(body_cpu_set, caller) == [(allowed, allowed)] * 4
    with pytest.raises(BackendError, match="same_cpu must be True or False"):
        SimulatedBackend(mesh, same_cpu="yes")


def _intra_op_threads(comm) -> int:
    return torch.get_num_threads()


def _fresh_thread_intra_op() -> int:
    """What a thread started now gets: torch's default for new threads."""
    found = []
    thread = threading.Thread(target=lambda: found.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return found[0]


@pytest.mark.parametrize("caller_threads", [1, 2, 3])
def test_rank_threads_take_the_intra_op_threads_of_their_placement(caller_threads):
    """A rank thread's OpenMP team follows OpenMP's default (one thread per CPU), not
    ``torch.set_num_threads``: kept on one CPU it ran BLAS calls as a team of two threads on
    that CPU, left free it ignored the caller's setting.  Ranks kept on one CPU get one intra-op
    thread, free ones the caller's count; the caller's own count, and torch's default for
    threads started later, stay the caller's."""
    before = torch.get_num_threads()
    torch.set_num_threads(caller_threads)
    try:
        kept_one = _current_cpu() is not None   # the platform says where the caller runs: ranks kept there
        with SimulatedBackend(DeviceMesh((2, 2))) as kept:
            assert kept.run(_intra_op_threads) == [1 if kept_one else caller_threads] * 4
            assert torch.get_num_threads() == caller_threads
            assert _fresh_thread_intra_op() == caller_threads
            assert kept.run(_intra_op_threads) == [1 if kept_one else caller_threads] * 4   # still, and once
        with SimulatedBackend(DeviceMesh((2, 2)), same_cpu=False) as free:
            assert free.run(_intra_op_threads) == [caller_threads] * 4
            torch.set_num_threads(caller_threads + 1)   # the caller changes its mind: the next batch follows
            assert free.run(_intra_op_threads) == [caller_threads + 1] * 4
            assert torch.get_num_threads() == caller_threads + 1
            assert _fresh_thread_intra_op() == caller_threads + 1
    finally:
        torch.set_num_threads(before)
