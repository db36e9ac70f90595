"""Strategy generators registered by family name; a handler names its generator in data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardverify.errors import HandlerError
from shardverify.strategies.options import OptionError, ParsedOptions

if TYPE_CHECKING:
    from torch.fx import GraphModule, Node

    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.sharding.strategy import OperationData, ShardingStrategy, StrategiesVector

__all__ = ["GeneratorContext", "Generator", "KnownGap", "register_generator", "get_generator", "generator_names",
           "known_gaps", "parse_options"]


@dataclass(frozen=True)
class GeneratorContext:
    """Everything a generator may look at for one node.

    ``operands`` maps role -> OperationData in call order with the output last (absent
    optional operands are missing); ``params`` are the call's parameters with defaults
    filled in; the family's parsed options are the serving ``handler``'s ``rule``.
    """

    node: Node
    graph_module: GraphModule
    mesh: DeviceMesh
    operands: dict[str, OperationData]
    params: dict[str, object] = field(default_factory=dict)
    handler_name: str = ""
    handler: object | None = None           # the HandlerDef serving the call (one of several for a target)
    strategies_of: Callable[[Node], StrategiesVector] | None = None
    # the producer's strategies for their layouts alone (costs may be left at zero), for an
    # op that follows the layout its input arrives in; None: ``strategies_of``
    layouts_of: Callable[[Node], StrategiesVector] | None = None
    layouts_only: bool = False   # these strategies are wanted for their layouts alone: no costs

    def operand(self, role: str) -> OperationData:
        try:
            return self.operands[role]
        except KeyError:
            raise HandlerError(f"{self.handler_name or 'handler'}: node {self.node.name!r} has no operand "
                               f"with role {role!r}; roles are {list(self.operands)}") from None

    def predecessor_strategies(self, role: str = "input") -> StrategiesVector:
        """Strategies of the node producing operand ``role`` (built on demand)."""
        data = self.operand(role)
        producer = next((n for n in self.node.all_input_nodes if n.name == data.name), None)
        if producer is None or self.strategies_of is None:
            raise HandlerError(f"{self.handler_name or 'handler'}: operand {role!r} of node {self.node.name!r} "
                               f"is not produced by a graph node whose strategies can be built")
        return self.strategies_of(producer)

    def predecessor_layouts(self, role: str = "input") -> StrategiesVector:
        """Strategies of the node producing operand ``role``, read for their layouts alone: the
        producer's costs are not worked out for them (built on demand)."""
        data = self.operand(role)
        producer = next((n for n in self.node.all_input_nodes if n.name == data.name), None)
        if producer is not None and self.layouts_of is not None:
            return self.layouts_of(producer)
        return self.predecessor_strategies(role)


Generator = Callable[[GeneratorContext], "list[ShardingStrategy]"]
_GENERATORS: dict[str, Generator] = {}
_GAPS: dict[str, tuple[KnownGap, ...]] = {}
_PARSERS: dict[str, Callable[[dict[str, object]], ParsedOptions]] = {}


@dataclass(frozen=True)
class KnownGap:
    """Valid layout combinations a whole family never offers, and why that is acceptable.

    A gap of the family's strategy model (not of one op) is declared once, next to the family,
    instead of in every spec that uses it; the completeness audit reports the combinations it
    covers as accepted with this reason. ``match`` is as in a spec's ``audit: accept:`` entry:
    (role or ``any_input`` / ``output``, layout globs)."""

    reason: str
    match: tuple[tuple[str, tuple[str, ...]], ...]


def register_generator(name: str, *, known_gaps: tuple[KnownGap, ...] = (),
                       parse: Callable[[dict[str, object]], ParsedOptions] | None = None
                       ) -> Callable[[Generator], Generator]:
    """Register a family; ``parse`` reads a spec's options once, where the spec is read (the
    handler generated from it holds what it returned), raising OptionError; a family without
    one takes no options from a spec."""
    def decorate(fn: Generator) -> Generator:
        if name in _GENERATORS and _GENERATORS[name] is not fn:
            owner = _GENERATORS[name]
            if (owner.__module__, owner.__qualname__) != (fn.__module__, fn.__qualname__):
                raise HandlerError(f"generator name {name!r} is already registered by {owner.__module__}")
        _GENERATORS[name] = fn
        _GAPS[name] = tuple(known_gaps)
        if parse is not None:
            _PARSERS[name] = parse
        return fn
    return decorate


def known_gaps(name: str) -> tuple[KnownGap, ...]:
    """The gaps family ``name`` declares (see KnownGap)."""
    get_generator(name)
    return _GAPS.get(name, ())


def get_generator(name: str) -> Generator:
    try:
        return _GENERATORS[name]
    except KeyError:
        raise HandlerError(f"unknown strategy generator {name!r}; known: {sorted(_GENERATORS)}") from None


def parse_options(name: str, options: Mapping[str, object]) -> ParsedOptions | None:
    """Family ``name``'s options parsed (None: a family that takes none, given none)."""
    get_generator(name)
    if name in _PARSERS:
        return _PARSERS[name](dict(options))
    if options:
        raise OptionError(f"generator family {name!r} takes no options, got {', '.join(map(str, options))}",
                          key=next(iter(options)))
    return None


def generator_names() -> list[str]:
    return sorted(_GENERATORS)
