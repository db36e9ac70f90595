"""Shrink a failing DTensor example to a minimal one that fails the same way.

A bug report is read by a maintainer: the smaller its example, the sooner the cause shows. An
:class:`Example` is a mesh, named sizes (the operands' shapes are a function of them, so a
convolution's in-channels shrink in the input and the weight together), each operand's
placement per mesh axis as short text (``R``, ``S(1)``, ``_S(1, sf=2)``, ``P(sum)``) and
which optional operands are present. :func:`shrink` tries smaller neighbours one at a time
(a mesh axis dropped or made smaller, an operand dropped, a placement made ``R``, a private
``_StridedShard`` made the public ``Shard``, a size halved or decreased) and keeps the first
that still fails *the same way* (silent stays silent, a raise stays the same exception type),
until no neighbour does: a local minimum, found in a few dozen runs.

:func:`outcome` is the judge: it runs a :class:`Family` (the call, its reference, its operands'
shapes) on DTensor in this process (every rank under ``LocalTensorMode`` on a fake process
group, :func:`shardverify.features.dtensor.world.local_world`) with public routes where they exist:
every operand is placed with ``distribute_tensor`` (``P(sum)`` by a ``redistribute`` from
``R``; a ``_StridedShard``, which no public route names, by ``DTensor.from_local`` of blocks cut
here), checked to read back as placed, and the result read with ``full_tensor()``, the most
common consumer; a backward family differentiates through that ``full_tensor()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Example", "Family", "Outcome", "Shrunk", "outcome", "shrink", "neighbours"]

_STRIDED = re.compile(r"_S\((\d+), sf=(\d+)\)$")
_SHARD = re.compile(r"S\((\d+)\)$")


@dataclass(frozen=True)
class Example:
    """One DTensor call to try: mesh, named sizes, placements per operand, optional operands."""

    mesh: tuple[int, ...]
    sizes: tuple[tuple[str, int], ...]                 # (name, size): the family's shapes read them
    placements: tuple[tuple[str, ...], ...]            # per operand, one text per mesh axis
    present: tuple[bool, ...] = ()                     # per operand (empty: every operand present)

    def size(self, name: str) -> int:
        return dict(self.sizes)[name]

    def is_present(self, index: int) -> bool:
        return not self.present or self.present[index]

    @property
    def weight(self) -> tuple:
        """What "smaller" means, compared lexicographically: ranks, mesh axes, operands, private
        placements, non-R placements, elements."""
        import math

        ranks = math.prod(self.mesh)
        present = [p for i, p in enumerate(self.placements) if self.is_present(i)]
        private = sum(int(_STRIDED.match(text).group(2)) for p in present for text in p if _STRIDED.match(text))
        placed = sum(text != "R" for p in present for text in p)
        return (ranks, len(self.mesh), len(present), private, placed, sum(s for _, s in self.sizes))

    def __str__(self) -> str:
        sizes = ", ".join(f"{n}={s}" for n, s in self.sizes)
        ops = "; ".join("[" + ", ".join(p) + "]" if self.is_present(i) else "absent"
                        for i, p in enumerate(self.placements))
        return f"mesh {self.mesh}, {sizes}: {ops}"


@dataclass(frozen=True)
class Family:
    """A call and how to build its operands from an example's sizes.

    ``shapes(sizes)`` gives each operand's global shape (None for an operand that is absent);
    ``call(*operands)`` is the op on plain tensors and on DTensors alike (absent operands are
    passed as None); ``backward``: judge the gradient of every float operand too (through the
    output's ``full_tensor()``); ``valid(sizes)``: whether the sizes make a legal call (by
    default: the reference runs)."""

    name: str
    shapes: Callable[[dict], tuple]
    call: Callable
    backward: bool = False
    integer: tuple[int, ...] = ()                      # operands holding ids (0 <= id < their "high")
    high: str = ""                                     # the size naming the ids' bound
    message: str = ""                                  # a raise must match this (re.fullmatch) to count


@dataclass(frozen=True)
class Outcome:
    """``kind``: "right", "silent" (wrong values or shape, nothing raised), "raises" (with
    ``error``: the exception's type name), or "invalid" (the example is not a legal call)."""

    kind: str
    error: str = ""
    detail: str = ""

    def same_failure(self, other: "Outcome") -> bool:
        return self.kind == other.kind and self.kind in ("silent", "raises") and self.error == other.error


@dataclass(frozen=True)
class Shrunk:
    start: Example
    example: Example
    outcome: Outcome
    tried: int          # candidates run
    steps: int          # candidates kept


def placement(text: str):
    """The DTensor placement named by ``text`` (``R``, ``S(d)``, ``_S(d, sf=k)``, ``P(sum)``)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if text == "R":
        return Replicate()
    if text.startswith("P("):
        return Partial(text[2:-1])
    found = _STRIDED.match(text)
    if found:
        return _StridedShard(int(found.group(1)), split_factor=int(found.group(2)))
    found = _SHARD.match(text)
    if found:
        return Shard(int(found.group(1)))
    raise ValueError(f"placement {text!r}: expected R, S(d), _S(d, sf=k) or P(op)")


def _operands(family: Family, example: Example, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    sizes = dict(example.sizes)
    tensors = []
    for index, shape in enumerate(family.shapes(sizes)):
        if shape is None or not example.is_present(index):
            tensors.append(None)
        elif index in family.integer:
            tensors.append(torch.randint(0, sizes[family.high], tuple(shape), generator=generator))
        else:
            tensors.append(torch.randn(tuple(shape), dtype=torch.float64, generator=generator))
    return tensors


def _same(per_rank: dict, want) -> bool:
    import torch

    return all(v.shape == want.shape and torch.allclose(v, want, rtol=1e-7, atol=1e-9) for v in per_rank.values())


def _ranks(value) -> dict:
    return dict(value._local_tensors) if hasattr(value, "_local_tensors") else {0: value}


def outcome(family: Family, example: Example) -> Outcome:
    """Runs ``example`` on DTensor (every rank in this process) against one device."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from shardverify.features.dtensor.world import local_world

    try:
        tensors = _operands(family, example)
    except (RuntimeError, ValueError, KeyError):
        return Outcome("invalid", detail="the sizes build no operands")
    grads_of = [i for i, t in enumerate(tensors) if family.backward and t is not None and t.is_floating_point()]
    leaves = [t.clone().requires_grad_(i in grads_of) if t is not None else None for i, t in enumerate(tensors)]
    try:
        want = family.call(*leaves)
        seed = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(1))
        want_grads = (torch.autograd.grad(want, [leaves[i] for i in grads_of], seed) if grads_of else ())
    except Exception as exc:  # noqa: BLE001 - sizes the op refuses on one device: not an example
        return Outcome("invalid", detail=f"{type(exc).__name__}: {exc}")
    _clear_sharding_prop_cache()
    started = False
    try:
        with local_world(example.mesh) as (mesh, mode), mode:
            placed = []
            for index, tensor in enumerate(tensors):
                if tensor is None:
                    placed.append(None)
                    continue
                texts = example.placements[index]
                partial = [i for i, t in enumerate(texts) if t.startswith("P(")]
                first = [Replicate() if i in partial else placement(t) for i, t in enumerate(texts)]
                value = (_strided(tensor, mesh, example.mesh, first) if any(t.startswith("_S") for t in texts)
                         else distribute_tensor(tensor, mesh, first))
                if partial:
                    value = value.redistribute(mesh, [placement(t) for t in texts])
                elif not _same(_ranks(value.full_tensor()), tensor):
                    # the placement does not read back as the tensor placed: no example of anything
                    return Outcome("invalid", detail=f"operand {index} does not read back as placed")
                placed.append(value.requires_grad_(index in grads_of) if index in grads_of else value)
            started = True
            got = family.call(*placed)
            full = got.full_tensor()
            if not _same(_ranks(full), want.detach()):
                return Outcome("silent", detail="the output")
            if grads_of:
                full.backward(seed)
                for index, want_grad in zip(grads_of, want_grads):
                    grad = placed[index].grad
                    if grad is None or not _same(_ranks(grad.full_tensor()), want_grad):
                        return Outcome("silent", detail=f"the gradient of operand {index}")
    except Exception as exc:  # noqa: BLE001 - a raise is an outcome too
        if not started:
            return Outcome("invalid", detail=f"placing the operands raises {type(exc).__name__}: {exc}")
        return Outcome("raises", type(exc).__name__, str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "")
    finally:
        _clear_sharding_prop_cache()
    return Outcome("right")


def _strided(tensor, mesh, mesh_shape: tuple[int, ...], placements):
    """A DTensor holding ``tensor`` as ``placements`` (with a ``_StridedShard``) on every rank:
    each rank's block cut here, axis by axis left to right (a ``_StridedShard(d, sf)`` takes
    its piece of each of ``sf`` chunks), then ``DTensor.from_local`` (``distribute_tensor``
    does not cut a ``_StridedShard`` right under ``LocalTensorMode`` on torch 2.13)."""
    import itertools

    import torch
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    blocks = {}
    for rank, coords in enumerate(itertools.product(*(range(m) for m in mesh_shape))):
        block = tensor
        for axis, p in enumerate(placements):
            size = mesh_shape[axis]
            if isinstance(p, _StridedShard):
                chunks = block.chunk(p.split_factor, p.dim)
                if len(chunks) != p.split_factor or any(c.shape[p.dim] % size for c in chunks):
                    raise ValueError("a _StridedShard of uneven pieces")
                block = torch.cat([c.chunk(size, p.dim)[coords[axis]] for c in chunks], p.dim)
            elif isinstance(p, Shard):
                if block.shape[p.dim] % size:
                    raise ValueError("an uneven shard next to a _StridedShard")
                block = block.chunk(size, p.dim)[coords[axis]]
        blocks[rank] = block.clone()
    return DTensor.from_local(LocalTensor(blocks), mesh, placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def _axis_dropped(example: Example, axis: int) -> Example:
    mesh = example.mesh[:axis] + example.mesh[axis + 1:]
    placements = tuple(p[:axis] + p[axis + 1:] for p in example.placements)
    return dataclasses.replace(example, mesh=mesh, placements=placements)


def neighbours(example: Example) -> list[Example]:
    """Every one-step simplification of ``example``, smallest first."""
    found: list[Example] = []
    for axis in range(len(example.mesh)):
        if len(example.mesh) > 1:
            found.append(_axis_dropped(example, axis))
        for smaller in sorted({2, example.mesh[axis] - 1} - {example.mesh[axis]}):
            if smaller < 2 or smaller > example.mesh[axis]:
                continue
            mesh = example.mesh[:axis] + (smaller,) + example.mesh[axis + 1:]
            found.append(dataclasses.replace(example, mesh=mesh))
            # the blocks kept as they were: every size the axis divides scaled with it
            old = example.mesh[axis]
            scaled = tuple((n, s * smaller // old if s % old == 0 else s) for n, s in example.sizes)
            if scaled != example.sizes:
                found.append(dataclasses.replace(example, mesh=mesh, sizes=scaled))
    for index in range(len(example.placements)):
        if example.present and example.present[index]:
            found.append(dataclasses.replace(example, present=example.present[:index] + (False,)
                                             + example.present[index + 1:]))
    for index, texts in enumerate(example.placements):
        for axis, text in enumerate(texts):
            simpler = ["R"]
            strided = _STRIDED.match(text)
            if strided:
                simpler.insert(0, f"S({strided.group(1)})")
                simpler[1:1] = [f"_S({strided.group(1)}, sf={k})" for k in range(2, int(strided.group(2)))]
            for other in simpler:
                changed = texts[:axis] + (other,) + texts[axis + 1:]
                found.append(dataclasses.replace(example, placements=example.placements[:index] + (changed,)
                                                 + example.placements[index + 1:]))
    for position, (name, size) in enumerate(example.sizes):
        for smaller in sorted({size // 2, size - 1} - {0, size}):
            sizes = example.sizes[:position] + ((name, smaller),) + example.sizes[position + 1:]
            found.append(dataclasses.replace(example, sizes=sizes))
    return sorted(found, key=lambda e: e.weight)


def shrink(family: Family, start: Example, *, judge: Callable[[Family, Example], Outcome] = outcome,
           max_tries: int = 400) -> Shrunk:
    """The smallest example reached from ``start`` by one-step simplifications that each fail
    as ``start`` does (greedy: the first such neighbour is taken, then its neighbours are
    tried). ``start`` must fail (silent or raising); ``judge`` runs an example."""
    first = judge(family, start)
    if first.kind not in ("silent", "raises"):
        raise ValueError(f"{family.name}: the starting example does not fail ({first.kind}): {start}")
    current, current_outcome, tried, steps = start, first, 0, 0
    seen = {start}
    progress = True
    while progress and tried < max_tries:
        progress = False
        for candidate in neighbours(current):
            if candidate in seen or candidate.weight >= current.weight:
                continue
            seen.add(candidate)
            tried += 1
            found = judge(family, candidate)
            if found.same_failure(first) and (not family.message or re.fullmatch(family.message, found.detail)):
                current, current_outcome, steps, progress = candidate, found, steps + 1, True
                break
            if tried >= max_tries:
                break
    return Shrunk(start, current, current_outcome, tried, steps)
