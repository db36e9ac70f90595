"""How an op's call is read: where each tensor operand and each parameter sits. One declaration
per concept, made by the spec parser (with its YAML checks) and carried unchanged by the handler
a spec generates, so what runs is what was parsed."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.errors import HandlerError

__all__ = ["OPERAND_KINDS", "OperandDecl", "ParamDecl"]

OPERAND_KINDS = ("input", "param", "output")


@dataclass(frozen=True)
class OperandDecl:
    """Where one operand comes from.

    ``kind="input"``: a call argument at positional ``index`` or ``keyword``.
    ``kind="param"``: on a ``call_module`` node the module attribute ``attribute``; on a
    function/method call the argument at ``index``/``keyword`` (F.linear's weight).
    ``kind="output"``: the node's result; with ``index`` the element ``index`` of a tuple
    result (``torch.max(x, dim)``: values 0, indices 1); without it a tuple result gives one
    operand per element (split/chunk), with roles ``<role>.<i>``.
    ``element``: the operand is element ``element`` of the list argument at ``index``
    (torch.cat's tensors). ``variadic``: every element of that list argument is an operand of
    this one role, however many the call passes; they resolve as ``<role>.<i>`` in order, each
    with its own layout, and a rule option naming the role names them all. For ``call_method``
    nodes index 0 is ``self``. An optional input
    that the call fills with a number (``torch.add(x, 2.0)``) is absent, like an omitted one.
    """

    role: str
    kind: str
    index: int | None = None
    keyword: str | None = None
    attribute: str | None = None
    optional: bool = False
    element: int | None = None
    variadic: bool = False

    def __post_init__(self) -> None:
        if self.variadic and (self.kind != "input" or self.element is not None or self.index is None):
            raise HandlerError(f"operand {self.role!r}: a variadic operand is every element of the list "
                               f"argument at its index (an input, with an index and no element)")
        if self.kind not in OPERAND_KINDS:
            raise HandlerError(f"operand {self.role!r}: kind {self.kind!r} is not one of {OPERAND_KINDS}")
        if self.kind == "input" and self.index is None and self.keyword is None:
            raise HandlerError(f"input operand {self.role!r} needs an index or a keyword")
        if self.kind == "param" and self.index is None and self.keyword is None and self.attribute is None:
            raise HandlerError(f"param operand {self.role!r} needs an attribute, an index or a keyword")


@dataclass(frozen=True)
class ParamDecl:
    """A non-tensor call parameter (``dim``, ``keepdim``) read from the call, else ``default``.
    ``varargs``: the parameter is every positional argument from ``index`` on when the call
    passes them unpacked (``x.view(8, 16)``), or the one sequence there (``x.view((8, 16))``)."""

    name: str
    index: int | None = None
    keyword: str | None = None
    default: object = None
    varargs: bool = False
    any_value: bool = False        # `serves: any`: the rule holds for every value, not only the grid's
    choices: tuple = ()            # every value the op takes (a string's), for the explorer to draw
