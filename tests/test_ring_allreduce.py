"""Ring and naive all-reduce on send/recv: the schedule's logic, the traffic they issue,
and that a ring with one off-by-one chunk index is caught by the check the generated
tests use (the cases come from specs/collectives/ring_all_reduce.yaml)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shardverify.backends.simulated import SimulatedBackend
from shardverify.spec.loader import load_yaml
from shardverify.features.algorithms import implementations as algorithms
from shardverify.features.algorithms.implementations import RingStep, chunk_bounds, naive_all_reduce, ring_all_reduce, ring_schedule
from shardverify.features.algorithms.check import check_collective
from shardverify.features.algorithms.spec import parse_collective_spec
from shardverify.errors import CollectiveError
from shardverify.sharding.mesh import DeviceMesh

RING_SPEC = Path(__file__).resolve().parents[1] / "specs" / "collectives" / "ring_all_reduce.yaml"


@pytest.fixture(scope="module")
def backends():
    made: dict[tuple[int, ...], SimulatedBackend] = {}

    def get(shape: tuple[int, ...]) -> SimulatedBackend:
        if shape not in made:
            made[shape] = SimulatedBackend(DeviceMesh(shape), timeout=20.0)
        return made[shape]

    yield get
    for backend in made.values():
        backend.close()


# --------------------------------------------------------------------------- pure logic


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7])
def test_ring_schedule_reduces_every_chunk_over_every_rank(p):
    """Play the schedule symbolically: each (rank, chunk) holds the set of ranks summed in."""
    held = [[{rank} for _ in range(p)] for rank in range(p)]
    schedules = [ring_schedule(q, p) for q in range(p)]
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(p - 1):
            sent = [set(held[q][getattr(schedules[q], phase)[step].send]) for q in range(p)]
            for q in range(p):
                left = (q - 1) % p
                recv = getattr(schedules[q], phase)[step].recv
                # the chunk a rank receives is the one its left neighbour sends
                assert recv == getattr(schedules[left], phase)[step].send
                held[q][recv] = held[q][recv] | sent[left] if phase == "reduce_scatter" else sent[left]
        if phase == "reduce_scatter":
            for q in range(p):
                assert held[q][(q + 1) % p] == set(range(p)), f"rank {q} after reduce-scatter"
    assert all(chunk == set(range(p)) for row in held for chunk in row)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 12, 13])
def test_chunk_bounds_cover_the_tensor_in_near_equal_pieces(numel, p):
    bounds = chunk_bounds(numel, p)
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_ring_schedule_rejects_a_position_outside_the_ring():
    with pytest.raises(CollectiveError, match="position 3 is not in a ring of 3"):
        ring_schedule(3, 3)


# --------------------------------------------------------------------------- traffic


def _traffic(comm, algorithm: str, numel: int):
    x = torch.arange(numel, dtype=torch.float64) * (comm.rank + 1)
    fn = ring_all_reduce if algorithm == "ring" else naive_all_reduce
    out = fn(comm, x, 0)
    return out, {kind: n for (kind, _), n in comm.counts.items()}


@pytest.mark.parametrize("numel", [1, 2, 7, 12])
def test_ring_sends_one_chunk_per_step_and_no_collective(backends, numel):
    p = 3
    results = backends((p,)).run(_traffic, "ring", numel)
    total = torch.arange(numel, dtype=torch.float64) * sum(range(1, p + 1))
    empty = sum(1 for start, end in chunk_bounds(numel, p) if start == end)
    sends = recvs = 0
    for rank, (out, counts) in enumerate(results):
        torch.testing.assert_close(out, total)
        assert set(counts) <= {"send", "recv"}, counts
        if not empty:
            assert counts == {"send": 2 * (p - 1), "recv": 2 * (p - 1)}, f"rank {rank}: {counts}"
        sends, recvs = sends + counts.get("send", 0), recvs + counts.get("recv", 0)
    # every step moves each chunk once; an empty chunk is never sent
    assert sends == recvs == 2 * (p - 1) * (p - empty)


def test_naive_all_reduce_funnels_through_the_root(backends):
    results = backends((4,)).run(_traffic, "naive", 5)
    for rank, (out, counts) in enumerate(results):
        torch.testing.assert_close(out, torch.arange(5, dtype=torch.float64) * 10)
        want = 3 if rank == 0 else 1
        assert counts == {"send": want, "recv": want}, f"rank {rank}: {counts}"


def _bad_root(comm):
    try:
        naive_all_reduce(comm, torch.zeros(2), 0, root=2)
    except CollectiveError as exc:
        return str(exc)
    return None


def test_naive_root_outside_the_group_is_an_error(backends):
    assert all("root=2" in m for m in backends((2,)).run(_bad_root))


# --------------------------------------------------------------------------- the wrong ring


def _ring_cases():
    """The generated tests' cases for the ring, where chunks are equal and non-empty (so the
    wrong ring computes wrong numbers rather than mismatching message sizes)."""
    spec = parse_collective_spec(load_yaml(RING_SPEC))
    chosen = []
    for case in spec.cases():
        p = DeviceMesh(case.mesh_shape).axes_size(case.axes)
        numel = 1
        for size in case.shape:
            numel *= size
        if case.torch_dtype.is_floating_point and numel % p == 0 and numel >= p:
            chosen.append(case)
    assert chosen, "the ring spec lost its divisible float cases"
    return chosen


def _off_by_one(original):
    def schedule(position: int, p: int):
        found = original(position, p)
        first = found.reduce_scatter[0]
        wrong = RingStep(first.send, (first.recv + 1) % p)   # receive into the next chunk
        return dataclasses.replace(found, reduce_scatter=(wrong,) + found.reduce_scatter[1:])
    return schedule


def test_a_ring_with_one_off_by_one_chunk_index_fails_the_generated_check(backends, monkeypatch):
    cases = _ring_cases()
    for case in cases:   # the same cases pass with the real schedule ...
        check_collective(backends(case.mesh_shape), case).assert_ok()
    monkeypatch.setattr(algorithms, "ring_schedule", _off_by_one(ring_schedule))
    for case in cases:   # ... and every one of them fails with the off-by-one
        report = check_collective(backends(case.mesh_shape), case)
        assert not report.ok, f"the wrong ring passed {case.describe()}"
        assert any("output: values differ" in m for m in report.mismatches), report.mismatches
        with pytest.raises(AssertionError, match="ring_all_reduce"):
            report.assert_ok()
