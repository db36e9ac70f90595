"""What every rule source shares: a field declared as one YAML key (:func:`opt`: how its value
is read, whether it names call parameters or operands and where the names sit, how explore
draws a parameter it names), the readers of common values, the call a source builds its
equation for (:class:`RuleCall`) and what it returns (:class:`Derived`).

A source is a frozen dataclass subclassing :class:`Source`; :func:`parse_unit` fills its
fields from the options by their declarations, so a source module holds only its keys, its
cross-key checks and its equation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardverify.errors import InvalidArgument
from shardverify.sharding.strategy import REDUCE_OPS
from shardverify.strategies.declarations import OperandDecl
from shardverify.strategies.options import OPERAND, PARAM, At, OptionError, Ref
from shardverify.strategies.rules.notation import Equation

__all__ = ["Shape", "Form", "NAMES", "GROUPS", "KEYS", "MARKED", "Opt", "opt", "declared", "keys_of", "parse_unit",
           "renamed", "text", "names", "one_or_more", "true", "flag", "choice", "read_op", "pairs", "RuleCall",
           "Derived", "Source", "PARAM", "OPERAND", "OptionError", "Ref"]

Shape = tuple[int, ...]


# ------------------------------------------------------------------------ where the names sit

@dataclass(frozen=True)
class Form:
    """Where the names sit in a key's value: ``refs`` lists them in the (checked) value as the
    spec wrote it, each with its place; ``renamed`` replaces each name in the parsed value by
    the names ``each`` gives it (a variadic operand stands for its elements)."""

    refs: Callable[[object], list[tuple[str, At]]]
    renamed: Callable[[Any, Callable[[str], tuple[str, ...]]], object]


def bare(name: str) -> str:
    """``bias?`` (an operand whose absence adds nothing) names ``bias``."""
    return name.rstrip("?")


def _items(value: object) -> list[tuple[object, object]]:
    """A mapping's (key, value) pairs: a dict, or the pairs a spec's option mapping is held as."""
    return list(value.items()) if isinstance(value, Mapping) else [tuple(item) for item in value]  # type: ignore[attr-defined,misc]


def _first_renamed(value: Any, each: Callable[[str], tuple[str, ...]]) -> object:
    return tuple((new, *rest) for name, *rest in value for new in each(name))


def _names(value: Any) -> list[tuple[str, At]]:
    if isinstance(value, str):
        return [(value, ())] if value else []
    return [(bare(v), (i,)) for i, v in enumerate(value)]


def _groups(value: Any) -> list[tuple[str, At]]:
    found: list[tuple[str, At]] = []
    for i, item in enumerate(value):
        found += [(bare(item), (i,))] if isinstance(item, str) else [(bare(v), (i, j)) for j, v in enumerate(item)]
    return found


#: one name, or a list of them
NAMES = Form(_names, lambda value, each: value if isinstance(value, str) else
             tuple(new for v in value for new in each(v)))
#: a list of names and of lists of names (groups)
GROUPS = Form(_groups, lambda value, each: tuple(tuple(new for v in group for new in each(v)) for group in value))
#: a mapping whose keys are the names
KEYS = Form(lambda value: [(str(k), (str(k),)) for k, _ in _items(value)], _first_renamed)
#: a list of names with marks: ``-input:max`` names ``input``
MARKED = Form(lambda value: [(v.partition(":")[0].removeprefix("-"), (i,)) for i, v in enumerate(value)],
              _first_renamed)


# ------------------------------------------------------------------------ declaring a key

@dataclass(frozen=True)
class Opt:
    """One YAML key: ``read(key, value)`` checks the value and returns the field's (raising
    OptionError); ``kind`` PARAM or OPERAND when it names those (``form``: where the names
    sit); ``draw`` how explore draws a parameter it names ("dims", "permutation", "shape")."""

    key: str
    read: Callable[[str, object], object]
    kind: str = ""
    form: Form = NAMES
    draw: str = ""


def opt(key: str, read: Callable[[str, object], object], default: object, *, kind: str = "",
        form: Form = NAMES, draw: str = "") -> Any:
    """A dataclass field read from YAML key ``key`` (see :class:`Opt`)."""
    return field(default=default, metadata={"opt": Opt(key, read, kind, form, draw)})


def declared(cls: type) -> list[tuple[str, Opt]]:
    """(field name, its Opt) of every declared field of a source or modifiers class."""
    return [(f.name, f.metadata["opt"]) for f in dataclasses.fields(cls) if "opt" in f.metadata]


def keys_of(cls: type) -> tuple[str, ...]:
    return tuple(o.key for _, o in declared(cls))


def parse_unit(cls: type, options: Mapping[str, object]) -> tuple[Any, tuple[Ref, ...]]:
    """``cls`` with each declared field read from its key in ``options`` (the others at their
    defaults), checked (its ``check()``), and the names its keys hold."""
    values, refs = {}, []
    for name, o in declared(cls):
        if o.key in options:
            values[name] = o.read(o.key, options[o.key])
            if o.kind:
                refs += [Ref(o.key, at, o.kind, found, o.draw) for found, at in o.form.refs(options[o.key])]
    unit = cls(**values)
    unit.check()
    return unit, tuple(refs)


def renamed(unit: Any, each: Callable[[str], tuple[str, ...]]) -> Any:
    """``unit`` with every operand name replaced by the names ``each`` gives it."""
    changes = {name: o.form.renamed(getattr(unit, name), each) for name, o in declared(type(unit))
               if o.kind == OPERAND and not isinstance(getattr(unit, name), str)}
    return dataclasses.replace(unit, **changes) if changes else unit


# ------------------------------------------------------------------------ readers

def text(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise OptionError(f"rule option {key!r} must be a string, got {value!r}", key)
    return value


def names(key: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise OptionError(f"rule option {key!r} must be a list of names, got {value!r}", key)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise OptionError(f"rule option {key!r} must be a list of names, got {value!r}", key, (i,))
    return tuple(value)


def one_or_more(key: str, value: object) -> str | tuple[str, ...]:
    """A parameter name, or a list of them (kept as a tuple)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise OptionError(f"rule option {key!r} must name a parameter or a list of them, got {value!r}", key)


def true(key: str, value: object) -> bool:
    """A source's own key that takes no value but ``true``."""
    if value is not True:
        raise OptionError(f"rule option {key!r} must be true, got {value!r}", key)
    return True


def flag(key: str, value: object) -> bool:
    if value not in (None, False, True):
        raise OptionError(f"rule option {key!r} must be one of (None, False, True), got {value!r}", key)
    return value is True


def choice(*allowed: str) -> Callable[[str, object], str]:
    def read(key: str, value: object) -> str:
        if value not in allowed:
            raise OptionError(f"rule option {key!r} must be one of {allowed}, got {value!r}", key)
        return str(value)
    return read


def read_op(key: str, value: object, what: str = "", at: At = ()) -> str | None:
    """A reduce op (sum, avg, max, min) or None (none: the reduced dims stay whole)."""
    if value in (None, "none"):
        return None
    if value not in REDUCE_OPS:
        raise OptionError(f"{what or key} must be one of {', '.join(REDUCE_OPS)} or none, got {value!r}", key, at)
    return str(value)


def pairs(key: str, value: object, what: str) -> tuple[tuple[str, object], ...]:
    """A mapping's (name, value) pairs."""
    try:
        return tuple((str(k), v) for k, v in _items(value))
    except (TypeError, ValueError):
        raise OptionError(f"rule option {key!r} must map {what}, got {value!r}", key) from None


# ------------------------------------------------------------------------ a call

@dataclass(frozen=True)
class RuleCall:
    """One call as a source sees it: its tensors' shapes (inputs in term order, outputs), its
    parameters, which declared tensor operands it passes, each input's operand role, and the
    parameters graph nodes compute (name -> those nodes: known only at run time)."""

    inputs: tuple[Shape, ...]
    outputs: tuple[Shape, ...]
    params: Mapping[str, object] = field(default_factory=dict)
    present: tuple[bool, ...] = ()
    roles: tuple[str, ...] = ()
    computed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def param(self, name: str) -> object:
        """The constant value of a parameter the rule reads; InvalidArgument otherwise."""
        if name not in self.params:
            raise InvalidArgument(f"the rule reads call parameter {name!r}, which the spec does not declare")
        if name in self.computed:
            raise InvalidArgument(f"the call passes {name} computed in the graph (by "
                                  f"{', '.join(self.computed[name])}), known only when the model runs, and the "
                                  f"rule's layouts depend on it: pass {name} as a constant")
        return self.params[name]

    @property
    def out_rank(self) -> int:
        return len(self.outputs[0]) if self.outputs else 0


@dataclass(frozen=True)
class Derived:
    """A source's equation for one call, the factors that must stay whole, how reduced factors
    combine (factor -> op, None: stays whole) and the sizes of factors the shapes cannot tell."""

    equation: Equation
    whole: frozenset[str] = frozenset()
    reduce: tuple[tuple[str, str | None], ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()


# ------------------------------------------------------------------------ a source

class Source:
    """Where a rule's factors come from. A subclass is a frozen dataclass registered with
    :func:`~shardverify.strategies.rules.sources.registry.register_source`; ``key`` is the YAML
    key that selects it. The class attributes below are what a source may hold, for sources
    that declare no field of that name."""

    key: ClassVar[str] = ""
    probes_local_shapes: ClassVar[bool] = False   # a view: the local input's sizes decide the output's
    reduce_op: str | None = "sum"        # how a factor no output holds combines (bind's default op)
    reduce_unheld: str | None = None     # how one some outputs hold reduces for the others
    shape_param = ""                     # the parameter holding the output shape, passed per rank
    factory = False                      # output-only factors shard: each rank makes its block
    range_params: tuple[str, ...] = ()   # a range factory's start, end and step, passed per rank
    size_params: tuple[tuple[str, tuple[str, ...]], ...] = ()   # parameter -> factors whose size it holds
    indices: tuple[tuple[str, str], ...] = ()    # integer operand role -> the factor its ids index

    def check(self) -> None:
        """Raise OptionError where keys disagree (checked once, at parse)."""

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        """The equation for ``call``; ``whole_at``: output dims the modifiers keep whole."""
        raise NotImplementedError

    def index_ids(self, declared_roles: Sequence[str]) -> tuple[tuple[str, str], ...]:
        """Each integer operand's role with the factor its ids index (``declared_roles``: the
        tensor operands in term order)."""
        return self.indices

    def local_shape_part(self, call: RuleCall) -> slice:
        """The part of a rank's local output shape it passes for ``shape_param``."""
        return slice(None)

    def check_operands(self, operands: Sequence[OperandDecl]) -> None:
        """Raise OptionError where the declared operands do not fit the source."""
