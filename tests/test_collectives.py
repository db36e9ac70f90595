"""The functional collectives and the CommPattern executors on the simulated mesh.

Every expected value is recomputed on each rank from all ranks' seeded inputs with plain
torch ops, never typed in."""

from __future__ import annotations

import pytest
import torch

from shardverify.backends.simulated import SimulatedBackend
from shardverify.collectives import functional as F
from shardverify.collectives.patterns import apply_comm_action, apply_grad_hook
from shardverify.errors import CollectiveError, RankError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere


@pytest.fixture(scope="module")
def mesh22():
    backend = SimulatedBackend(DeviceMesh((2, 2)), timeout=20.0)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def mesh3():
    backend = SimulatedBackend(DeviceMesh((3,)), timeout=20.0)
    yield backend
    backend.close()


def seeded(rank: int, shape=(4, 8), salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def counted(comm) -> dict:
    return {key: n for key, n in comm.counts.items() if n}


# --------------------------------------------------------------------------- patterns


def _pattern_rank(comm, pattern: CommPattern, axes: tuple[int, ...], dims: tuple[int, ...]):
    action = CommAction(pattern, axes, "x", CommWhere.BEFORE, dims)
    x = seeded(comm.rank).requires_grad_()
    out = apply_comm_action(comm, action, x)
    fwd_counts = counted(comm)
    grad_out = seeded(comm.rank, tuple(out.shape), salt=1)
    out.backward(grad_out)
    bwd_counts = {k: n - fwd_counts.get(k, 0) for k, n in counted(comm).items() if n - fwd_counts.get(k, 0)}
    return out.detach(), x.grad, fwd_counts, bwd_counts


def _pattern_expected(mesh: DeviceMesh, rank: int, pattern: CommPattern, axes, dims):
    ranks = mesh.group_ranks(rank, axes)
    pos, p = ranks.index(rank), len(ranks)
    xs = [seeded(r) for r in ranks]
    x = xs[pos]

    def grads(shape):
        return [seeded(r, shape, salt=1) for r in ranks]

    if pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD:
        out = sum(xs)
        return out, grads(out.shape)[pos], {("all_reduce", axes): 1}, {}
    if pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD:
        return x, sum(grads(x.shape)), {}, {("all_reduce", axes): 1}
    if pattern is CommPattern.GATHER_FWD_SPLIT_BWD:
        out = torch.cat(xs, dims[0])
        return out, grads(out.shape)[pos].chunk(p, dims[0])[pos], {("all_gather", axes): 1}, {}
    if pattern is CommPattern.SPLIT_FWD_GATHER_BWD:
        out = x.chunk(p, dims[0])[pos]
        return out, torch.cat(grads(out.shape), dims[0]), {}, {("all_gather", axes): 1}
    split, concat = dims
    out = torch.cat([xj.chunk(p, split)[pos] for xj in xs], concat)
    gs = grads(out.shape)
    grad = torch.cat([gj.chunk(p, concat)[pos] for gj in gs], split)
    return out, grad, {("all_to_all", axes): 1}, {("all_to_all", axes): 1}


PATTERN_CASES = [
    (CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, ()),
    (CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, ()),
    (CommPattern.GATHER_FWD_SPLIT_BWD, (0,)),
    (CommPattern.GATHER_FWD_SPLIT_BWD, (1,)),
    (CommPattern.SPLIT_FWD_GATHER_BWD, (0,)),
    (CommPattern.SPLIT_FWD_GATHER_BWD, (-1,)),
    (CommPattern.ALL2ALL_FWD_ALL2ALL_BWD, (0, 1)),
    (CommPattern.ALL2ALL_FWD_ALL2ALL_BWD, (1, 0)),
    (CommPattern.ALL2ALL_FWD_ALL2ALL_BWD, (1, 1)),
]


@pytest.mark.parametrize("axes", [(0,), (1,), (0, 1), (1, 0)], ids=str)
@pytest.mark.parametrize("pattern, dims", PATTERN_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_pattern_forward_backward_and_counts(mesh22, pattern, dims, axes):
    results = mesh22.run(_pattern_rank, pattern, axes, dims)
    for rank, (out, grad, fwd, bwd) in enumerate(results):
        want_out, want_grad, want_fwd, want_bwd = _pattern_expected(mesh22.mesh, rank, pattern, axes, dims)
        torch.testing.assert_close(out, want_out, msg=lambda m: f"rank {rank} output: {m}")
        torch.testing.assert_close(grad, want_grad, msg=lambda m: f"rank {rank} grad: {m}")
        assert fwd == want_fwd, f"rank {rank}: forward issued {fwd}"
        assert bwd == want_bwd, f"rank {rank}: backward issued {bwd}"


def _hook_rank(comm):
    action = CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, (1,), "weight", CommWhere.HOOK)
    grad = seeded(comm.rank)
    out = apply_grad_hook(comm, action, grad)
    try:
        apply_comm_action(comm, action, grad)
    except CollectiveError as exc:
        refused = str(exc)
    return out, counted(comm), refused


def test_grad_hook_all_reduces_the_gradient_and_is_refused_as_a_forward_action(mesh22):
    for rank, (out, counts, refused) in enumerate(mesh22.run(_hook_rank)):
        torch.testing.assert_close(out, sum(seeded(r) for r in mesh22.mesh.group_ranks(rank, (1,))))
        assert counts == {("all_reduce", (1,)): 1}
        assert "apply_grad_hook" in refused


def _split_error_rank(comm):
    action = CommAction(CommPattern.SPLIT_FWD_GATHER_BWD, (0,), "input_1", CommWhere.BEFORE, (1,))
    try:
        apply_comm_action(comm, action, torch.zeros(4, 5))
    except CollectiveError as exc:
        return str(exc), counted(comm)
    return None, counted(comm)


def test_pattern_split_of_indivisible_dim_is_an_error_before_any_collective(mesh3):
    for message, counts in mesh3.run(_split_error_rank):
        assert message is not None and "size 5 of dim 1" in message and "'input_1'" in message
        assert counts == {}


# --------------------------------------------------------------------------- functional: values


def _ops_rank(comm):
    """Every functional collective over axis 1 of a 2x2 mesh, forward and backward."""
    x = seeded(comm.rank).requires_grad_()
    outs = {
        "all_reduce": F.all_reduce(comm, x, 1),
        "all_gather": F.all_gather(comm, x, 1, dim=1),
        "reduce_scatter": F.reduce_scatter(comm, x, 1, dim=0),
        "all_to_all": F.all_to_all(comm, x, 1, split_dim=1, concat_dim=0),
        "broadcast": F.broadcast(comm, x, 1, src=1),
        "reduce": F.reduce(comm, x, 1, dst=1),
        "gather": F.gather(comm, x, 1, dim=0, dst=0),
        "scatter": F.scatter(comm, x, 1, dim=1, src=0),
    }
    grads = {}
    for name, out in outs.items():
        (grads[name],) = torch.autograd.grad(out, x, seeded(comm.rank, tuple(out.shape), salt=2))
    with torch.no_grad():
        plain = {"reduce": F.reduce(comm, x, 1, dst=1), "gather": F.gather(comm, x, 1, dim=0, dst=0)}
    return {k: v.detach() for k, v in outs.items()}, grads, plain


def _ops_expected(mesh: DeviceMesh, rank: int):
    ranks = mesh.group_ranks(rank, (1,))
    pos, p = ranks.index(rank), len(ranks)
    leaves = [seeded(r).requires_grad_() for r in ranks]
    per_rank = {
        "all_reduce": lambda q: sum(leaves),
        "all_gather": lambda q: torch.cat(leaves, 1),
        "reduce_scatter": lambda q: sum(leaves).chunk(p, 0)[q],
        "all_to_all": lambda q: torch.cat([t.chunk(p, 1)[q] for t in leaves], 0),
        "broadcast": lambda q: leaves[1],
        "reduce": lambda q: sum(leaves) if q == 1 else None,
        "gather": lambda q: torch.cat(leaves, 0) if q == 0 else None,
        "scatter": lambda q: leaves[0].chunk(p, 1)[q],
    }
    expected = {}
    for name, f in per_rank.items():
        outs = [f(q) for q in range(p)]
        loss = sum((o * seeded(r, tuple(o.shape), salt=2)).sum() for r, o in zip(ranks, outs) if o is not None)
        (grad,) = torch.autograd.grad(loss, leaves[pos], allow_unused=True)
        expected[name] = (outs[pos], torch.zeros_like(leaves[pos]) if grad is None else grad)
    return expected


def test_every_functional_collective_matches_its_definition_forward_and_backward(mesh22):
    for rank, (outs, grads, plain) in enumerate(mesh22.run(_ops_rank)):
        pos = mesh22.mesh.group_index(rank, (1,))
        for name, (want, want_grad) in _ops_expected(mesh22.mesh, rank).items():
            if want is None:   # no result here: a zero placeholder while recording, else None
                assert plain[name] is None, f"rank {rank} {name}"
                assert torch.count_nonzero(outs[name]) == 0
            else:
                torch.testing.assert_close(outs[name], want.detach(), msg=lambda m: f"rank {rank} {name}: {m}")
                if name in plain:
                    torch.testing.assert_close(plain[name], want.detach())
            torch.testing.assert_close(grads[name], want_grad, msg=lambda m: f"rank {rank} grad {name}: {m}")
        assert pos in (0, 1)


def _extremum_rank(comm, op: str):
    # Ranks 0 and 2 tie for the max at element 0, rank 1 holds the min alone there;
    # element 1 is equal everywhere.
    base = {0: [5.0, 1.0], 1: [-3.0, 1.0], 2: [5.0, 1.0]}[comm.rank]
    x = torch.tensor(base, dtype=torch.float64, requires_grad=True)
    out = F.all_reduce(comm, x, 0, op=op)
    out.backward(torch.tensor([1.0, 2.0], dtype=torch.float64) * (comm.rank + 1))
    return out.detach(), x.grad, counted(comm)


@pytest.mark.parametrize("op", ["max", "min"])
def test_all_reduce_extremum_sends_the_summed_gradient_to_the_holders_split_among_ties(mesh3, op):
    results = mesh3.run(_extremum_rank, op)
    xs = torch.tensor([[5.0, 1.0], [-3.0, 1.0], [5.0, 1.0]], dtype=torch.float64)
    ref = (xs.amax(0) if op == "max" else xs.amin(0))
    total = torch.tensor([1.0, 2.0], dtype=torch.float64) * (1 + 2 + 3)
    holders = (xs == ref).to(torch.float64)
    for rank, (out, grad, counts) in enumerate(results):
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(grad, total * holders[rank] / holders.sum(0))
        assert counts == {("all_reduce", (0,)): 2}   # one forward, one backward
    assert sum(r[1] for r in results).sub(total).abs().max() < 1e-12   # gradient conserved


def _p2p_rank(comm):
    """Rank 0 sends to 1, which sends a function of it to 2; gradients flow back."""
    x = seeded(comm.rank, (3,)).requires_grad_()
    if comm.rank == 0:
        token = F.send(comm, x * 2, 1)
        token.backward()
        with torch.no_grad():
            plain = F.send(comm, x, 1)
        return x.grad, plain
    if comm.rank == 1:
        got = F.recv(comm, torch.empty(3, dtype=torch.float64, requires_grad=True), 0)
        token = F.send(comm, got * x, 2)
        token.backward()
        F.recv(comm, torch.empty(3, dtype=torch.float64), 0)
        return x.grad, None
    got = F.recv(comm, torch.empty(3, dtype=torch.float64, requires_grad=True), 1)
    (got.sin() * x).sum().backward()
    return x.grad, None


def test_send_recv_are_differentiable_end_to_end(mesh3):
    results = mesh3.run(_p2p_rank)
    x = [seeded(r, (3,)).requires_grad_() for r in range(3)]
    y = (((x[0] * 2) * x[1]).sin() * x[2]).sum()
    want = torch.autograd.grad(y, x)
    for rank, (grad, plain) in enumerate(results):
        torch.testing.assert_close(grad, want[rank], msg=lambda m: f"rank {rank}: {m}")
    assert results[0][1] is None


# --------------------------------------------------------------------------- functional: errors


def _error_rank(comm, call: str):
    x = torch.zeros((4, 3) if comm.rank != 3 or call != "mismatch" else (4, 2),
                    dtype=torch.float64 if comm.rank == 3 and call == "dtype" else torch.float32)
    calls = {
        "dim_range": lambda: F.all_gather(comm, x, 0, dim=2),
        "divisible": lambda: F.reduce_scatter(comm, x, 0, dim=1),
        "scalar": lambda: F.scatter(comm, torch.tensor(1.0), 0, dim=0),
        "src": lambda: F.broadcast(comm, x, 0, src=2),
        "axis": lambda: F.all_reduce(comm, x, 2),
        "op": lambda: F.all_reduce(comm, x, 0, op="mean"),
        "mismatch": lambda: F.all_gather(comm, x, (0, 1), dim=0),
        "self": lambda: F.send(comm, x, comm.rank),
        "dtype": lambda: F.all_reduce(comm, x, (0, 1), op="max"),
    }
    try:
        calls[call]()
    except CollectiveError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("call, words", [
    ("dim_range", ["dim=2 out of range", "(4, 3)"]),
    ("divisible", ["size 3 of dim=1", "not divisible by the group size 2"]),
    ("scalar", ["0-d tensor"]),
    ("src", ["src=2", "group of size 2"]),
    ("axis", ["mesh axis 2 out of range", "(2, 2)"]),
    ("op", ["'mean'", "sum"]),
    ("mismatch", ["disagree", "float32[4, 3]", "float32[4, 2]"]),
    ("self", ["itself"]),
    ("dtype", ["disagree", "float32[4, 3]", "float64[4, 3]"]),
])
def test_bad_calls_raise_collective_error_on_every_rank(mesh22, call, words):
    for message in mesh22.run(_error_rank, call):
        assert message is not None, f"{call} did not raise"
        for word in words:
            assert word in message, message


def _scalar_rank(comm):
    x = torch.tensor(float(comm.rank + 1), requires_grad=True)
    out = F.all_reduce(comm, x, 0) * F.broadcast(comm, x, 0, src=2)
    out.backward()
    return out.detach(), x.grad


def test_zero_dim_tensors_work_where_the_op_allows(mesh3):
    xs = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = xs.sum() * xs[2]
    want = torch.autograd.grad(3 * y, xs)[0]   # three ranks each hold y
    for rank, (out, grad) in enumerate(mesh3.run(_scalar_rank)):
        torch.testing.assert_close(out, y.detach())
        torch.testing.assert_close(grad, want[rank])


def _raise_unrelated(comm):
    if comm.rank == 1:
        F.all_gather(comm, torch.zeros(2), 0, dim=3)
    return F.all_reduce(comm, torch.ones(2), 0)


def test_an_error_on_one_rank_fails_the_run_instead_of_hanging(mesh3):
    with pytest.raises(RankError, match="dim=3 out of range"):
        mesh3.run(_raise_unrelated, timeout=10.0)


# --------------------------------------------------------------------------- collective specs


SPEC = """\
name: demo
implementation: shardverify.features.algorithms.implementations.naive_all_reduce
reference: all_reduce
group_sizes: [2]
dtypes: [float32]
shapes: [[3]]
"""


@pytest.mark.parametrize("change, line, words", [
    ("reference: all_reduce", "reference: allreduce", ["unknown reference 'allreduce'"]),
    ("shapes: [[3]]", "shapes: [[3]]\nparams: {op: [max]}", ["does not bind", "op"]),
    ("reference: all_reduce", "reference: all_to_all", ["needs the parameter 'split_dim'"]),
    ("group_sizes: [2]", "group_sizes: [1]", ["group size >= 2"]),
    ("implementation: shardverify.features.algorithms.implementations.naive_all_reduce",
     "implementation: shardverify.features.algorithms.implementations.nope", ["has no attribute 'nope'"]),
])
def test_collective_spec_errors_name_file_line_and_problem(change, line, words):
    from shardverify.spec.loader import load_yaml_text
    from shardverify.features.algorithms.spec import parse_collective_spec
    from shardverify.errors import SpecError

    text = SPEC.replace(change, line)
    assert text != SPEC
    with pytest.raises(SpecError) as info:
        parse_collective_spec(load_yaml_text(text, "demo.yaml"))
    message = str(info.value)
    assert message.startswith("demo.yaml:"), message
    for word in words:
        assert word in message, message


def test_collective_spec_grid_keeps_impossible_points_as_error_cases():
    from shardverify.spec.loader import load_yaml_text
    from shardverify.features.algorithms.spec import case_id, parse_collective_spec

    text = SPEC.replace("naive_all_reduce", "ring_all_reduce").replace("shapes: [[3]]", "shapes: [[3], []]")
    text = text.replace("reference: all_reduce", "reference: all_reduce\nmeshes: [{shape: [2, 2], axes: [1, 0]}]")
    spec = parse_collective_spec(load_yaml_text(text, "demo.yaml"))
    assert [case_id(c) for c in spec.cases()] == [
        "g2-float32-3", "g2-float32-0d", "m2x2a10-float32-3", "m2x2a10-float32-0d"]
