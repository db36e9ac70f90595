"""A generator family's options as it parsed them: what they name and where.

A family parses its options once (``register_generator(name, parse=...)``) into a value that
says which call parameters and operands it names (:class:`Ref`), so the spec checks each name
against its declarations and explore knows what a parameter holds, with no guessing from key
names. A bad value raises :class:`OptionError` naming its key and the item inside it, which the
spec turns into its own YAML line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shardverify.errors import InvalidArgument
from shardverify.strategies.declarations import OperandDecl

__all__ = ["PARAM", "OPERAND", "Ref", "OptionError", "ParsedOptions"]

PARAM, OPERAND = "param", "operand"

#: where inside an option's value: list positions and mapping keys, outermost first
At = tuple[int | str, ...]


@dataclass(frozen=True)
class Ref:
    """One name an option holds: ``kind`` PARAM or OPERAND, at ``key`` (``at`` inside its
    value); ``draw`` how explore draws a parameter it names ("dims", "permutation", "shape",
    or "" by its values)."""

    key: str
    at: At
    kind: str
    name: str
    draw: str = ""


class OptionError(InvalidArgument):
    """A generator option that does not parse: ``key`` is the option (None: the options as a
    whole), ``at`` the item inside its value."""

    def __init__(self, message: str, key: str | None = None, at: At = ()) -> None:
        super().__init__(message)
        self.key, self.at = key, tuple(at)


class ParsedOptions(Protocol):
    """What a family's parse returns: its names, and a check of how the handler declares its
    operands (advanced indexing reads them in one order)."""

    refs: tuple[Ref, ...]

    def check_operands(self, operands: Sequence[OperandDecl]) -> None:
        """Raise OptionError where the declared operands (role, kind, index, element) do not
        fit the options."""
