"""Numerical check of resharding: every (source, target) layout pair of a tensor on a mesh.

Layouts are enumerated exhaustively (each mesh axis unused, partial, or splitting one tensor
dim, in every order on a dim). Pairs are pruned by symmetry: permuting mesh axes of equal
size (with equal alpha/beta) and tensor dims of equal size maps a pair onto another whose
plan is the permuted plan (``plan_reshard`` compares axes and dims only for equality and
reaches a fixpoint independent of iteration order), so one pair per orbit is run.
Every rank runs a chunk of the selected pairs per SPMD call (one check, under the backend's
per-check timeout) and returns what went wrong.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import torch

from shardverify.backends.registry import batch_runner
from shardverify.errors import InvalidArgument, ShardingSpecError
from shardverify.spec.limits import MAX_RESHARD_PAIRS
from shardverify.sharding.mesh import DeviceMesh
from shardverify.collectives.reshard import apply_reshard
from shardverify.sharding.layout import ShapedLayout
from shardverify.sharding.reshard_plan import plan_reshard
from shardverify.sharding.sharding_spec import ShardingSpec

__all__ = ["enumerate_layouts", "layout_bound", "check_pair_limit", "layout_pairs", "pair_count", "ReshardCase", "rank_check_pairs", "check_reshard"]


def layout_bound(mesh_ndim: int, tensor_ndim: int) -> int:
    """How many layouts :func:`enumerate_layouts` can find, computed without enumerating them
    (exact when every size divides): each of c sharding axes goes to one of the dims, the axes of
    a dim in any order (c! * C(c+D-1, D-1) ways), every other axis replicates or is partial."""
    return sum(math.comb(mesh_ndim, c) * 2 ** (mesh_ndim - c) * math.factorial(c) * math.comb(c + tensor_ndim - 1, c)
               for c in range(mesh_ndim + 1))


def check_pair_limit(mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...]) -> None:
    """Refuse, before enumerating anything, a mesh and shape whose layout pairs exceed the
    limit (6 mesh axes give ~10^9 pairs: minutes and gigabytes just to list them)."""
    too_many = MAX_RESHARD_PAIRS.exceeded(layout_bound(len(mesh_shape), len(tensor_shape)) ** 2)
    if too_many:
        raise InvalidArgument(f"resharding a {len(tensor_shape)}-D tensor on mesh {list(mesh_shape)}: up to "
                              f"{too_many}")


def enumerate_layouts(mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...],
                      partial: bool = True) -> list[ShapedLayout]:
    """Every valid layout, partial ones included when ``partial``; a size that does not divide is
    cut DTensor's way (blocks of ceil(n/k), the last ones smaller or empty)."""
    choices = [None, "P", *range(len(tensor_shape))] if partial else [None, *range(len(tensor_shape))]
    found: dict[str, ShapedLayout] = {}
    for assign in itertools.product(choices, repeat=len(mesh_shape)):
        per_dim = {d: [a for a, c in enumerate(assign) if c == d] for d in range(len(tensor_shape))}
        part = tuple(a for a, c in enumerate(assign) if c == "P")
        for orders in itertools.product(*(itertools.permutations(per_dim[d]) for d in per_dim)):
            try:
                spec = ShardingSpec.from_partition(mesh_shape, tensor_shape,
                                                   {d: axes for d, axes in zip(per_dim, orders) if axes})
            except ShardingSpecError:
                continue
            layout = ShapedLayout.of_spec(spec, part)
            found.setdefault(str(layout), layout)
    return list(found.values())


def _permute(layout: ShapedLayout, axis_perm: tuple[int, ...], dim_perm: tuple[int, ...]) -> str:
    """The layout with mesh axis a renamed axis_perm[a] and tensor dim d moved to dim_perm[d]."""
    dims = [()] * len(dim_perm)
    for d, axes in layout.axes.items():
        dims[dim_perm[d]] = tuple(axis_perm[a] for a in axes)
    seq = "[" + ", ".join("S" + "".join(map(str, a)) if a else "R" for a in dims) + "]"
    partial = sorted(axis_perm[a] for a in layout.partial)
    return seq + (" P" + "".join(map(str, partial)) if partial else "")


def _symmetries(mesh: DeviceMesh, tensor_shape: tuple[int, ...]):
    def keeps(perm, values):
        return all(values[p] == values[i] for i, p in enumerate(perm))
    link = [(s, mesh.alpha[i], mesh.beta[i]) for i, s in enumerate(mesh.shape)]
    axis_perms = [p for p in itertools.permutations(range(mesh.ndim)) if keeps(p, link)]
    dim_perms = [p for p in itertools.permutations(range(len(tensor_shape))) if keeps(p, tensor_shape)]
    return list(itertools.product(axis_perms, dim_perms))


def layout_pairs(mesh: DeviceMesh, tensor_shape: tuple[int, ...], prune: bool = True) -> list[tuple[str, str]]:
    """(source, target) pairs as layout strings; with ``prune`` one per symmetry orbit."""
    check_pair_limit(tuple(mesh.shape), tensor_shape)
    layouts = enumerate_layouts(mesh.shape, tensor_shape)
    names = [str(layout) for layout in layouts]   # each named once, not once per pair
    if not prune:
        return [(src, tgt) for src in names for tgt in names]
    group = _symmetries(mesh, tensor_shape)
    images = [[_permute(layout, ap, dp) for ap, dp in group] for layout in layouts]   # g(layout), for each g
    seen, kept = set(), []
    for i, src in enumerate(names):
        for j, tgt in enumerate(names):
            if (src, tgt) not in seen:
                kept.append((src, tgt))
                seen.update(zip(images[i], images[j]))   # the pair's orbit: (g(src), g(tgt)) for each g
    return kept


@dataclass(frozen=True)
class ReshardCase:
    """Pairs to check for one tensor shape on one mesh (picklable for process backends)."""

    mesh_shape: tuple[int, ...]
    tensor_shape: tuple[int, ...]
    pairs: tuple[tuple[str, str], ...]
    seed: int = 0
    first: int = 0   # the index of ``pairs[0]`` among all the pairs checked (it seeds each pair's values)


@dataclass(frozen=True)
class _Prepared:
    """What every rank of a pair shares: layouts, steps, the global tensor and gradient, and
    the random addends of a partial source (drawn once per process, not once per rank)."""

    source: ShapedLayout
    target: ShapedLayout
    steps: tuple
    full: torch.Tensor
    grad: torch.Tensor
    addends: torch.Tensor | None


_PREPARED: dict = {}
_PREPARED_LOCK = threading.Lock()


def _prepare(case: ReshardCase) -> list[_Prepared]:
    with _PREPARED_LOCK:
        if case not in _PREPARED:
            mesh = DeviceMesh(case.mesh_shape)
            items = []
            for index, (src_text, tgt_text) in enumerate(case.pairs, start=case.first):
                src = ShapedLayout.parse(src_text, case.tensor_shape, mesh.shape)
                tgt = ShapedLayout.parse(tgt_text, case.tensor_shape, mesh.shape)
                gen = torch.Generator().manual_seed(case.seed * 100003 + index)
                full = torch.randn(case.tensor_shape, generator=gen, dtype=torch.float64)
                grad = torch.randn(case.tensor_shape, generator=gen, dtype=torch.float64)
                addends = None
                if src.partial:
                    noise = torch.randn((mesh.axes_size(src.partial), *src.local_shape()), generator=gen,
                                        dtype=torch.float64)
                    addends = noise - noise.mean(0, keepdim=True)
                items.append(_Prepared(src, tgt, plan_reshard(src, tgt), full, grad, addends))
            _PREPARED.clear()   # one case at a time is enough
            _PREPARED[case] = items
        return _PREPARED[case]


def _local(item: _Prepared, mesh: DeviceMesh, rank: int) -> torch.Tensor:
    """This rank's source tensor: a partial layout splits the shard into random addends that
    sum to it over the partial axes."""
    layout = item.source
    shard = layout.spec.local_shard(item.full, mesh, rank)
    if not layout.partial:
        return shard.clone()
    n = mesh.axes_size(layout.partial)
    addend = item.addends[mesh.group_index(rank, layout.partial)]   # drawn for the largest block
    return shard / n + addend[tuple(slice(0, size) for size in shard.shape)]


def rank_check_pairs(comm, case: ReshardCase) -> list[str]:
    """Run every pair forward and backward on this rank; return one line per failure."""
    mesh, rank = comm.mesh, comm.rank
    failures = []
    for item in _prepare(case):
        src, tgt = item.source, item.target
        leaf = _local(item, mesh, rank).requires_grad_()
        what = f"{src} -> {tgt} via {', '.join(map(str, item.steps)) or 'nothing'} on rank {rank}"
        try:
            out = apply_reshard(comm, item.steps, leaf)
            value = out.detach()
            if tgt.partial:
                value = comm.all_reduce(value.contiguous(), tgt.partial, "sum")
            expected = tgt.spec.local_shard(item.full, mesh, rank)
            if value.shape != expected.shape or not torch.allclose(value, expected, rtol=1e-10, atol=1e-10):
                failures.append(f"{what}: forward output differs")
                continue
            out.backward(tgt.spec.local_shard(item.grad, mesh, rank).clone())
            if not torch.allclose(leaf.grad, src.spec.local_shard(item.grad, mesh, rank), rtol=1e-10, atol=1e-10):
                failures.append(f"{what}: backward gradient differs")
        except Exception as error:  # noqa: BLE001 - reported with the pair
            failures.append(f"{what}: {type(error).__name__}: {error}")
            break   # the ranks may be out of step after an error; stop here
    return failures


#: pairs per check: a thousand pairs in one check outlasted the 60 s per-check timeout with 8 gloo
#: processes on a loaded 2-core machine; a chunk keeps the timeout about one hang, not the mesh size
CHUNK_PAIRS = 64


def check_reshard(backend, tensor_shape: tuple[int, ...], prune: bool = True, seed: int = 0) -> tuple[int, list[str]]:
    """Check every (pruned) pair on ``backend``'s mesh, CHUNK_PAIRS pairs per check (one batch
    where the backend has ``run_batch``); returns (pairs run, failure lines).  Raises the
    backend's error for the first chunk that failed as a whole (a timeout, a dead rank)."""
    mesh = backend.mesh
    pairs = tuple(layout_pairs(mesh, tuple(tensor_shape), prune))
    chunks = [(ReshardCase(tuple(mesh.shape), tuple(tensor_shape), pairs[first:first + CHUNK_PAIRS], seed, first),)
              for first in range(0, len(pairs), CHUNK_PAIRS)]
    run_batch = batch_runner(backend)
    if run_batch is not None:
        outcomes = run_batch(rank_check_pairs, chunks)
    else:
        outcomes = [backend.run(rank_check_pairs, *chunk) for chunk in chunks]
    failures: set[str] = set()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        failures.update(line for lines in outcome for line in lines)
    return len(pairs), sorted(failures)


def pair_count(mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...], prune: bool = True) -> int:
    return len(layout_pairs(DeviceMesh(mesh_shape), tensor_shape, prune))


