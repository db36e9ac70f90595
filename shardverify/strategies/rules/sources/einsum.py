"""Einsum sources: the factors written out (``einsum: "mk,kn->mn"``, see
:mod:`shardverify.strategies.rules.notation`: one term per tensor operand in declaration order,
absent optional operands dropping theirs, one per output) or held by a call parameter in
torch.einsum's notation (``einsum_param: equation``: one letter per dim, spaces ignored, an
implicit output without ``->``).

With them: ``whole: [k]`` (factors never sharded; ``"..."`` every dim the ellipsis stands for),
``reduce: {k: avg}`` (how a reduced factor combines; default ``reduce_op``, else sum; none =
whole), ``reduce_unheld: sum`` (a factor some outputs hold is reduced by it for the outputs
lacking it, which are then partial: a backward op's weight gradient), ``indices: {input: v}``
(an integer operand holds ids into factor ``v`` of another operand: sharding ``v`` shifts the
ids into each rank's rows and masks the others, a partial sum: vocab-parallel embedding) and
``size_params: {N: n, C: [g, k]}`` (call parameters holding the size of factors, the product of
several, ``"..."`` the ellipsis's: each rank passes its own blocks' size, as native_group_norm's
N, C, HxW, group; one holding a factor seen only inside compound dims, a convolution's groups
in ``(g i)``, also binds that factor's size).

Two keys read a rule written for one form of the call at its others (:mod:`.call_forms`):
``first_dim_param: dim`` (written along dim 0, each term written as one dim then ``...``: that
dim stands for the one the parameter names, the ellipsis for the dims around it; None runs on
the flattened input: repeat_interleave along any dim as ``n ... -> (n r) ...``) and
``zero_dim_as_1d: true`` (a 0-d tensor stands for a 1-d one of one element, as torch's
dim-taking ops read it: index_select and index_add of a 0-d input)."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.strategies.rules.notation import ELLIPSIS, Equation, parse_equation, torch_einsum_equation
from shardverify.strategies.rules.sources.base import (
    KEYS, OPERAND, PARAM, Derived, OptionError, RuleCall, Source, flag, names, opt, pairs, read_op, text)
from shardverify.strategies.rules.sources.call_forms import along_dim, leading, zero_dim_as_1d
from shardverify.strategies.rules.sources.registry import register_source

__all__ = ["Einsum", "EinsumParam"]


def _equation(key: str, value: object) -> Equation:
    try:
        return parse_equation(text(key, value))
    except OptionError:
        raise
    except InvalidArgument as exc:
        raise OptionError(str(exc), key) from None


def _reduce(key: str, value: object) -> tuple[tuple[str, str | None], ...]:
    return tuple((k, read_op(key, v, f"reduce op of factor {k!r}", (k,))) for k, v in
                 pairs(key, value, "factors to ops"))


def _indices(key: str, value: object) -> tuple[tuple[str, str], ...]:
    return tuple((role, str(factor)) for role, factor in pairs(key, value, "operands to factors"))


def _size_params(key: str, value: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found = tuple((param, (held,) if isinstance(held, str) else tuple(held))  # type: ignore[arg-type]
                  for param, held in pairs(key, value, "parameters to factors"))
    for param, held in found:
        if not held or not all(isinstance(f, str) for f in held):
            raise OptionError(f"rule option 'size_params' maps each parameter to a factor or a list of factors, "
                              f"got {value!r}", key, (param,))
    return found


@dataclass(frozen=True)
class _Factors(Source):
    """The keys both einsum sources take: they name the equation's factors."""

    whole: tuple[str, ...] = opt("whole", names, ())
    reduce: tuple[tuple[str, str | None], ...] = opt("reduce", _reduce, ())
    indices: tuple[tuple[str, str], ...] = opt("indices", _indices, (), kind=OPERAND, form=KEYS)
    size_params: tuple[tuple[str, tuple[str, ...]], ...] = opt("size_params", _size_params, (), kind=PARAM,
                                                              form=KEYS)
    reduce_op: str | None = opt("reduce_op", read_op, "sum")
    reduce_unheld: str | None = opt("reduce_unheld", read_op, None)
    first_dim_param: str = opt("first_dim_param", text, "", kind=PARAM, draw="dims")
    zero_dim_as_1d: bool = opt("zero_dim_as_1d", flag, False)

    def named_factors(self) -> list[tuple[str, str]]:
        """(key, factor) for every factor a key names ("..." aside)."""
        return [("whole", f) for f in self.whole if f != ELLIPSIS] + [("reduce", f) for f, _ in self.reduce] + \
            [("indices", f) for _, f in self.indices] + \
            [("size_params", f) for _, held in self.size_params for f in held if f != ELLIPSIS]

    def derive(self, eq: Equation, call: RuleCall, written: bool) -> Derived:
        """Bind ``eq`` to the call's operands: a written equation has a term per declared
        operand (the absent ones' dropped), the call's own one per tensor it passes."""
        unknown = sorted({f for k, f in self.named_factors() if k in ("whole", "reduce")} - set(eq.letters))
        if unknown:
            raise InvalidArgument(f"rule names factor(s) {unknown} that einsum {str(eq)!r} does not have")
        if not written:
            if len(eq.inputs) != sum(call.present):
                raise InvalidArgument(f"the equation {str(eq)!r} has {len(eq.inputs)} operand term(s); the call "
                                      f"passes {sum(call.present)} tensor(s)")
        elif len(eq.inputs) != len(call.present):
            raise InvalidArgument(f"einsum {str(eq)!r} has {len(eq.inputs)} input term(s); the spec declares "
                                  f"{len(call.present)} tensor operand(s)")
        else:
            eq = Equation(tuple(t for t, here in zip(eq.inputs, call.present) if here), eq.outputs)
        if len(call.outputs) > len(eq.outputs) == 1:        # one term for every element of a tuple result
            eq = Equation(eq.inputs, eq.outputs * len(call.outputs))
        whole, reduce, sizes = frozenset(self.whole), self.reduce, {}
        if written and not all(call.present):   # a factor only an absent operand's term held: nothing to keep
            kept = set(eq.letters)
            whole = frozenset(f for f in whole if f == ELLIPSIS or f in kept)
            reduce = tuple((f, op) for f, op in reduce if f in kept)
        shapes = call.inputs + call.outputs
        if self.first_dim_param:
            eq, after = along_dim(eq, shapes, call.param(self.first_dim_param), self.first_dim_param)
            whole |= after if ELLIPSIS in whole else frozenset()
        if self.zero_dim_as_1d:
            eq, sizes = zero_dim_as_1d(eq, shapes)
            kept = set(eq.letters)        # a factor only 0-d tensors held is in no term: nothing to keep whole
            whole = frozenset(f for f in whole if f == ELLIPSIS or f in kept)
            reduce = tuple((f, op) for f, op in reduce if f in kept)
        for param, held in self.size_params:   # one factor's size, seen only inside compounds: bound (conv's groups)
            alone = any(dim == (held[0],) for term in eq.inputs + eq.outputs for dim in term)
            if len(held) == 1 and not alone and held[0] != ELLIPSIS and (value := call.params.get(param)) is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidArgument(f"call parameter {param!r} holds the size of factor {held[0]!r}: it must "
                                          f"be a positive int, got {value!r}")
                sizes[held[0]] = value
        return Derived(eq, whole, reduce, tuple(sizes.items()))


@register_source
@dataclass(frozen=True)
class Einsum(_Factors):
    key = "einsum"
    einsum: Equation | None = opt("einsum", _equation, None)

    def check(self) -> None:
        letters = set(self.einsum.letters) if self.einsum is not None else set()
        for key, factor in self.named_factors():
            if factor not in letters:
                bad = sorted({f for _, f in self.named_factors()} - letters)
                raise OptionError(f"rule names factor(s) {bad} that einsum {str(self.einsum)!r} does not have", key)
        if self.first_dim_param and self.einsum is not None and \
                not any(leading(term) for term in self.einsum.inputs + self.einsum.outputs):
            raise OptionError(f"rule option 'first_dim_param' moves the first dim of each term written as one dim "
                              f"then '...'; einsum {str(self.einsum)!r} has none", "first_dim_param")

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        assert self.einsum is not None
        return self.derive(self.einsum, call, written=True)


@register_source
@dataclass(frozen=True)
class EinsumParam(_Factors):
    key = "einsum_param"
    einsum_param: str = opt("einsum_param", text, "", kind=PARAM)

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        return self.derive(torch_einsum_equation(call.param(self.einsum_param)), call, written=False)
