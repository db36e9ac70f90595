"""Plain values in a spec: YAML literals, generator option values, mappings of user-chosen names,
the case grid and ``where:`` selections of its points (shared by the op spec's ``verify`` and
``audit`` sections)."""

from __future__ import annotations

from shardverify.errors import shorten
from shardverify.spec.fields import Fields, as_identifier, check_type, describe, finite_number
from shardverify.spec.limits import MAX_CASES
from shardverify.spec.loader import Node

__all__ = ["Literal", "literal", "option", "key_node", "index_value", "names_of", "within", "parse_grid",
           "parse_where"]

Literal = object  # a plain, repr()-safe value: None, bool, int, float, str, or tuples of them


def literal(node: Node) -> Literal:
    """A plain literal from YAML (lists become tuples; mappings are refused)."""
    value = node.value
    if isinstance(value, list):
        return tuple(literal(item) for item in value)
    if isinstance(value, dict):
        raise node.error("expected a scalar or a list, got a mapping")
    if isinstance(value, float):
        return finite_number(node)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise node.error(f"expected a plain value (number, boolean, string, null or list), got {describe(node)}")


def option(node: Node) -> Literal:
    """A generator option value: a literal, or a mapping (kept as (key, value) pairs in
    document order, so the HandlerDef stays hashable)."""
    if isinstance(node.value, dict):
        fields = Fields(node)
        pairs = []
        for key in fields.keys():
            pairs.append((as_identifier(key_node(node, key)), option(fields.required(key, object))))
        fields.finish()
        return tuple(pairs)
    return literal(node)


def key_node(mapping: Node, key: str) -> Node:
    """A Node for a mapping key itself, so bad names are reported on the key's line."""
    child = mapping.value[key]  # type: ignore[index]
    return Node(key, child.file, child.key_line or child.line, child.path)


def index_value(node: Node | None) -> int | None:
    if node is None:
        return None
    check_type(node, int)
    if node.value < 0:  # type: ignore[operator]
        raise node.error(f"expected a non-negative positional index, got {shorten(node.value)}")
    return node.value  # type: ignore[return-value]


def names_of(node: Node) -> list[tuple[str, Node]]:
    """(validated identifier, value node) for each key of a mapping of user-chosen names."""
    f = Fields(node)
    return [(as_identifier(key_node(node, key)), f.required(key, object)) for key in f.keys()]


def parse_grid(node: Node) -> tuple[tuple[str, tuple[Literal, ...]], ...]:
    grid = []
    for key, values in names_of(node):
        check_type(values, list)
        within(values, [MAX_CASES.exceeded(len(values.value))])   # before the pairwise duplicate check
        if not values.value:
            raise values.error(f"grid values for '{key}' are empty; list at least one value")
        literals = tuple(literal(item) for item in values.value)  # type: ignore[union-attr]
        for position, (item, value) in enumerate(zip(values.value, literals)):  # type: ignore[arg-type]
            if any(value == prev and type(value) is type(prev) for prev in literals[:position]):
                raise item.error(f"grid value {shorten(value)} for '{key}' is listed twice")
        grid.append((key, literals))
    return tuple(grid)


def parse_where(node: Node | None, grid: dict[str, tuple[Literal, ...]]) -> tuple[tuple[str, Literal], ...]:
    """A ``where:`` mapping selecting grid points: each key a grid key, each value one of its values
    (shared by ``verify.strategies`` and ``audit.accept``)."""
    where = []
    for key, value_node in (names_of(node) if node else []):
        if key not in grid:
            raise value_node.error(f"'{key}' is not a grid key; grid keys: {', '.join(grid) or 'none'}")
        value = literal(value_node)
        if not any(value == v and type(value) is type(v) for v in grid[key]):
            raise value_node.error(f"{shorten(value)} is not one of the grid values {shorten(list(grid[key]))} "
                                   f"of '{key}'")
        where.append((key, value))
    return tuple(where)


def within(node: Node, problems: list[str]) -> None:
    """A SpecError at ``node`` for the first limit exceeded (see spec/limits.py)."""
    for problem in problems:
        if problem:
            raise node.error(problem)
