"""Test data that can tell layouts apart.

A wrong layout hands a rank another rank's block. The check sees it only if the two blocks
hold different values: a bool mask of shape [4, 1] on 4 ranks gives each rank one element, and
two ranks' elements are equal half the time, so a strategy that swaps the mask's shard order
(S10 for S01) passes by coincidence on one draw and fails on another.

So before a case is checked on a mesh, every operand of the op (its values as the reference
computes them, predecessors included) is split into the blocks of every layout the mesh can
give it: each mesh axis on one dim or none, a dim's axes in every order, cut as DTensor cuts
(uneven blocks included). Every pair of blocks of one split of the same shape must differ. Where one draw leaves a pair equal (low-entropy dtypes, one-element blocks, ids
drawn from a small range), further seeds are added until every pair differs in at least one of
them, and the case is checked under each; where even :data:`MAX_SEEDS` seeds cannot separate a
pair, that is said in the result. Floating operands drawn from a normal distribution separate
on the first seed; nothing is added for them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from dataclasses import dataclass

import torch

from shardverify.sharding.blocks import nested_block
from shardverify.spec.case import OpCase, cached
from shardverify.verify.reference import reference

__all__ = ["MAX_SEEDS", "Seeds", "splits", "equal_pairs", "distinguishing_seeds"]

#: seeds tried, the case's own first, before a pair of equal blocks is reported as inseparable
MAX_SEEDS = 8

_LOCK = threading.Lock()
_SEEDS: dict = {}


@dataclass(frozen=True)
class Seeds:
    """The seeds a case is checked under on one mesh, and what could not be told apart."""

    seeds: tuple[int, ...]
    reasons: tuple[str, ...] = ()     # why more than one seed was needed (operand, shape, split)
    inseparable: tuple[str, ...] = ()  # block pairs equal under every seed tried

    def note(self) -> str:
        """"" for one seed; otherwise a sentence for the check's result."""
        parts = []
        if len(self.seeds) > 1:
            parts.append(f"checked under seeds {', '.join(map(str, self.seeds))} so that every two blocks a layout "
                         f"gives differ ({'; '.join(self.reasons[:3])})")
        if self.inseparable:
            parts.append(f"blocks equal under all {len(self.seeds)} seeds, a wrong layout swapping them would pass: "
                         f"{'; '.join(self.inseparable[:3])}")
        return "; ".join(parts)


Split = tuple[tuple[int, ...], ...]     # per dim, the sizes of the mesh axes cutting it, in order


def splits(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[Split]:
    """Each distinct way a layout on ``mesh_shape`` can cut a tensor of ``shape``: every mesh
    axis (of two or more ranks) on one dim (of two or more elements) or none, a dim's axes in every order (``S01`` and
    ``S10`` cut a dim of 4 over (2, 3) into other blocks), sizes that do not divide cut as
    DTensor cuts them, more than one block in all."""
    ndim = len(shape)
    found = set()
    for assign in itertools.product(range(ndim + 1), repeat=len(mesh_shape)):
        groups: list[list[int]] = [[] for _ in range(ndim)]
        for axis, dim in enumerate(assign):
            if dim < ndim and mesh_shape[axis] > 1 and shape[dim] > 1:
                groups[dim].append(mesh_shape[axis])
        for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
            if math.prod(math.prod(o) for o in orders) > 1:
                found.add(tuple(tuple(o) for o in orders))
    return sorted(found)


def _blocks(tensor: torch.Tensor, split: Split) -> list[torch.Tensor]:
    """Every block of ``split`` (in row-major order of their coordinates), as views."""
    per_dim = [[nested_block(n, list(zip(sizes, coord))) for coord in itertools.product(*(range(k) for k in sizes))]
               for n, sizes in zip(tensor.shape, split)]
    return [tensor[tuple(slice(start, start + length) for start, length in block)]
            for block in itertools.product(*per_dim)]


def equal_pairs(tensor: torch.Tensor, split) -> set[tuple[int, int]]:
    """The pairs of blocks (by index) of ``split`` (per dim a count, or the axis sizes cutting
    it in order) that hold the same values, flattened; empty blocks never pair up.  Blocks are
    grouped by their size and first element, and only blocks sharing both are compared whole
    (drawn values rarely share a first element, so most blocks are never copied)."""
    split = tuple((k,) if isinstance(k, int) else tuple(k) for k in split)
    tensor = _nan_as_inf(tensor.detach().cpu())   # NaN equals NaN here
    groups: dict[tuple, list[list]] = {}   # (numel, first element) -> classes of equal blocks
    for index, block in enumerate(_blocks(tensor, split)):
        if not block.numel():      # empty blocks (uneven cuts) hold nothing to swap
            continue
        classes = groups.setdefault((block.numel(), block[(0,) * block.dim()].item()), [])
        for members in classes:
            if torch.equal(block.reshape(-1), members[0][1].reshape(-1)):
                members.append((index, block))
                break
        else:
            classes.append([(index, block)])
    return {(i, j) for classes in groups.values() for members in classes if len(members) > 1
            for (i, _), (j, _) in itertools.combinations(members, 2)}


#: elements of a tensor tested for distinct values by a sort at most (float64 at 8,192 elements: 0.1 ms,
#: about what cutting it into every split's blocks costs; at 131,072: 11 ms against 1)
_SORTED_MOST = 1 << 13


def _all_distinct(tensor: torch.Tensor) -> bool:
    """Whether no two elements of a real ``tensor`` are equal (NaN equal to NaN, as
    :func:`equal_pairs` has it): then no two blocks of any split hold the same values (the blocks
    of a split are disjoint, so two equal ones would repeat every value they hold), and no split
    need be cut.  A drawn floating operand is the common case: one sort instead of a pass over
    every block of every split, for a tensor small enough that its sort costs less than those
    passes (a sort grows with the elements, the passes with the blocks)."""
    if tensor.is_complex() or tensor.numel() > _SORTED_MOST:
        return False
    flat = _nan_as_inf(tensor.detach().cpu()).reshape(-1)
    return int(torch.unique(flat).numel()) == flat.numel()


def _nan_as_inf(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with each NaN made inf, so that NaNs compare equal (torch.equal and unique hold them unequal)."""
    if tensor.is_floating_point() and bool(tensor.isnan().any()):
        return torch.where(tensor.isnan(), torch.full_like(tensor, float("inf")), tensor)
    return tensor


def _open_pairs(case: OpCase, mesh_shape: tuple[int, ...]) -> dict[tuple[str, Split], set]:
    ref = reference(case, None, torch.device("cpu"))
    found = {}
    for loc, value in ref.values.items():
        if value.dim() == 0 or _all_distinct(value):
            continue
        for split in splits(tuple(value.shape), mesh_shape):
            pairs = equal_pairs(value, split)
            if pairs:
                found[(f"{loc} {str(value.dtype).removeprefix('torch.')}{list(value.shape)}", split)] = pairs
    return found


def _describe(key: tuple[str, Split], pairs: set) -> str:
    (operand, split), (i, j) = key, min(pairs)
    cut = "x".join("*".join(map(str, sizes)) if sizes else "1" for sizes in split)
    return f"{operand} in {cut} blocks: {len(pairs)} equal pair(s), e.g. blocks {i} and {j}"


def distinguishing_seeds(case: OpCase, mesh_shape: tuple[int, ...]) -> Seeds:
    """The case's seed, and as many more (of the next ones, up to MAX_SEEDS in all) as it takes
    for every pair of blocks of every operand split to differ under one of them."""
    key = (case, tuple(mesh_shape))
    with _LOCK:
        return cached(_SEEDS, key, lambda: _search(case, tuple(mesh_shape)))


def _search(case: OpCase, mesh_shape: tuple[int, ...]) -> Seeds:
    open_pairs = _open_pairs(case, mesh_shape)
    if not open_pairs:
        return Seeds((case.seed,))
    reasons = tuple(_describe(k, v) for k, v in open_pairs.items())
    seeds = [case.seed]
    for seed in range(case.seed + 1, case.seed + 4 * MAX_SEEDS):
        if not open_pairs or len(seeds) == MAX_SEEDS:
            break
        try:
            found = _open_pairs(dataclasses.replace(case, seed=seed), mesh_shape)
        except Exception:  # noqa: BLE001 - the op refuses this seed's draw (an integer remainder by zero): not one to use
            continue
        narrowed = {k: pairs & found.get(k, set()) for k, pairs in open_pairs.items()}
        if narrowed != open_pairs:    # this seed separates a pair no earlier one did
            seeds.append(seed)
            open_pairs = {k: v for k, v in narrowed.items() if v}
    return Seeds(tuple(seeds), reasons, tuple(_describe(k, v) for k, v in open_pairs.items()))
