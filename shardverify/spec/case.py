"""OpCase: one op instance to verify, as a picklable value that every rank rebuilds identically.

The harness model around the op is generic, with no per-op code:
module target ``module(pred(x), *others)``, function target ``target(pred(x), *others, **params)``,
``torch.Tensor.<name>`` target ``pred(x).<name>(*others, **params)``; ``pred`` is the optional
predecessor module (whose strategies a following op such as sum takes up). A call whose
positional arguments are not just its tensors in order (``torch.einsum(eq, a, b)``,
``torch.cat([a, b], 1)``, ``F.layer_norm(x, shape, weight)``) lists them in ``positional``.
"""

from __future__ import annotations

import inspect
import keyword
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import fx

from shardverify.errors import InvalidArgument, shorten
from shardverify.spec.names import resolve_dotted
from shardverify.spec.fields import dtype_from_name

__all__ = ["InputDecl", "ModuleDecl", "CallArg", "OpCase", "resolve", "cached"]

T = TypeVar("T")


def resolve(dotted: str) -> object:
    """The object a dotted name such as ``"torch.nn.Linear"`` or ``"torch.Tensor.sum"`` names
    (InvalidArgument when it names nothing)."""
    return resolve_dotted(dotted)


def _tupled(value: object) -> object:
    """Lists (from YAML) become tuples so a case stays hashable and its repr stays a literal."""
    if isinstance(value, (list, tuple)):
        return tuple(_tupled(v) for v in value)
    return value


def _pairs(what: str, value: object) -> tuple[tuple[str, object], ...]:
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = tuple((k, _tupled(v)) for k, v in items)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what} must be (name, value) pairs or a dict, got {value!r}") from None
    for key, _ in pairs:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidArgument(f"{what}: keyword {key!r} is not an identifier")
    if len({k for k, _ in pairs}) != len(pairs):
        raise InvalidArgument(f"{what}: repeated keyword in {pairs!r}")
    return pairs


@dataclass(frozen=True)
class InputDecl:
    """A placeholder of the harness model."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    #: [low, high) the values are drawn from (ids below a vocabulary, positive variances);
    #: None: the dtype's default draw
    values: tuple[float, float] | None = None
    #: False: the op takes no gradient for it (batch norm's running statistics)
    grad: bool = True
    #: the exact values, row-major, where no draw makes valid data (embedding_bag's offsets: 0 first,
    #: nondecreasing); None: drawn
    data: tuple[float, ...] | None = None

    def example(self) -> torch.Tensor:
        """A CPU tensor of this input's shape, dtype and data (its ``data``, else drawn in ``values``
        with a fixed seed; floats in [0.5, 1.5) by default, integers 0): what the shapes of an op
        that reads its values are worked out on, not the check's data."""
        dtype = self.torch_dtype
        if self.data is not None:
            return torch.tensor(self.data, dtype=torch.float64).reshape(self.shape).to(dtype)
        generator = torch.Generator().manual_seed(0)
        low, high = self.values if self.values is not None else (0.5, 1.5) if dtype.is_floating_point else (0, 1)
        drawn = torch.rand(self.shape, generator=generator, dtype=torch.float64) * (high - low) + low
        return drawn.to(dtype) if dtype.is_floating_point or dtype.is_complex else drawn.floor().to(dtype)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or keyword.iskeyword(self.name):
            raise InvalidArgument(f"input name must be a Python identifier, got {self.name!r}")
        shape = _tupled(self.shape)
        if not isinstance(shape, tuple) or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0
                                               for s in shape):
            raise InvalidArgument(f"input {self.name!r}: shape must be a tuple of positive ints, "
                                  f"got {shorten(self.shape)}")
        object.__setattr__(self, "shape", shape)
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        dtype = dtype_from_name(self.dtype)
        if self.values is not None:
            low, high = _tupled(self.values) if isinstance(self.values, (list, tuple)) else (None, None)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       for v in (low, high)) or not low < high:  # type: ignore[operator]
                raise InvalidArgument(f"input {self.name!r}: values must be [low, high) with low < high, "
                                      f"got {shorten(self.values)}")
            if not dtype.is_floating_point and not (float(low).is_integer() and float(high).is_integer()):  # type: ignore[arg-type]
                raise InvalidArgument(f"input {self.name!r}: values of an integer input are integer bounds, "
                                      f"got {shorten(self.values)}")
            object.__setattr__(self, "values", (low, high))
        if self.data is not None:
            data = _tupled(self.data)
            if not isinstance(data, tuple) or len(data) != math.prod(shape) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in data):
                raise InvalidArgument(f"input {self.name!r}: data must be {math.prod(shape)} finite number(s) "
                                      f"(its shape's elements, row-major), got {shorten(self.data)}")
            if not dtype.is_floating_point and not all(float(v).is_integer() for v in data):
                raise InvalidArgument(f"input {self.name!r}: data of an integer input are integers, "
                                      f"got {shorten(self.data)}")
            object.__setattr__(self, "data", data)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class ModuleDecl:
    """How to build a module: ``target(*args, **dict(kwargs))``."""

    target: str
    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        cls = resolve(self.target)
        if not (inspect.isclass(cls) and issubclass(cls, torch.nn.Module)):
            raise InvalidArgument(f"module target {self.target!r} is not a torch.nn.Module class")
        object.__setattr__(self, "args", _tupled(tuple(self.args)))
        object.__setattr__(self, "kwargs", _pairs(f"kwargs of {self.target}", self.kwargs))

    def instantiate(self) -> torch.nn.Module:
        return resolve(self.target)(*self.args, **dict(self.kwargs))

    def describe(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.target.rsplit('.', 1)[-1]}({', '.join(parts)})"


ARG_KINDS = ("tensor", "list", "value", "keyword")


@dataclass(frozen=True)
class CallArg:
    """One argument of the op's call: positionally ``tensor`` (an input by name), ``list`` (a
    tuple of input names, passed as a list: torch.cat's tensors) or ``value`` (a constant:
    einsum's equation, layer_norm's normalized_shape, None for a dropped optional tensor); or
    ``keyword``, a (keyword, input name) pair: a keyword-only tensor (segment_reduce's lengths),
    passed by its keyword after the positional ones."""

    kind: str
    value: object

    def __post_init__(self) -> None:
        if self.kind not in ARG_KINDS:
            raise InvalidArgument(f"call argument kind must be one of {', '.join(ARG_KINDS)}, got {self.kind!r}")
        value = _tupled(self.value)
        if self.kind == "tensor" and not isinstance(value, str):
            raise InvalidArgument(f"a tensor argument names an input, got {self.value!r}")
        if self.kind == "list" and not (isinstance(value, tuple) and value and all(isinstance(v, str) for v in value)):
            raise InvalidArgument(f"a list argument names one or more inputs, got {self.value!r}")
        if self.kind == "keyword" and not (isinstance(value, tuple) and len(value) == 2
                                           and all(isinstance(v, str) for v in value)):
            raise InvalidArgument(f"a keyword argument is a (keyword, input name) pair, got {self.value!r}")
        object.__setattr__(self, "value", value)

    def names(self) -> tuple[str, ...]:
        """The inputs this argument passes."""
        return (self.value,) if self.kind == "tensor" else self.value if self.kind == "list" else \
            (self.value[1],) if self.kind == "keyword" else ()  # type: ignore[return-value,index]


@dataclass(frozen=True)
class OpCase:
    """One grid point of an op spec: the harness model, its inputs, the call's parameters."""

    op: str
    target: str
    inputs: tuple[InputDecl, ...]
    params: tuple[tuple[str, object], ...] = ()
    module: ModuleDecl | None = None
    predecessor: ModuleDecl | None = None
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None
    positional: tuple[CallArg, ...] = ()   # empty: the inputs in order
    #: check in a child process (verify/isolated.py): the op's kernel can corrupt memory or trap
    isolate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise InvalidArgument(f"op must be a non-empty name, got {self.op!r}")
        target = resolve(self.target)
        is_module = inspect.isclass(target) and issubclass(target, torch.nn.Module)
        if is_module and (self.module is None or self.module.target != self.target):
            raise InvalidArgument(f"case {self.op!r}: module target {self.target!r} needs "
                                  f"module=ModuleDecl({self.target!r}, ...), got {self.module!r}")
        if not is_module and self.module is not None:
            raise InvalidArgument(f"case {self.op!r}: target {self.target!r} is not a module, "
                                  f"so module must be None, got {self.module!r}")
        if not is_module and not callable(target):
            raise InvalidArgument(f"case {self.op!r}: target {self.target!r} is not callable")
        if is_module and self.params:
            raise InvalidArgument(f"case {self.op!r}: a module target takes its settings in module=, "
                                  f"not params={self.params!r}")
        inputs = tuple(self.inputs)
        # no input: a factory (torch.full), called with its parameters alone; a module or a
        # predecessor needs one
        if (not inputs and (is_module or self.predecessor is not None)) or \
                not all(isinstance(i, InputDecl) for i in inputs):
            raise InvalidArgument(f"case {self.op!r}: inputs must be a non-empty tuple of InputDecl, got {self.inputs!r}")
        if len({i.name for i in inputs}) != len(inputs):
            raise InvalidArgument(f"case {self.op!r}: input names repeat: {[i.name for i in inputs]}")
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "params", _pairs(f"params of case {self.op!r}", self.params))
        if self.predecessor is not None and not isinstance(self.predecessor, ModuleDecl):
            raise InvalidArgument(f"case {self.op!r}: predecessor must be a ModuleDecl, got {self.predecessor!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgument(f"case {self.op!r}: seed must be an int >= 0, got {self.seed!r}")
        self._check_positional(is_module)
        if not isinstance(self.isolate, bool):
            raise InvalidArgument(f"case {self.op!r}: isolate must be True or False, got {self.isolate!r}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise InvalidArgument(f"case {self.op!r}: {name} must be None or a number >= 0, got {value!r}")

    def _check_positional(self, is_module: bool) -> None:
        positional = tuple(self.positional)
        if not positional:
            return
        if is_module:
            raise InvalidArgument(f"case {self.op!r}: a module target takes its inputs in order; "
                                  f"positional={positional!r} applies to function and method targets")
        if not all(isinstance(a, CallArg) for a in positional):
            raise InvalidArgument(f"case {self.op!r}: positional must be a tuple of CallArg, got {positional!r}")
        passed = [name for arg in positional for name in arg.names()]
        names = [i.name for i in self.inputs]
        if sorted(passed) != sorted(names):
            raise InvalidArgument(f"case {self.op!r}: positional arguments pass inputs {passed}; every input "
                                  f"{names} must be passed exactly once")
        if self.target.startswith("torch.Tensor.") and positional[0].kind != "tensor":
            raise InvalidArgument(f"case {self.op!r}: method target {self.target!r} needs a tensor first (self), "
                                  f"got {positional[0]!r}")
        object.__setattr__(self, "positional", positional)

    # ---- the harness ---------------------------------------------------------------
    def harness(self) -> fx.GraphModule:
        """The untraced harness model as a hand-built fx graph (no per-op code)."""
        root = torch.nn.Module()
        graph = fx.Graph()
        placeholders = [graph.placeholder(i.name) for i in self.inputs]
        if not placeholders:        # a factory (torch.full): the call takes its parameters alone
            graph.output(graph.call_function(resolve(self.target), (), {k: call_value(v) for k, v in self.params}))
            return fx.GraphModule(root, graph)
        x, others = placeholders[0], tuple(placeholders[1:])
        if self.predecessor is not None:
            pred_name = _attribute_name(self.predecessor.target)
            root.add_module(pred_name, self.predecessor.instantiate())
            x = graph.call_module(pred_name, (x,))
        else:
            pred_name = None
        params = {key: call_value(value) for key, value in self.params}
        if self.positional:
            by_name = {i.name: p for i, p in zip(self.inputs, (x, *others))}
            args = tuple(by_name[a.value] if a.kind == "tensor" else [by_name[n] for n in a.value]
                         if a.kind == "list" else call_value(a.value) for a in self.positional
                         if a.kind != "keyword")  # type: ignore[union-attr]
            params.update({a.value[0]: by_name[a.value[1]] for a in self.positional if a.kind == "keyword"})  # type: ignore[index]
        else:
            args = (x, *others)
        if self.module is not None:
            name = _attribute_name(self.target)
            name = f"{name}_op" if name == pred_name else name
            root.add_module(name, self.module.instantiate())
            out = graph.call_module(name, (x, *others))
        elif self.target.startswith("torch.Tensor."):
            out = graph.call_method(self.target.rsplit(".", 1)[1], args, params)
        else:
            out = graph.call_function(resolve(self.target), args, params)
        graph.output(out)
        return fx.GraphModule(root, graph)

    def build(self) -> tuple[fx.GraphModule, str]:
        """The traced harness (shapes propagated on meta tensors) and the name of the op's node.

        Built once per process and case: every rank of a backend asks for the same one.
        """
        with _BUILD_LOCK:
            return cached(_BUILT, self, self._trace)

    def _trace(self) -> tuple[fx.GraphModule, str]:
        from shardverify.capture.fx import trace

        meta = {i.name: torch.empty(i.shape, dtype=i.torch_dtype, device="meta") for i in self.inputs}
        try:
            graph_module = trace(self.harness(), meta_args=meta)
        except Exception:  # noqa: BLE001 - an op with no meta kernel, or one that reads its input's values
            # (torch.cov compares tensors, gaussian_nll_loss checks var's sign): shapes from real data
            graph_module = trace(self.harness(), meta_args={i.name: i.example() for i in self.inputs})
        output = next(n for n in graph_module.graph.nodes if n.op == "output")
        node = output.args[0]
        if not isinstance(node, fx.Node):
            raise InvalidArgument(f"case {self.describe()}: the op's result is not a single node")
        if "tensor_meta" not in node.meta:   # x.__truediv__() without its operand: NotImplemented
            raise InvalidArgument(f"case {self.describe()}: the op returns {node.meta.get('type', 'no tensor')}, "
                                  f"not a tensor")
        return graph_module, node.name

    def describe(self) -> str:
        """A one-line human name: ``sum(x: float32[4, 8], dim=(0,), keepdim=True) after Linear(8, 16)``."""
        shown = {i.name: f"{i.name}: {i.dtype}{list(i.shape)}" for i in self.inputs}
        inputs = ", ".join(shown.values())
        if self.positional:
            inputs = ", ".join(shown[a.value] if a.kind == "tensor" else  # type: ignore[index]
                               f"[{', '.join(shown[n] for n in a.value)}]" if a.kind == "list"  # type: ignore[union-attr]
                               else f"{a.value[0]}={shown[a.value[1]]}" if a.kind == "keyword"  # type: ignore[index]
                               else repr(a.value) for a in self.positional)
        if self.module is not None:
            head = f"{self.module.describe()}({inputs})"
        else:
            params = "".join(f", {k}={v!r}" for k, v in self.params)
            head = f"{self.target.rsplit('.', 1)[-1]}({inputs}{params})"
        if self.predecessor is not None:
            head += f" after {self.predecessor.describe()}"
        return head + (f" seed={self.seed}" if self.seed else "")


_BUILD_LOCK = threading.RLock()
_BUILT: dict = {}
CACHE_SIZE = 64


def cached(cache: dict, key: object, make: Callable[[], T]) -> T:
    """``make()`` once per key in a small per-process cache (oldest entry evicted first);
    an unhashable key (an exotic parameter value) is simply never cached. Callers lock."""
    try:
        if key in cache:
            return cache[key]
    except TypeError:
        return make()
    value = make()
    if len(cache) >= CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def call_value(value: object) -> object:
    """A spec literal as the call takes it: ``"torch.float64"`` is that dtype (a YAML spec has no
    other way to write one: ``aten.to.dtype``'s argument); anything else as written."""
    if isinstance(value, str) and value.startswith("torch."):
        try:
            return dtype_from_name(value.removeprefix("torch."))
        except InvalidArgument:
            pass
    return value


def _attribute_name(target: str) -> str:
    return target.rsplit(".", 1)[-1].lower()
