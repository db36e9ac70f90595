"""The einsum-like rule notation: ``"mk,kn->mn"``, ``"b h s d, b h t d -> b h s t"``, ``"...k,nk->...n"``.

An equation lists one *term* per tensor operand (in the spec's operand order), ``->``, then
one term per output. A term is a sequence of dims; a dim is a letter (a *factor*), a compound
``(a b)`` (one tensor dim holding several factors, major first: what flatten makes), ``1``
(a size-1 dim that holds no factor), ``m?`` (an optional dim: a tensor of too few dims lacks it,
as a vector lacks matmul's ``m``), or ``...`` (any number of leading batch dims, aligned
from the right across operands like broadcasting). Terms without spaces read one letter per
character (``mk``); terms with spaces read one name per word (``oh ow``). ``str`` gives the
spaced form back, and ``parse(str(eq)) == eq``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardverify.errors import InvalidArgument

__all__ = ["ELLIPSIS", "Dim", "Term", "Equation", "parse_equation", "torch_einsum_equation"]

ELLIPSIS = "..."
Dim = tuple[str, ...]          # factor names, major first; () is a size-1 dim; ("...",) the ellipsis
Term = tuple[Dim, ...]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\??\Z")
OPTIONAL = "?"   # ``m?``: a dim a tensor may lack (a vector in matmul); see rule.bind


@dataclass(frozen=True)
class Equation:
    inputs: tuple[Term, ...]
    outputs: tuple[Term, ...]

    def __str__(self) -> str:
        def dim(d: Dim) -> str:
            if d == (ELLIPSIS,):
                return ELLIPSIS
            if not d:
                return "1"
            return d[0] if len(d) == 1 else "(" + " ".join(d) + ")"

        def term(t: Term) -> str:
            return " ".join(dim(d) for d in t)

        return ", ".join(term(t) for t in self.inputs) + " -> " + ", ".join(term(t) for t in self.outputs)

    @property
    def letters(self) -> tuple[str, ...]:
        """Every factor name, in order of first appearance."""
        seen: dict[str, None] = {}
        for term in self.inputs + self.outputs:
            for dim in term:
                for name in dim:
                    if name != ELLIPSIS:
                        seen.setdefault(name.removesuffix(OPTIONAL), None)
        return tuple(seen)


def _tokens(text: str) -> list[str]:
    """Split one term into dim tokens: words when spaced, else characters (``...`` kept whole)."""
    text = text.strip()
    if not text:
        return []
    if " " in text or "(" in text:
        spaced = text.replace("(", " ( ").replace(")", " ) ").replace(ELLIPSIS, f" {ELLIPSIS} ")
        return spaced.split()
    tokens, i = [], 0
    while i < len(text):
        if text.startswith(ELLIPSIS, i):
            tokens.append(ELLIPSIS)
            i += 3
        elif text[i] == OPTIONAL and tokens and tokens[-1] != ELLIPSIS:
            tokens[-1] += OPTIONAL
            i += 1
        else:
            tokens.append(text[i])
            i += 1
    return tokens


def _term(text: str, where: str) -> Term:
    dims: list[Dim] = []
    group: list[str] | None = None
    for token in _tokens(text):
        if token == "(":
            if group is not None:
                raise InvalidArgument(f"{where}: nested '(' in {text!r}")
            group = []
        elif token == ")":
            if not group:
                raise InvalidArgument(f"{where}: ')' without a non-empty '(' group in {text!r}")
            dims.append(tuple(group))
            group = None
        elif token == ELLIPSIS:
            if group is not None or (ELLIPSIS,) in dims:
                raise InvalidArgument(f"{where}: '...' may appear once per term, outside groups, in {text!r}")
            dims.append((ELLIPSIS,))
        elif token == "1":
            if group is not None:
                raise InvalidArgument(f"{where}: '1' cannot sit inside a group in {text!r}")
            dims.append(())
        elif _NAME.match(token):
            if group is not None and token.endswith(OPTIONAL):
                raise InvalidArgument(f"{where}: an optional factor {token!r} cannot sit inside a group in {text!r}")
            if group is not None:
                group.append(token)
            else:
                dims.append((token,))
        else:
            raise InvalidArgument(f"{where}: {token!r} in {text!r} is not a factor name, '1', '...' or a group")
    if group is not None:
        raise InvalidArgument(f"{where}: unclosed '(' in {text!r}")
    names = [n for d in dims for n in d if n != ELLIPSIS]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidArgument(f"{where}: factor(s) {repeated} appear twice in {text!r} (diagonals are not supported)")
    return tuple(dims)


def parse_equation(text: str) -> Equation:
    """Parse ``"in1, in2 -> out1, out2"``; InvalidArgument names the bad piece."""
    if not isinstance(text, str):
        raise InvalidArgument(f"an equation must be a string, got {text!r}")
    if text.count("->") != 1:
        raise InvalidArgument(f"equation {text!r} needs exactly one '->'")
    left, right = text.split("->")
    inputs = tuple(_term(part, f"input {i} of {text!r}") for i, part in enumerate(left.split(",")))
    outputs = tuple(_term(part, f"output {i} of {text!r}") for i, part in enumerate(right.split(",")))
    if not left.strip():
        raise InvalidArgument(f"equation {text!r} has no input term")
    return Equation(inputs, outputs)


def torch_einsum_equation(text: object) -> Equation:
    """An equation written for ``torch.einsum``: one letter per dim, whitespace ignored, and
    without ``->`` the implicit output (the letters used once, in alphabetical order, after
    ``...`` when there is one)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"torch.einsum's equation must be a string, got {text!r}")
    compact = "".join(text.split())
    if "->" not in compact:
        letters = [c for c in compact.replace("...", "") if c.isalpha()]
        once = sorted(c for c in set(letters) if letters.count(c) == 1)
        compact += "->" + ("..." if "..." in compact else "") + "".join(once)
    return parse_equation(compact)
