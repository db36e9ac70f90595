"""Strict readers for spec values: every check names the file, line and field it rejects.

These are the only gates between YAML and generated code, so each returns a value that is
safe to emit: an identifier, a tuple of ints, a known dtype name, or a dotted torch name.
"""

from __future__ import annotations

import difflib
import functools
import keyword
import math
import re
import types
from typing import TYPE_CHECKING, Any

from shardverify.spec.loader import Node
from shardverify.errors import InvalidArgument, SpecError, shorten
from shardverify.spec.limits import MAX_TENSOR_ELEMENTS, mesh_problem
from shardverify.spec.names import resolve_dotted, resolve_torch
from shardverify.spec.trust import (TRUSTED_ENV, Definition, find_definition, op_target_refusal, trusted_modules,
                                    under)

if TYPE_CHECKING:
    import torch

__all__ = ["Fields", "as_identifier", "as_shape", "as_dtype", "as_factory", "allowed_definition", "as_mesh",
           "as_tolerance", "MAX_TOLERANCE", "resolve_target", "type_name",
           "check_type", "describe", "finite_number", "lookup", "MAX_NAME_CHARS"]

_TYPE_NAMES = {dict: "a mapping", list: "a list", str: "a string", int: "an integer",
               float: "a number", bool: "a boolean", type(None): "null"}


def type_name(kind: type) -> str:
    """How a YAML type is called in messages ("a mapping", "an integer")."""
    return _TYPE_NAMES.get(kind, kind.__name__)


def describe(node: Node) -> str:
    """Short description of a node's value for messages: "the string 'abc'"."""
    value = node.value
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    noun = {str: "string", int: "integer", float: "number", bool: "boolean"}.get(type(value), type(value).__name__)
    return f"{noun} {shorten(value)}"


def _matches(value: object, kinds: tuple[type, ...]) -> bool:
    if object in kinds:
        return True
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds and int not in kinds:
        return True  # 1 is a fine float
    return isinstance(value, kinds)


def check_type(node: Node, kind: type | tuple[type, ...]) -> Node:
    """Return `node` if its value is of `kind` (bool is not int; an int passes for float)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not _matches(node.value, kinds):
        wanted = " or ".join(type_name(k) for k in kinds)
        raise node.error(f"expected {wanted}, got {describe(node)}")
    return node


class Fields:
    """Reads one mapping node key by key; `finish()` rejects every key nobody asked for."""

    def __init__(self, node: Node) -> None:
        if not isinstance(node.value, dict):
            raise node.error(f"expected a mapping, got {describe(node)}")
        self.node = node
        self._asked: list[str] = []

    def _ask(self, key: str) -> Node | None:
        if key not in self._asked:
            self._asked.append(key)
        return self.node.value.get(key)  # type: ignore[union-attr]

    def required(self, key: str, kind: type | tuple[type, ...]) -> Node:
        """The value under `key`, which must exist and be of `kind`."""
        child = self._ask(key)
        if child is None:
            where = f" in '{self.node.path}'" if self.node.path else ""
            raise SpecError(f"missing required key '{key}'{where}", file=self.node.file,
                            line=self.node.key_line or self.node.line, field=self.node.child_path(key))
        return check_type(child, kind)

    def optional(self, key: str, kind: type | tuple[type, ...]) -> Node | None:
        """The value under `key` if present (it must then be of `kind`), else None."""
        child = self._ask(key)
        return None if child is None else check_type(child, kind)

    def keys(self) -> list[str]:
        """Every key of the mapping, in document order (for mappings of user-chosen names)."""
        return list(self.node.value)  # type: ignore[arg-type]

    def finish(self) -> None:
        """Raise on the first key that no `required`/`optional` call asked for."""
        for key, child in self.node.value.items():  # type: ignore[union-attr]
            if key in self._asked:
                continue
            allowed = ", ".join(self._asked) or "none"
            close = difflib.get_close_matches(key, self._asked, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(f"unknown key '{key}'{hint}; allowed keys: {allowed}", file=child.file,
                            line=child.key_line or child.line, field=child.path)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Longest op, operand, parameter or option name: names become file names and code.
MAX_NAME_CHARS = 64


def as_identifier(node: Node) -> str:
    """A plain ASCII Python identifier that is not a keyword (safe to emit as code)."""
    check_type(node, str)
    value = node.value
    assert isinstance(value, str)
    if len(value) > MAX_NAME_CHARS:
        raise node.error(f"the name {value[:40]!r}... has {len(value)} characters; at most {MAX_NAME_CHARS}")
    if not _IDENTIFIER.match(value) or keyword.iskeyword(value):
        raise node.error(f"expected a Python identifier (letters, digits, '_', not a keyword), "
                         f"got {shorten(value)}")
    return value


def as_shape(node: Node, *, allow_empty: bool = True) -> tuple[int, ...]:
    """A list of positive ints, e.g. a tensor shape or a mesh shape, of at most
    MAX_TENSOR_ELEMENTS elements (every shape of every spec kind has the one bound)."""
    check_type(node, list)
    items = node.value
    assert isinstance(items, list)
    if not items and not allow_empty:
        raise node.error("expected a non-empty list of positive integers, got []")
    for item in items:
        if isinstance(item.value, bool) or not isinstance(item.value, int) or item.value <= 0:
            raise item.error(f"expected a positive integer, got {describe(item)}")
    shape = tuple(item.value for item in items)
    too_big = MAX_TENSOR_ELEMENTS.exceeded(math.prod(shape))  # type: ignore[arg-type]
    if too_big:
        raise node.error(f"shape {shorten(list(shape))}: {too_big}")
    return shape  # type: ignore[return-value]


def as_mesh(node: Node) -> tuple[int, ...]:
    """A mesh shape: positive sizes within the axis and rank limits (every spec kind and
    command applies the one `limits.mesh_problem`)."""
    shape = as_shape(node, allow_empty=False)
    too_many = mesh_problem(shape)
    if too_many:
        raise node.error(too_many)
    return shape


@functools.lru_cache(maxsize=1)
def _dtype_names() -> tuple[str, ...]:
    import torch

    return tuple(sorted(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
                        and name in _CHECKABLE_DTYPES))


#: the dtypes a check can draw values in and compare: real floats, integers, bool and complex (compared
#: as their real and imaginary parts; quantized and float8 dtypes have no random draw or no comparison)
_CHECKABLE_DTYPES = ("float16", "bfloat16", "float32", "float64", "half", "float", "double",
                     "int8", "int16", "int32", "int64", "uint8", "short", "int", "long", "bool",
                     "complex64", "complex128", "cfloat", "cdouble")


def as_dtype(node: Node) -> str:
    """A torch dtype name such as "float32" ("torch.float32" is accepted too)."""
    check_type(node, str)
    name = str(node.value)
    name = name[len("torch."):] if name.startswith("torch.") else name
    names = _dtype_names()
    import torch

    if name not in names and isinstance(getattr(torch, name, None), torch.dtype):
        raise node.error(f"torch.{name} is a dtype a check cannot draw values in and compare; use a real "
                         f"floating, complex, integer or bool dtype ({', '.join(n for n in names if n in _CHECKABLE_DTYPES[:4])}, "
                         "int64, bool, ...)")
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise node.error(f"unknown torch dtype {shorten(node.value)}{hint}")
    return name


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; a dtype is returned as is."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"{name!r} is not a torch dtype name (expected e.g. 'float32', 'bfloat16')")
    return dtype


#: dotted names of public parts; a dunder part is public too (Python's operators: aten.__and__.Tensor)
_DOTTED = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.([A-Za-z][A-Za-z0-9_]*|__[a-z]+__))*\Z")
#: an ATen overload whose op name starts with one underscore: the Core ATen IR names some so
#: (aten._softmax.default, aten._to_copy.default), and it is the stable surface torch.export emits
_ATEN_UNDERSCORED = re.compile(r"torch\.ops\.aten\._[a-z][a-z0-9_]*\.[A-Za-z][A-Za-z0-9_]*\Z")


def lookup(dotted: str) -> Any:
    """Resolve a target's dotted name while a spec is read (raises a LookupError): one under torch
    by attribute from torch, importing no module by its name (names.resolve_torch); another only
    where the machine trusts it (resolve_target checked), importing it as the machine asked."""
    if isinstance(dotted, str) and dotted.split(".")[0] == "torch":
        return resolve_torch(dotted)
    return resolve_dotted(dotted)


def resolve_target(node: Node) -> str:
    """A dotted name under `torch` that names a real callable or class; returns the name.

    Only `torch.*` is resolved, by attribute (importing a module named by a spec would run its
    code), and modules of the user's own the machine trusts; only what spec/trust.py allows is
    accepted (a tensor op of torch, or a function or class defined in a trusted module, matched
    by object) and private names are refused (they are not a stable surface to verify)."""
    check_type(node, str)
    name = str(node.value)
    if len(name) > 200 or not (_DOTTED.match(name) or _ATEN_UNDERSCORED.match(name)):
        raise node.error(f"expected a dotted name such as 'torch.sum' (no private parts), "
                         f"got {shorten(name)}")
    try:
        trusted = under(name, trusted_modules())
    except InvalidArgument as exc:
        raise node.error(str(exc)) from None
    if name.split(".")[0] != "torch" and not trusted:
        raise node.error(f"target {name!r} is not under 'torch'; expected e.g. 'torch.sum', "
                         f"'torch.Tensor.sum' or 'torch.nn.Linear' (or trust its module in {TRUSTED_ENV})")
    try:
        obj = lookup(name)
    except LookupError as exc:
        raise node.error(f"target {name!r} does not resolve: {exc}") from None
    if isinstance(obj, types.ModuleType) or not callable(obj):
        raise node.error(f"target {name!r} resolves to {type(obj).__name__}, not a callable or class")
    refusal = op_target_refusal(name, obj)
    if refusal:
        raise node.error(f"target {refusal}")
    return name


def target_form(node: Node, name: str) -> str:
    """How a resolved target is called: "module" (a torch.nn.Module class), "method" (a
    torch.Tensor method) or "function"; any other class is an error at ``node``."""
    import torch

    obj = lookup(name)
    if isinstance(obj, type):
        if issubclass(obj, torch.nn.Module):
            return "module"
        raise node.error(f"target {name!r} is a class but not a torch.nn.Module")
    if name.startswith("torch.Tensor."):
        return "method"
    return "function"


def allowed_definition(node: Node, what: str) -> Definition:
    """The function or class ``node``'s dotted name names (a factory, a collective's
    implementation): allowed by spec/allow.py's rule first (a torch.nn.Module class, a zoo, a
    trusted module of the user's own), then found in its module's source without importing or
    calling anything (spec/trust.py); an error names ``what`` at the node's line."""
    from shardverify.spec.allow import name_refusal, project_of

    name = str(node.value)
    try:
        refusal = name_refusal(name, project_of(node.file))
        if refusal:
            raise node.error(f"{what}: {refusal}")
        return find_definition(name)
    except InvalidArgument as error:
        raise node.error(f"{what}: {error}") from None


def as_factory(node: Node, kwargs_node: Node | None, kwargs: dict[str, object]) -> str:
    """A factory's dotted name (plan and model specs), allowed and found by
    :func:`allowed_definition`, the spec's keyword arguments bound to its parameters; errors
    name the factory's or the kwargs' line."""
    name = str(node.value)
    definition = allowed_definition(node, "factory")
    if definition.signature is not None:
        try:
            definition.signature.bind(**kwargs)
        except TypeError as error:
            raise (kwargs_node or node).error(f"{name}(**{kwargs!r}) does not bind: {error}") from None
    return name


#: the loosest rtol or atol a spec may ask for: bfloat16's own default rtol is 1.6e-2, and a
#: tolerance near 1 lets results that are wrong by a whole value pass (a wrong mean rule passed
#: every check with 1e6)
MAX_TOLERANCE = 0.1


def as_tolerance(node: Node) -> float:
    """An rtol or atol: a finite number in [0, MAX_TOLERANCE]."""
    value = finite_number(node)
    if not 0 <= value <= MAX_TOLERANCE:
        raise node.error(f"expected a tolerance in [0, {MAX_TOLERANCE}], got {shorten(node.value)}: a looser one lets "
                         "a wrong rule pass")
    return value


def finite_number(node: Node) -> float:
    """A finite int or float (tolerances); NaN and infinities are rejected."""
    check_type(node, float)
    value = float(node.value)  # type: ignore[arg-type]
    if not math.isfinite(value):
        raise node.error(f"expected a finite number, got {shorten(node.value)}")
    return value
