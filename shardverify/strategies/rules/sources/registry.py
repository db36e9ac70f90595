"""The rule sources by the YAML key that selects each, and the parsed rule (:class:`RuleSpec`):
one source and the modifiers every rule takes, parsed once from a spec's or a handler's options
and carried by both.

A new source is one module holding a :class:`~.base.Source` dataclass decorated with
:func:`register_source`, imported by the package (``sources/__init__.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardverify.errors import HandlerError
from shardverify.strategies.declarations import OperandDecl
from shardverify.strategies.options import OptionError, Ref
from shardverify.strategies.rules.sources.base import Derived, RuleCall, Source, keys_of, parse_unit, renamed
from shardverify.strategies.rules.sources.modifiers import Modifiers

__all__ = ["register_source", "unregister_source", "source_keys", "RuleSpec", "parse_rule"]

_SOURCES: dict[str, type[Source]] = {}


def register_source(cls: type[Source]) -> type[Source]:
    """Register a source class under its ``key`` (a class decorator)."""
    if not cls.key or not dataclasses.is_dataclass(cls):
        raise HandlerError(f"rule source {cls.__name__} needs a selecting `key` and to be a frozen dataclass")
    owner = _SOURCES.get(cls.key)
    if owner is not None and (owner.__module__, owner.__qualname__) != (cls.__module__, cls.__qualname__):
        raise HandlerError(f"rule source key {cls.key!r} is already registered by {owner.__module__}")
    clash = set(keys_of(cls)) & set(keys_of(Modifiers))
    if clash:
        raise HandlerError(f"rule source {cls.__name__} declares key(s) {sorted(clash)} that every rule takes")
    _SOURCES[cls.key] = cls
    return cls


def unregister_source(key: str) -> None:
    _SOURCES.pop(key, None)


def source_keys() -> tuple[str, ...]:
    """The selecting key of every registered source, in registration order."""
    return tuple(_SOURCES)


@dataclass(frozen=True)
class RuleSpec:
    """A parsed rule: its source, its modifiers, and every parameter and operand its keys name
    (with where, for the spec's errors; with how explore draws a parameter); ``at`` the
    ``file:line`` of the options it was parsed from, which an error at a call names."""

    source: Source
    modifiers: Modifiers
    refs: tuple[Ref, ...] = ()
    at: str = ""

    def check_operands(self, operands: Sequence[OperandDecl]) -> None:
        self.source.check_operands(operands)

    def for_elements(self, elements: Mapping[str, tuple[str, ...]]) -> RuleSpec:
        """The rule with a variadic operand's role standing for each of its elements: a
        ``linear_in`` group holding it holds them all (cat is linear in all its tensors
        together), any other entry naming it is one entry per element."""
        if not elements:
            return self

        def each(role: str) -> tuple[str, ...]:
            bare, mark = role.rstrip("?"), role[len(role.rstrip("?")):]
            return tuple(r + mark for r in elements[bare]) if bare in elements else (role,)

        return dataclasses.replace(self, source=renamed(self.source, each), modifiers=renamed(self.modifiers, each))

    def derive(self, call: RuleCall) -> Derived:
        """The equation for one call, with the factors the modifiers keep whole."""
        whole_at = self.modifiers.whole_at(call)
        derived = self.source.equation(call, whole_at)
        return dataclasses.replace(derived, whole=derived.whole | self.modifiers.whole_names(derived.equation,
                                                                                              whole_at))


def parse_rule(options: Mapping[str, object]) -> RuleSpec:
    """The rule ``options`` declare; OptionError names the key (and the item) at fault."""
    every = sorted({k for c in _SOURCES.values() for k in keys_of(c)} | set(keys_of(Modifiers)))
    for key in options:
        if key not in every:
            raise OptionError(f"unknown rule option {key!r}; known: {', '.join(every)}", key)
    chosen = [k for k in _SOURCES if k in options and options[k] not in (None, False)]
    if len(chosen) != 1:
        raise OptionError(f"a rule needs exactly one of {', '.join(_SOURCES)}; got {chosen or 'none'}",
                          chosen[1] if chosen else None)
    cls = _SOURCES[chosen[0]]
    known = set(keys_of(cls)) | set(keys_of(Modifiers))
    for key in options:
        if key not in known:
            others = [c.key for c in _SOURCES.values() if key in keys_of(c)]
            raise OptionError(f"rule option {key!r} does not apply to a {cls.key!r} rule (it is read by "
                              f"{', '.join(others)} rules); {cls.key!r} takes {', '.join(sorted(known))}", key)
    source, refs = parse_unit(cls, options)
    modifiers, more = parse_unit(Modifiers, options)
    return RuleSpec(source, modifiers, refs + more)
