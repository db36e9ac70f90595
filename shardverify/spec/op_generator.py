"""An op spec's ``generator:`` section: the family, and its options parsed once by the family
(the rules family's :class:`~shardverify.strategies.rules.sources.RuleSpec`), which the spec
then carries. Every error names the YAML line of the key at fault, or of the item inside it: a
bad key, a value that does not parse, a parameter or operand it names that the spec does not
declare."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardverify.spec.fields import Fields, as_identifier
from shardverify.spec.loader import Node
from shardverify.strategies.declarations import OperandDecl, ParamDecl
from shardverify.spec.values import Literal, key_node, names_of, option
from shardverify.strategies.options import OPERAND, At, OptionError, ParsedOptions
from shardverify.strategies.generators.registry import get_generator, parse_options
from shardverify.strategies.rules.sources import RuleSpec

__all__ = ["parse_generator"]


def parse_generator(node: Node, params: Sequence[ParamDecl], operands: Sequence[OperandDecl]
                    ) -> tuple[str, tuple[tuple[str, Literal], ...], ParsedOptions | None]:
    """(family, options as written, options as the family parsed them)."""
    g = Fields(node)
    family = _family(g.required("family", str))
    options_node = g.optional("options", dict)
    g.finish()
    options = tuple((key, option(value)) for key, value in names_of(options_node)) if options_node else ()
    try:
        parsed = parse_options(family, dict(options))
        if parsed is not None:
            parsed.check_operands(operands)
    except OptionError as exc:
        raise _at(options_node or node, exc.key, exc.at).error(f"invalid sharding rule: {exc}") from None
    if isinstance(parsed, RuleSpec):   # where an error at a call points
        file, line, _ = (options_node or node).where()
        parsed = dataclasses.replace(parsed, at=f"{file}:{line}")
    declared = {"param": sorted(p.name for p in params), OPERAND: sorted(o.role for o in operands)}
    for ref in parsed.refs if parsed is not None else ():
        if ref.name not in declared[ref.kind]:
            raise _at(options_node or node, ref.key, ref.at).error(
                f"option '{ref.key}' names {'parameter' if ref.kind == 'param' else 'operand'} {ref.name!r}, which "
                f"the spec does not declare; declared: {', '.join(declared[ref.kind]) or 'none'}")
    return family, options, parsed


def _family(node: Node) -> str:
    family = as_identifier(node)
    try:
        get_generator(family)
    except Exception as exc:  # the registry's own "unknown generator" error, whatever its class
        raise node.error(f"unknown generator family {family!r}: {exc}") from None
    return family


def _at(options: Node, key: str | None, at: At) -> Node:
    """The node of option ``key`` (the options themselves without one), and of the item ``at``
    inside its value as far as the YAML holds it (a mapping key by its own line)."""
    if key is None or not isinstance(options.value, dict) or key not in options.value:
        return options
    node = key_node(options, key) if not at else options.value[key]
    for step in at:
        if isinstance(step, int) and isinstance(node.value, list) and 0 <= step < len(node.value):
            node = node.value[step]
        elif isinstance(step, str) and isinstance(node.value, dict) and step in node.value:
            return key_node(node, step)
        else:
            break
    return node
