"""A rule written for one form of a call, read at the call's other forms (the einsum sources'
``first_dim_param`` and ``zero_dim_as_1d``). Each rewrites the equation for one call's shapes;
the engine then binds it like any written one, so every form is the same rule's.

Along a dim: a rule written along dim 0 has each term that the dim shapes written as that dim,
then ``...`` (``n ... -> (n r) ...``); at ``dim=1`` of a 3-d call the dim moves after one of
the ellipsis's dims (``... n t -> ... (n r) t``). ``dim=None`` is torch's flattened call (along
dim 0 of the input flattened): the input's term reads its dims as the dim's factor followed by
the others, and a 1-d output holds them where it holds that factor.

A 0-d tensor where torch's dim-taking ops read one dim of one element (``index_select``,
``index_add``): the dims its term gives it hold one element each, so it holds no factor, and a
factor seen nowhere else as a dim of its own is of size 1 (a compound holding it is split by the
others)."""

from __future__ import annotations

from collections.abc import Sequence

from shardverify.errors import InvalidArgument
from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.notation import ELLIPSIS, OPTIONAL, Dim, Equation, Term

__all__ = ["AFTER", "leading", "along_dim", "zero_dim_as_1d"]

#: the ellipsis's dims after a moved dim, named alike in every term ("_b": rule.bind's prefix for
#: the ellipsis's dims, which errors call "a dim that '...' stands for")
AFTER = "_bt"

Shape = tuple[int, ...]


def leading(term: Term) -> bool:
    """Is ``term`` written as one dim, then ``...`` (``n ...``, ``(n r) ...``)?"""
    return len(term) == 2 and term[1] == (ELLIPSIS,) and term[0] != (ELLIPSIS,)


def _split(eq: Equation, terms: Sequence[Term]) -> Equation:
    return Equation(tuple(terms[:len(eq.inputs)]), tuple(terms[len(eq.inputs):]))


def along_dim(eq: Equation, shapes: Sequence[Shape], value: object, param: str) -> tuple[Equation, frozenset[str]]:
    """``eq`` (written along dim 0) along the dim ``value`` names, counted in the first tensor
    whose term is written ``X ...``; and the factors of the ellipsis's dims it names itself.
    ``shapes``: every tensor's, inputs then outputs, one per term."""
    terms = eq.inputs + eq.outputs
    led = [k for k, term in enumerate(terms) if leading(term)]
    if not led:
        return eq, frozenset()
    rank = len(shapes[led[0]])
    if value is None:
        return _flattened(eq, shapes, led, param)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"call parameter {param!r} must be one dim (an int) or None, got {value!r}")
    (dim,) = normalize_dims(value, rank, param)      # a 0-d tensor takes dim 0 (or -1) as its one dim
    if dim == 0:
        return eq, frozenset()                       # as written
    after = tuple((f"{AFTER}{i}",) for i in range(rank - 1 - dim))
    moved = [((ELLIPSIS,), term[0]) + after if leading(term) else term for term in terms]
    return _split(eq, moved), frozenset(f for (f,) in after)


def _flattened(eq: Equation, shapes: Sequence[Shape], led: list[int], param: str) -> tuple[Equation, frozenset[str]]:
    """``dim=None``: along dim 0 of the flattened input. The first leading tensor's term ``f ...``
    reads its R dims as ``f`` then R - 1 of its own; a leading term of a 1-d tensor holds the
    flat dim, ``f`` there standing for all of them in order (``(f r) ...`` -> ``(f t0 r)``)."""
    rank = len(shapes[led[0]])
    if rank <= 1:
        return eq, frozenset()                       # a 1-d tensor is its own flat form
    factor = (eq.inputs + eq.outputs)[led[0]][0]
    if len(factor) != 1:
        raise InvalidArgument(f"call parameter {param!r} is None (the call runs on the flattened tensor), which the "
                              f"rule {eq} describes only where the flattened dim is one factor")
    rest = tuple(f"{AFTER}{i}" for i in range(rank - 1))
    terms = list(eq.inputs + eq.outputs)
    for k in led:
        term, size = terms[k], len(shapes[k])
        if size == rank and term[0] == factor:
            terms[k] = (factor,) + tuple((f,) for f in rest)
        elif size == 1:
            flat: Dim = tuple(g for f in term[0] for g in ((f,) + rest if (f,) == factor else (f,)))
            terms[k] = (flat,)
        else:
            raise InvalidArgument(f"call parameter {param!r} is None (the call runs on the flattened tensor): a tensor "
                                  f"of {size} dim(s) is neither the input of {rank} dims nor a flat one, so the rule "
                                  f"{eq} does not describe it")
    return _split(eq, terms), frozenset(rest)


def _required(term: Term) -> int:
    """The dims a tensor must have for ``term``: ``...`` and optional dims aside."""
    return sum(1 for dim in term if dim != (ELLIPSIS,) and not (len(dim) == 1 and dim[0].endswith(OPTIONAL)))


def _factors(term: Term) -> set[str]:
    return {f.removesuffix(OPTIONAL) for dim in term for f in dim if f != ELLIPSIS}


def zero_dim_as_1d(eq: Equation, shapes: Sequence[Shape]) -> tuple[Equation, dict[str, int]]:
    """``eq`` with each 0-d tensor whose term describes one dim read as one element: its term
    holds no dim; and the size (1) of each factor only such terms and compounds hold."""
    terms = list(eq.inputs + eq.outputs)
    scalar = [k for k, (term, shape) in enumerate(zip(terms, shapes)) if not shape and _required(term) == 1]
    if not scalar:
        return eq, {}
    held = {f for k, term in enumerate(terms) if k not in scalar for dim in term if len(dim) == 1
            for f in _factors((dim,))}
    ones = {f: 1 for k in scalar for f in _factors(terms[k]) - held}
    for k in scalar:
        terms[k] = ()
    return _split(eq, terms), ones
