"""Equations a spec does not write out, derived from the call: pointwise broadcasting,
reductions over a ``dim`` parameter, views (reshape by shapes, permute, transpose) and
advanced indexing (``x[i, j]``).

Each returns an :class:`Equation` plus the factors it knows must stay whole; the generator
binds it to the shapes like a written equation, so every rule family shares one engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardverify.errors import InvalidArgument, StrategyError
from shardverify.strategies.rules.notation import Dim, Equation, Term

__all__ = ["normalize_dims", "pointwise", "whole_tensors", "reduction", "reshape", "permute", "advanced_index",
           "indexed_factor"]

Shape = tuple[int, ...]


def normalize_dims(value: object, ndim: int, what: str = "dim") -> tuple[int, ...]:
    """Reduced dims as sorted non-negative ints; None or () mean every dim."""
    if value is None:
        return tuple(range(ndim))
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)  # type: ignore[arg-type]
    except TypeError:
        raise StrategyError(f"{what}={value!r} must be an int, a sequence of ints or None") from None
    if not items:
        return tuple(range(ndim))
    dims = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise StrategyError(f"{what}={value!r} is not a dim or a list of dims (it holds a {type(item).__name__}): "
                                f"the call is another overload of the op, passing another argument where the spec "
                                f"reads {what}; only the overload taking {what} is served")
        if not -max(ndim, 1) <= item < max(ndim, 1):
            raise StrategyError(f"{what}={value!r}: dim {item} is out of range for a {ndim}-D input")
        dims.append(item % max(ndim, 1))
    if len(set(dims)) != len(dims):
        raise StrategyError(f"{what}={value!r} names a dim twice")
    return tuple(sorted(dims))


def pointwise(inputs: Sequence[Shape], outputs: Sequence[Shape]) -> tuple[Equation, set[str]]:
    """Every tensor aligned from the right with the first output (broadcasting). A dim whose
    size differs from the first output's (and is not 1) gets a factor of its own, kept whole:
    the cat/split dim."""
    rank = len(outputs[0])
    base = outputs[0]
    whole: set[str] = set()

    def term(shape: Shape, label: str) -> Term:
        dims: list[Dim] = []
        offset = rank - len(shape)
        if offset < 0:
            raise InvalidArgument(f"{label} {shape} has more dims than the output {base}")
        for i, size in enumerate(shape):
            j = i + offset
            if size == base[j] or size == 1:
                dims.append((f"d{j}",) if size == base[j] else ())
            else:
                name = f"{label}_{j}"
                whole.add(name)
                dims.append((name,))
        return tuple(dims)

    eq = Equation(tuple(term(s, f"in{i}") for i, s in enumerate(inputs)),
                  tuple(term(s, f"out{i}") for i, s in enumerate(outputs)))
    return eq, whole


def whole_tensors(inputs: Sequence[Shape], outputs: Sequence[Shape]) -> tuple[Equation, set[str]]:
    """Every dim of every tensor a factor of its own (a size-1 dim none), all of them whole."""
    def term(shape: Shape, label: str) -> Term:
        return tuple((f"{label}_{j}",) if size != 1 else () for j, size in enumerate(shape))

    eq = Equation(tuple(term(s, f"in{i}") for i, s in enumerate(inputs)),
                  tuple(term(s, f"out{i}") for i, s in enumerate(outputs)))
    return eq, {f for t in eq.inputs + eq.outputs for dim in t for f in dim}


def indexed_factor(dim: int) -> str:
    """The factor of input dim ``dim`` when an index tensor indexes it."""
    return f"x{dim}"


def advanced_index(input_shape: Shape, indices: Sequence[tuple[int, Shape]], output_shape: Shape
                   ) -> tuple[Equation, set[str]]:
    """``x[i0, i1]`` (``aten.index.Tensor``): ``indices`` holds (input dim, shape) of each index
    tensor. The index tensors broadcast against each other into the block ``B`` (factors
    ``b<j>``, an index dim of size 1 holding none), which replaces the indexed dims in the
    output: in their place when they are adjacent, in front otherwise, as torch places it.
    Every other input dim passes its factor to the output. An indexed dim holds a factor of
    its own (:func:`indexed_factor`) that no output holds: its ids index it, and sharding it
    masks the ids a rank does not hold (a partial sum). It stays whole where a rank's mask
    would not line up with the output's leading dims: an index with fewer dims than ``B``, or
    ``B`` not in front."""
    if not indices:
        raise InvalidArgument("advanced indexing needs at least one index tensor")
    dims = [d for d, _ in indices]
    if len(set(dims)) != len(dims) or any(not 0 <= d < len(input_shape) for d in dims):
        raise InvalidArgument(f"index tensors at dims {dims} do not index distinct dims of an input of shape "
                              f"{tuple(input_shape)}")
    try:
        block = tuple(torch.broadcast_shapes(*(shape for _, shape in indices)))
    except RuntimeError:
        raise InvalidArgument(f"index shapes {[list(s) for _, s in indices]} do not broadcast") from None
    rest = [d for d in range(len(input_shape)) if d not in dims]
    adjacent = sorted(dims) == list(range(min(dims), max(dims) + 1))
    front = min(dims) if adjacent else 0
    out_dims: list[Dim] = [(f"d{d}",) if input_shape[d] != 1 else () for d in rest]
    b_dims: list[Dim] = [(f"b{j}",) if size != 1 else () for j, size in enumerate(block)]
    out_term = tuple(out_dims[:front] + b_dims + out_dims[front:])
    sizes = [input_shape[d] for d in rest]
    expected = tuple(sizes[:front]) + block + tuple(sizes[front:])
    if tuple(output_shape) != expected:
        raise InvalidArgument(f"indexing an input of shape {tuple(input_shape)} at dims {dims} gives "
                              f"{list(expected)}, the call's output is {list(output_shape)}")
    in_term = tuple((indexed_factor(d),) if d in dims else (f"d{d}",) if input_shape[d] != 1 else ()
                    for d in range(len(input_shape)))
    index_terms = tuple(tuple(b_dims[len(block) - len(shape) + i] if size != 1 else ()
                              for i, size in enumerate(shape)) for _, shape in indices)
    whole = set()
    if front != 0 or any(len(shape) != len(block) for _, shape in indices):
        whole = {indexed_factor(d) for d in dims}
    return Equation((in_term,) + index_terms, (out_term,)), whole


def reduction(input_shape: Shape, output_ranks: Sequence[int], dims: tuple[int, ...], keepdim: bool) -> Equation:
    """``d0 d1 d2 -> d0 d2`` (or ``d0 1 d2`` with keepdim) for each output; an output of more
    dims ends in dims of its own (``e0``, ...: the diagonal torch.diagonal appends), which no
    input holds."""
    inp = tuple((f"d{i}",) for i in range(len(input_shape)))
    out = tuple(() if i in dims else (f"d{i}",) for i in range(len(input_shape)) if keepdim or i not in dims)
    return Equation((inp,), tuple(out + tuple((f"e{j}",) for j in range(rank - len(out))) for rank in output_ranks))


def permute(rank: int, order: Sequence[int]) -> Equation:
    order = [d % rank for d in order] if rank else []
    if sorted(order) != list(range(rank)):
        raise InvalidArgument(f"permutation {list(order)} is not a permutation of {rank} dims")
    inp = tuple((f"d{i}",) for i in range(rank))
    return Equation((inp,), (tuple(inp[d] for d in order),))


def reshape(input_shape: Shape, output_shape: Shape) -> tuple[Equation, set[str], dict[str, int]]:
    """Match the two shapes into groups of equal products. A group of one input dim and
    several output dims (unflatten) or the reverse (flatten) becomes a compound dim; in a group
    many-to-many (8x4 -> 4x8) the leading input and output dims share a leading factor of
    size gcd (a shard of it is the same contiguous block of the flattened group on both
    sides) and every other factor stays whole; size-1 dims hold no factor. Returns the
    equation, the whole factors and the sizes of factors only compounds hold."""
    if math.prod(input_shape) != math.prod(output_shape):
        raise InvalidArgument(f"cannot view {input_shape} as {output_shape}")
    if math.prod(input_shape) == 0:
        return _empty_reshape(input_shape, output_shape)
    ins = [(i, s) for i, s in enumerate(input_shape) if s != 1]
    outs = [(j, s) for j, s in enumerate(output_shape) if s != 1]
    in_term: list[Dim] = [()] * len(input_shape)
    out_term: list[Dim] = [()] * len(output_shape)
    whole: set[str] = set()
    sizes: dict[str, int] = {}
    a = b = 0
    group = 0
    while a < len(ins) or b < len(outs):
        ga, gb = [ins[a]], [outs[b]]
        a, b = a + 1, b + 1
        pa, pb = ga[0][1], gb[0][1]
        while pa != pb:
            if pa < pb:
                ga.append(ins[a]); pa *= ins[a][1]; a += 1          # noqa: E702
            else:
                gb.append(outs[b]); pb *= outs[b][1]; b += 1        # noqa: E702
        names = [f"g{group}_{k}" for k in range(max(len(ga), len(gb)))]
        if len(ga) == 1:
            for (j, _), name in zip(gb, names):
                out_term[j] = (name,)
            in_term[ga[0][0]] = tuple(names[:len(gb)])
        elif len(gb) == 1:
            for (i, _), name in zip(ga, names):
                in_term[i] = (name,)
            out_term[gb[0][0]] = tuple(names[:len(ga)])
        else:
            lead = f"g{group}_lead"
            sizes[lead] = math.gcd(ga[0][1], gb[0][1])
            for side, members, term in (("in", ga, in_term), ("out", gb, out_term)):
                for k, (i, size) in enumerate(members):
                    name = f"g{group}_{side}{k}"
                    if k == 0 and size == sizes[lead]:
                        term[i] = (lead,)
                        continue
                    whole.add(name)
                    if k == 0:
                        term[i] = (lead, name)
                        sizes[name] = size // sizes[lead]
                    else:
                        term[i] = (name,)
        group += 1
    return Equation((tuple(in_term),), (tuple(out_term),)), whole, sizes


def _empty_reshape(input_shape: Shape, output_shape: Shape) -> tuple[Equation, set[str], dict[str, int]]:
    """A view of a tensor with no element (``[4, 0]`` as ``[4, 2, 0, 0, 0]``): sizes cannot be
    matched by products, so only the leading dims the two shapes share before the first empty
    one keep a common factor; every other dim holds a factor of its own, kept whole."""
    lead = 0
    while lead < min(len(input_shape), len(output_shape)) and input_shape[lead] == output_shape[lead] != 0:
        lead += 1
    whole: set[str] = set()

    def term(shape: Shape, side: str) -> Term:
        dims: list[Dim] = []
        for i, size in enumerate(shape):
            if i < lead:
                dims.append((f"d{i}",) if size != 1 else ())
            elif size == 1:
                dims.append(())
            else:
                whole.add(f"{side}{i}")
                dims.append((f"{side}{i}",))
        return tuple(dims)

    return Equation((term(input_shape, "in"),), (term(output_shape, "out"),)), whole, {}
