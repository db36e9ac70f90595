"""The rule as a spec writes it (``generator: {family: rules, options: {...}}``): validated
once at spec load (errors carry the YAML file and line) and turned into an equation for each
call.

One source of factors, exactly one of:

``einsum: "mk,kn->mn"``        written out (see :mod:`shardverify.strategies.rules.notation`); one term
                               per tensor operand in declaration order (absent optional
                               operands drop their term), one per output
``einsum_param: equation``     the equation a call parameter holds, in torch.einsum's
                               notation (one letter per dim, spaces ignored, implicit
                               output when there is no ``->``): torch.einsum itself
``pointwise: true``            every operand broadcast against the output
``reduce_dims_param: dim``     a reduction over the dims a call parameter names (or several:
                               ``[dim1, dim2]``, the dims each names), with ``keepdim_param``
                               and ``reduce_op`` (sum | avg | max | min | none: the reduced
                               dims must stay whole); output dims after the kept ones (the
                               diagonal torch.diagonal appends) hold factors of their own,
                               which only the output holds: whole
``view: reshape``              factors matched by the input and output shapes; with
                               ``shape_param`` the call parameter holding the output shape,
                               which each rank passes as its local output shape, or with
                               ``shape_dim_param`` too only the sizes that the input dim it
                               names splits into (torch.unflatten's ``dim`` and ``sizes``)
``view: permute``              with ``dims_param``; ``view: transpose`` with ``dim0_param``/``dim1_param``
``whole_tensors: true``        every dim of every tensor holds a factor of its own, never
                               sharded: the op mixes positions across dims (masked_scatter
                               takes source's elements in the mask's order, as_strided reads
                               storage); the replicated layout and the partial inputs that
                               ``linear_in`` and ``monotone_in`` allow
``advanced_index: true``       ``x[i0, i1]`` (``aten.index.Tensor``): the first operand is
                               indexed, the others are the elements of the index list in
                               order (element k indexes dim k, an absent one is ``:``); each
                               index's ids index its dim as ``indices`` says (a shard of the
                               dim masks the ids a rank does not hold)

and modifiers: ``whole: [k]`` (factors never sharded; ``"..."`` names every dim the ellipsis stands for), ``whole_dims_param: dim`` (output
dims a parameter names stay whole: softmax, split, cat), ``whole_trailing_param:
normalized_shape`` (the last len(param) dims stay whole: layer_norm), ``whole_padded_param: pad`` (a
pad list, a (before, after) pair per dim from the last dim backward as F.pad takes it: each dim
with a nonzero pair stays whole, the others pass their shard), ``reduce: {k: avg}``
(how a reduced factor of an einsum combines; default ``reduce_op``, else sum; none = whole; a
factor some outputs hold is reduced for the outputs lacking it, which are then partial: a
backward op's weight gradient; ``reduce_unheld: sum`` does so for every such factor, those of
``...`` included), ``size_params: {N: n, C: [g, k]}``
(call parameters holding the size of factors, the product of several, ``"..."`` the
ellipsis's: each rank passes its own blocks' size, as native_group_norm's N, C, HxW, group),
``additive_operands: [bias]`` (added once after a partial output is reduced),
``constant_operands: [running_var]`` (inputs the op takes no gradient for), ``lacks_dims_param:
dim`` with ``lacking_operands: [src]`` (those operands lack the output dims the parameter names,
as select_scatter's src lacks the selected dim: pointwise alignment takes them as holding those
dims at size 1), ``factory: true`` (with ``shape_param``: the output's dims that no input holds
are sharded too, each rank making its own block from its local shape: torch.full; or with
``range_params: [start, end, step]`` from its own start and end, ``start + lo * step`` and
``start + hi * step`` for its block ``[lo, hi)`` of the one dim: torch.arange),
``linear_in:
[input, mat2]`` or ``[[input, other]]`` (the operands the op is linear in: a name alone, or
a group the op is linear in jointly, as add in both its terms, ``bias?`` for a member whose
absence adds nothing; such inputs are also offered as partial sums over free mesh axes, the
output then partial too), ``monotone_in: [input]`` (the op is nondecreasing in the operand,
the others fixed, and each output element takes it elementwise or by a max/min: the operand is
also offered as a partial max or min, the output then a partial max or min; ``-input`` for a
nonincreasing op, which turns a max into a min; ``input:max`` where only a max passes, as
through amax), ``aligned: true``
(pointwise without broadcasting: every operand has the output's sizes outside the whole dims,
else the call is refused: gather's index and input), ``indices:
{input: v}`` (an integer operand holds ids into factor ``v`` of another operand: sharding
``v`` shifts the ids into each rank's rows and masks the others, a partial sum: vocab-parallel
embedding). A ``size_params`` parameter that holds one factor seen only inside compound dims
(``size_params: {groups: g}``, a convolution's groups in ``(g i)``) also binds that factor's size;
a rank holding 2 of 4 groups runs the conv with groups=2. ``naming``, ``follow``: rules/colossal.py, follow.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.strategies.rules import derive
from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.notation import ELLIPSIS, Equation, parse_equation, torch_einsum_equation
from shardverify.sharding.strategy import REDUCE_OPS

__all__ = ["RuleOptions", "equation_for", "local_shape_part", "padded_dims", "SOURCES", "OPTION_KEYS"]

SOURCES = ("einsum", "einsum_param", "pointwise", "reduce_dims_param", "view", "advanced_index", "whole_tensors")
VIEWS = ("reshape", "permute", "transpose")
OPTION_KEYS = SOURCES + ("keepdim_param", "reduce_op", "dims_param", "dim0_param", "dim1_param", "shape_param",
                         "shape_dim_param", "whole", "whole_dims_param", "whole_trailing_param", "whole_padded_param",
                         "reduce", "additive_operands", "constant_operands", "indices", "aligned",
                         "lacks_dims_param", "lacking_operands", "factory", "range_params",
                         "linear_in", "monotone_in", "size_params", "reduce_unheld", "naming", "follow")


@dataclass(frozen=True)
class RuleOptions:
    source: str
    einsum: Equation | None = None
    einsum_param: str = ""
    view: str = ""
    reduce_dims_param: str | tuple[str, ...] = ""   # one parameter, or several whose dims are all reduced
    keepdim_param: str = ""
    reduce_op: str | None = "sum"
    dims_param: str = ""
    dim0_param: str = ""
    dim1_param: str = ""
    shape_param: str = ""
    shape_dim_param: str = ""   # with shape_param: it holds the sizes the input dim this names splits into
    whole: tuple[str, ...] = ()
    whole_dims_param: str = ""
    whole_trailing_param: str = ""
    whole_padded_param: str = ""   # F.pad's pad: (before, after) per dim from the last; padded dims stay whole
    reduce: tuple[tuple[str, str | None], ...] = ()
    additive: tuple[str, ...] = ()
    constant: tuple[str, ...] = ()                # operand roles the op takes no gradient for
    lacks_dims_param: str = ""                    # the output dims that the lacking operands do not hold
    lacking: tuple[str, ...] = ()                 # operand roles without those dims (select_scatter's src)
    factory: bool = False                         # output-only factors shard: each rank makes its block
    range_params: tuple[str, ...] = ()            # a range factory's start, end, step: each rank its own
    aligned: bool = False                         # pointwise without broadcasting (gather)
    indices: tuple[tuple[str, str], ...] = ()     # integer operand role -> the factor its ids index
    linear_in: tuple[tuple[str, ...], ...] = ()   # groups of operand roles the op is (jointly) linear in
    # (operand role, partial op it may arrive as, partial op the output then is): max/min only
    monotone_in: tuple[tuple[str, str, str], ...] = ()
    # call parameter -> the factors whose size it holds (their product; "..." the ellipsis's):
    # each rank passes its own blocks' size (native_group_norm's N, C, HxW and group)
    size_params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # how a factor some outputs hold reduces for the outputs lacking it, where `reduce` does not say;
    # None: they do not depend on it (replicated over its axes)
    reduce_unheld: str | None = None
    naming: str = "rules"                         # or colossalai: ColossalAI's names and order (colossal.py)
    follow: str = ""                              # the operand whose producer's layouts are taken up (follow.py)

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> RuleOptions:
        """Validate generator options; InvalidArgument names the option and the bad value."""
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise InvalidArgument(f"unknown rule option(s) {unknown}; known: {', '.join(OPTION_KEYS)}")
        sources = [k for k in SOURCES if k in options and options[k] not in (None, False)]
        if len(sources) != 1:
            raise InvalidArgument(f"a rule needs exactly one of {', '.join(SOURCES)}; got {sources or 'none'}")
        source = sources[0]

        def text(key: str) -> str:
            value = options.get(key, "")
            if not isinstance(value, str):
                raise InvalidArgument(f"rule option {key!r} must be a string, got {value!r}")
            return value

        def names(key: str) -> tuple[str, ...]:
            value = options.get(key, ())
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or \
                    not all(isinstance(v, str) for v in value):
                raise InvalidArgument(f"rule option {key!r} must be a list of names, got {value!r}")
            return tuple(value)

        def op(value: object, what: str) -> str | None:
            if value in (None, "none"):
                return None
            if value not in REDUCE_OPS:
                raise InvalidArgument(f"{what} must be one of {', '.join(REDUCE_OPS)} or none, got {value!r}")
            return str(value)

        einsum = parse_equation(text("einsum")) if source == "einsum" else None
        if bool(text("lacks_dims_param")) != bool(names("lacking_operands")) or \
                (text("lacks_dims_param") and source != "pointwise"):
            raise InvalidArgument("rule options 'lacks_dims_param' (the dims) and 'lacking_operands' (the operands "
                                  "without them) go together, with pointwise: true")
        for flag in ("pointwise", "advanced_index", "whole_tensors"):
            if source == flag and options[flag] is not True:
                raise InvalidArgument(f"rule option {flag!r} must be true, got {options[flag]!r}")
        view = text("view")
        if source == "view" and view not in VIEWS:
            raise InvalidArgument(f"rule option 'view' must be one of {', '.join(VIEWS)}, got {view!r}")
        if view == "permute" and not text("dims_param"):
            raise InvalidArgument("view: permute needs dims_param (the parameter holding the order)")
        if view == "transpose" and not (text("dim0_param") and text("dim1_param")):
            raise InvalidArgument("view: transpose needs dim0_param and dim1_param")
        if text("shape_param") and view != "reshape" and source != "pointwise":
            raise InvalidArgument("rule option 'shape_param' (the output shape a rank passes locally) "
                                  "applies to view: reshape and to pointwise (expand)")
        for key, allowed in (("factory", (None, False, True)), ("naming", ("rules", "colossalai"))):
            if options.get(key, allowed[0]) not in allowed:
                raise InvalidArgument(f"rule option {key!r} must be one of {allowed}, got {options[key]!r}")
        range_params = names("range_params")
        if range_params and len(range_params) != 3:
            raise InvalidArgument(f"rule option 'range_params' names the start, end and step parameters, got "
                                  f"{list(range_params)}")
        if options.get("factory") is True and not (text("shape_param") or range_params):
            raise InvalidArgument("rule option 'factory' (each rank makes its own block of the output) needs "
                                  "shape_param (the parameter each rank passes its local output shape in) or "
                                  "range_params (the start, end and step each rank passes for its block)")
        if range_params and options.get("factory") is not True:
            raise InvalidArgument("rule option 'range_params' (each rank's own start and end) needs factory: true")
        if text("shape_dim_param") and not text("shape_param"):
            raise InvalidArgument("rule option 'shape_dim_param' (the input dim whose split sizes shape_param "
                                  "holds) needs shape_param")

        def mapping(key: str, what: str) -> tuple[tuple[str, object], ...]:
            value = options.get(key, ())
            try:
                found = tuple((str(k), v) for k, v in (value.items() if isinstance(value, Mapping) else value))
            except (TypeError, ValueError):
                raise InvalidArgument(f"rule option {key!r} must map {what}, got {value!r}") from None
            if found and source not in ("einsum", "einsum_param"):
                raise InvalidArgument(f"rule option {key!r} names einsum factors: it needs an einsum rule "
                                      "(a reduction uses reduce_op)")
            return found

        reduce = tuple((k, op(v, f"reduce op of factor {k!r}")) for k, v in mapping("reduce", "factors to ops"))
        indices = tuple((role, str(factor)) for role, factor in mapping("indices", "operands to factors"))
        size_params = tuple((param, (held,) if isinstance(held, str) else tuple(held))
                            for param, held in mapping("size_params", "parameters to factors"))
        if any(not held or not all(isinstance(f, str) for f in held) for _, held in size_params):
            raise InvalidArgument(f"rule option 'size_params' maps each parameter to a factor or a list of factors, "
                                  f"got {options.get('size_params')!r}")
        whole = names("whole")
        if whole and source not in ("einsum", "einsum_param"):
            raise InvalidArgument("rule option 'whole' names einsum factors; derived rules use whole_dims_param "
                                  "or whole_trailing_param or whole_padded_param")
        if einsum is not None:
            letters = set(einsum.letters)
            bad = sorted((set(whole) - {ELLIPSIS} | {k for k, _ in reduce} | {f for _, f in indices}
                          | {f for _, held in size_params for f in held} - {ELLIPSIS}) - letters)
            if bad:
                raise InvalidArgument(f"rule names factor(s) {bad} that einsum {str(einsum)!r} does not have")
        linear_in = options.get("linear_in", ())
        if isinstance(linear_in, str) or not isinstance(linear_in, (list, tuple)):
            raise InvalidArgument(f"rule option 'linear_in' must be a list of operand names or of groups "
                                  f"(lists) of names, got {linear_in!r}")
        groups = tuple((item,) if isinstance(item, str) else tuple(item) if isinstance(item, (list, tuple)) and
                       item and all(isinstance(v, str) for v in item) else None for item in linear_in)
        if None in groups:
            raise InvalidArgument(f"rule option 'linear_in': each item must be an operand name or a non-empty "
                                  f"list of names, got {linear_in!r}")
        return cls(source=source, einsum=einsum, einsum_param=text("einsum_param"), view=view,
                   reduce_dims_param=_one_or_more(options.get("reduce_dims_param", ""), "reduce_dims_param"),
                   keepdim_param=text("keepdim_param"),
                   reduce_op=op(options.get("reduce_op", "sum"), "reduce_op"), dims_param=text("dims_param"),
                   dim0_param=text("dim0_param"), dim1_param=text("dim1_param"), shape_param=text("shape_param"),
                   shape_dim_param=text("shape_dim_param"), whole=whole, whole_dims_param=text("whole_dims_param"),
                   whole_trailing_param=text("whole_trailing_param"),
                   whole_padded_param=text("whole_padded_param"), reduce=reduce,
                   additive=names("additive_operands"), constant=names("constant_operands"), indices=indices,
                   lacks_dims_param=text("lacks_dims_param"), lacking=names("lacking_operands"),
                   factory=options.get("factory") is True, range_params=range_params,
                   aligned=options.get("aligned") is True, linear_in=groups,
                   monotone_in=_monotone(options.get("monotone_in", ())), size_params=size_params,
                   reduce_unheld=op(options.get("reduce_unheld"), "reduce_unheld"),
                   naming=str(options.get("naming", "rules")), follow=text("follow"))


def _one_or_more(value: object, key: str) -> str | tuple[str, ...]:
    """A parameter name, or a list of them (kept as a tuple)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise InvalidArgument(f"rule option {key!r} must name a parameter or a list of them, got {value!r}")


def _monotone(value: object) -> tuple[tuple[str, str, str], ...]:
    """``monotone_in`` items as (role, the partial op it may arrive as, the output's partial op)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"rule option 'monotone_in' must be a list of operand names, got {value!r}")
    found = []
    for item in value:
        role, _, only = item.partition(":")
        decreasing = role.startswith("-")
        role = role.removeprefix("-")
        if not role or only not in ("", "max", "min"):
            raise InvalidArgument(f"rule option 'monotone_in': {item!r} is not `name`, `-name` (nonincreasing) or "
                                  f"either with `:max` or `:min` (the only partial op that passes)")
        for op in (only,) if only else ("max", "min"):
            found.append((role, op, {"max": "min", "min": "max"}[op] if decreasing else op))
    return tuple(found)


def _param(params: Mapping[str, object], name: str) -> object:
    from shardverify.strategies.handlers.base import Computed

    if name not in params:
        raise InvalidArgument(f"the rule reads call parameter {name!r}, which the spec does not declare")
    value = params[name]
    if isinstance(value, Computed):
        raise InvalidArgument(f"the rule reads call parameter {name!r}, computed by node(s) {', '.join(value.nodes)}; "
                              "only constants are supported")
    return value


def padded_dims(value: object, rank: int, name: str) -> tuple[int, ...]:
    """The dims a pad list pads: pair k ``(before, after)`` of ``value`` pads dim ``rank - 1 - k``
    (F.pad's order, last dim first); a ``(0, 0)`` pair leaves its dim as it is. A pad beyond the
    tensor's rank names no dim (torch refuses the call itself)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * 2      # nn.ReflectionPad1d(2): one int pads both sides of the last dim
    if not isinstance(value, (list, tuple)) or len(value) % 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"call parameter {name!r} must be a pad list of (before, after) int pairs, got {value!r}")
    return tuple(rank - 1 - k for k in range(len(value) // 2) if (value[2 * k], value[2 * k + 1]) != (0, 0)
                 and rank - 1 - k >= 0)


def local_shape_part(options: RuleOptions, input_shape: tuple[int, ...], output_shape: tuple[int, ...],
                     params: Mapping[str, object]) -> slice:
    """The part of a rank's local output shape it passes for ``shape_param``: all of it, or with
    ``shape_dim_param`` the sizes that the named input dim splits into (``x.unflatten(1, (4,
    -1))`` on a ``[8, 16]`` input: output dims 1 and 2)."""
    if not options.shape_dim_param:
        return slice(None)
    value = _param(params, options.shape_dim_param)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"call parameter {options.shape_dim_param!r} must be one dim (an int), got {value!r}")
    (dim,) = normalize_dims(value, len(input_shape), options.shape_dim_param)
    parts = len(output_shape) - len(input_shape) + 1
    if parts < 1:
        raise InvalidArgument(f"an output of shape {list(output_shape)} does not split a dim of an input of shape "
                              f"{list(input_shape)}")
    return slice(dim, dim + parts)


def _pointwise(options: RuleOptions, inputs: Sequence[tuple[int, ...]], outputs: Sequence[tuple[int, ...]],
               params: Mapping[str, object], roles: Sequence[str]) -> tuple[Equation, set[str]]:
    """Pointwise broadcasting; a ``lacking_operands`` operand is aligned as if it held the
    ``lacks_dims_param`` dims of the output at size 1, which its term then drops."""
    if not options.lacking:
        return derive.pointwise(inputs, outputs)
    rank = len(outputs[0])
    missing = normalize_dims(_param(params, options.lacks_dims_param), rank, options.lacks_dims_param)
    missing = tuple(sorted(d for d in missing if d < rank))
    lacking = [bool(roles) and roles[i] in options.lacking for i in range(len(inputs))]
    widened = []
    for shape, lacks in zip(inputs, lacking):
        if lacks:
            if len(shape) + len(missing) != rank:
                raise InvalidArgument(f"an operand of shape {list(shape)} lacking dim(s) {list(missing)} of an output "
                                      f"of shape {list(outputs[0])} should have {rank - len(missing)} dim(s)")
            shape = list(shape)
            for d in missing:
                shape.insert(d, 1)
        widened.append(tuple(shape))
    eq, whole = derive.pointwise(widened, outputs)
    terms = tuple(tuple(dim for j, dim in enumerate(term) if j not in missing) if lacks else term
                  for term, lacks in zip(eq.inputs, lacking))
    return Equation(terms, eq.outputs), whole


def equation_for(options: RuleOptions, inputs: Sequence[tuple[int, ...]], outputs: Sequence[tuple[int, ...]],
                 params: Mapping[str, object], present: Sequence[bool], roles: Sequence[str] = ()
                 ) -> tuple[Equation, set[str], dict[str, str | None], dict[str, int]]:
    """The equation for one call, the factors that must stay whole, how reduced factors combine
    and the sizes of factors the shapes alone do not fix. ``roles``: each input's operand role
    (``lacking_operands`` names them)."""
    whole: set[str] = set(options.whole)
    sizes: dict[str, int] = {}
    reduce: dict[str, str | None] = dict(options.reduce)
    if options.source in ("einsum", "einsum_param"):
        eq = options.einsum if options.einsum is not None else \
            torch_einsum_equation(_param(params, options.einsum_param))
        unknown = sorted((set(whole) - {ELLIPSIS} | set(reduce)) - set(eq.letters))
        if unknown:
            raise InvalidArgument(f"rule names factor(s) {unknown} that einsum {str(eq)!r} does not have")
        if options.einsum is None:      # the call's own equation: one term per tensor it passes
            if len(eq.inputs) != sum(present):
                raise InvalidArgument(f"the equation {str(eq)!r} has {len(eq.inputs)} operand term(s); the call "
                                      f"passes {sum(present)} tensor(s)")
        elif len(eq.inputs) != len(present):
            raise InvalidArgument(f"einsum {str(eq)!r} has {len(eq.inputs)} input term(s); the spec declares "
                                  f"{len(present)} tensor operand(s)")
        else:
            eq = Equation(tuple(t for t, here in zip(eq.inputs, present) if here), eq.outputs)
        if len(outputs) > len(eq.outputs) == 1:        # one term for every element of a tuple result
            eq = Equation(eq.inputs, eq.outputs * len(outputs))
        for param, held in options.size_params:   # one factor's size, seen only inside compounds: bound (conv's groups)
            alone = any(dim == (held[0],) for term in eq.inputs + eq.outputs for dim in term)
            if len(held) == 1 and not alone and held[0] != ELLIPSIS and (value := params.get(param)) is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidArgument(f"call parameter {param!r} holds the size of factor {held[0]!r}: it must "
                                          f"be a positive int, got {value!r}")
                sizes[held[0]] = value
    elif options.source == "pointwise":
        eq, whole = _pointwise(options, inputs, outputs, params, roles)
    elif options.source == "whole_tensors":
        eq, whole = derive.whole_tensors(inputs, outputs)
        reduce = {f: None for term in eq.inputs for dim in term for f in dim}   # whole, never reduced
    elif options.source == "advanced_index":
        at = [k for k, here in enumerate(present[1:]) if here]
        eq, whole = derive.advanced_index(inputs[0], list(zip(at, inputs[1:])), outputs[0])
    elif options.source == "reduce_dims_param":
        names = (options.reduce_dims_param,) if isinstance(options.reduce_dims_param, str) else options.reduce_dims_param
        dims = tuple(sorted({d for name in names for d in normalize_dims(_param(params, name), len(inputs[0]), name)}))
        dims = tuple(d for d in dims if d < len(inputs[0]))     # a 0-d tensor's dim 0 reduces nothing
        keepdim = bool(_param(params, options.keepdim_param)) if options.keepdim_param else False
        eq = derive.reduction(inputs[0], [len(o) for o in outputs], dims, keepdim)
        if options.reduce_op is None:
            whole |= {f"d{d}" for d in dims}
    elif options.view == "reshape":
        eq, whole, sizes = derive.reshape(inputs[0], outputs[0])
    elif options.view == "permute":
        eq = derive.permute(len(inputs[0]), list(_param(params, options.dims_param)))  # type: ignore[call-overload]
    else:
        rank = len(inputs[0])
        d0, d1 = (int(_param(params, p)) % max(rank, 1) for p in (options.dim0_param, options.dim1_param))  # type: ignore[call-overload]
        order = list(range(rank))
        if rank:                      # a 0-d tensor takes dim 0 (or -1) as its one "dim": nothing moves
            order[d0], order[d1] = order[d1], order[d0]
        eq = derive.permute(rank, order)
    out_rank = len(outputs[0]) if outputs else 0
    names = [dim[0] if len(dim) == 1 else None for dim in eq.outputs[0]] if eq.outputs else []
    positions: tuple[int, ...] = ()
    if options.whole_dims_param:
        positions = normalize_dims(_param(params, options.whole_dims_param), out_rank, options.whole_dims_param)
    if options.whole_trailing_param:
        value = _param(params, options.whole_trailing_param)
        count = 1 if isinstance(value, int) else len(value)  # type: ignore[arg-type]
        positions += tuple(range(out_rank - count, out_rank))
    if options.whole_padded_param:
        positions += padded_dims(_param(params, options.whole_padded_param), out_rank, options.whole_padded_param)
    positions = tuple(p for p in positions if p < out_rank)   # a 0-d tensor's dim 0 (torch takes it) is no dim
    if positions:
        if any((ELLIPSIS,) == dim for dim in eq.outputs[0]):
            raise InvalidArgument("whole_dims_param/whole_trailing_param/whole_padded_param need an output term "
                                  "without '...'")
        whole |= {names[p] for p in positions if names[p] is not None}
    if options.aligned:
        for i, term in enumerate(eq.inputs):
            offset = out_rank - len(term)
            strange = [j + offset for j, dim in enumerate(term) if dim != (f"d{j + offset}",)
                       and j + offset not in positions]
            if strange:
                raise InvalidArgument(f"operand {i} of shape {tuple(inputs[i])} does not match the output "
                                      f"{tuple(outputs[0])} at dim(s) {strange} outside the whole dims "
                                      f"{list(positions)}: the rule (aligned) holds only for equal sizes there")
    if options.source == "reduce_dims_param" and options.reduce_op is not None:
        reduce = {f"d{d}": options.reduce_op for d in range(len(inputs[0]))
                  if all((f"d{d}",) not in term for term in eq.outputs)}
    return eq, whole, reduce, sizes
