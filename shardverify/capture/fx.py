"""Trace a module with torch.fx and annotate every node with its shape, using meta tensors.

torch's Python-level masked reductions (``torch.masked.sum``, ``torch.masked.softmax``, ...)
branch on their arguments' layout and values, which torch.fx cannot trace into; they are
recorded as calls, as ``torch.fx.wrap`` would record them, and decomposed to ATen where nothing
serves them (:mod:`shardverify.capture.decompose`), as torch.export decomposes them.

Shapes are propagated with torch's own ``ShapeProp`` on meta tensors (a module's weights on a
meta copy of it; a module without weights runs as it is), so no real memory is allocated for
activations however large the inputs are described to be. The returned graph module keeps the
original (real) parameters for later verification.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Mapping

import torch
import torch.masked
from torch.fx import GraphModule, Tracer
from torch.fx.passes.shape_prop import ShapeProp

from shardverify.capture.call import meta_devices
from shardverify.errors import InvalidArgument

__all__ = ["trace", "forward_names", "omitted_defaults", "unprinted_tracebacks", "UnprintedTraceback"]


class UnprintedTraceback:
    """Stands in for the ``traceback`` module inside torch's ShapeProp, which prints the traceback
    of a node that fails before raising it with the cause attached: the caller says the cause."""

    @staticmethod
    def print_exc(*args, **kwargs) -> None:
        return None

    def __getattr__(self, name):
        import traceback

        return getattr(traceback, name)


@contextlib.contextmanager
def unprinted_tracebacks():
    """ShapeProp printing no traceback while in the block."""
    from torch.fx.passes import shape_prop

    printer = getattr(shape_prop, "traceback", None)
    if printer is not None:
        shape_prop.traceback = UnprintedTraceback()   # type: ignore[attr-defined]
    try:
        yield
    finally:
        if printer is not None:
            shape_prop.traceback = printer   # type: ignore[attr-defined]


def _as_meta(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(f"meta_args[{name!r}] must be a tensor (meta or real), got {type(value).__name__}")
    return value if value.is_meta else torch.empty_like(value, device="meta")


def _meta_memo(module: torch.nn.Module) -> dict[int, object]:
    """A deepcopy memo that maps every parameter and buffer to a meta twin, so copying the
    module for shape propagation allocates no real memory for its weights either."""
    memo: dict[int, object] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        twin = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, torch.nn.Parameter):
            twin = torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = twin
    return memo


_CALLED_WHOLE = (math, torch.masked, torch.masked._ops)   # modules whose functions are recorded as calls
_CALLED_WHOLE_NAMES = frozenset(m.__name__ for m in _CALLED_WHOLE) - {"math"}


def _symbolic_trace(module: torch.nn.Module, concrete_args: dict | None) -> GraphModule:
    """``torch.fx.symbolic_trace`` with the functions of :data:`_CALLED_WHOLE` recorded as calls."""
    graph = Tracer(autowrap_modules=_CALLED_WHOLE).trace(module, concrete_args)
    for node in graph.nodes:   # their code names them by module (torch.masked.sum), no global to re-wrap
        if node.op == "call_function" and getattr(node.target, "__module__", None) in _CALLED_WHOLE_NAMES:
            node.meta.pop("is_wrapped", None)
    return GraphModule(module, graph, type(module).__name__)


class _MetaShapeProp(ShapeProp):
    """Shape propagation on meta tensors, with device arguments moved to meta too."""

    def call_function(self, target, args, kwargs):  # type: ignore[no-untyped-def]
        return super().call_function(target, *meta_devices(tuple(args), dict(kwargs)))

    def call_method(self, target, args, kwargs):  # type: ignore[no-untyped-def]
        return super().call_method(target, *meta_devices(tuple(args), dict(kwargs)))


def omitted_defaults(module: torch.nn.Module, given) -> dict[str, object]:
    """The forward arguments not in ``given`` that have a default, with it."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.name not in given and p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def forward_names(module: torch.nn.Module, count: int) -> list[str]:
    """The names of the first ``count`` positional forward arguments (a GraphModule's placeholders)."""
    if isinstance(module, GraphModule):
        return [str(n.target) for n in module.graph.nodes if n.op == "placeholder"][:count]
    parameters = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(parameters) < count:
        raise InvalidArgument(f"{type(module).__name__}.forward takes {len(parameters)} positional argument(s), "
                              f"given {count} input(s)")
    return [p.name for p in parameters[:count]]


def trace(module: torch.nn.Module, meta_args: Mapping[str, torch.Tensor] | None = None) -> GraphModule:
    """``symbolic_trace(module)`` with ``node.meta['tensor_meta']`` set on every tensor node.

    ``meta_args`` maps forward argument names to tensors (meta tensors are enough); an
    argument with a default may be omitted, and is then traced as its default
    (``forward(x, mask=None)`` without a mask: ``if mask is not None`` is decided, not traced).
    """
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgument(f"trace() needs a torch.nn.Module, got {type(module).__name__}")
    meta_args = dict(meta_args or {})
    graph_module = module if isinstance(module, GraphModule) else \
        _symbolic_trace(module, omitted_defaults(module, meta_args) or None)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    known = {str(n.target).lstrip("*") for n in placeholders}
    unknown = sorted(set(meta_args) - known)
    if unknown:
        raise InvalidArgument(f"meta_args names {unknown} are not forward arguments; expected some of {sorted(known)}")

    args, given = [], []
    for node in placeholders:
        name = str(node.target)
        if name in meta_args:
            args.append(_as_meta(name, meta_args[name]))
            given.append(meta_args[name])
        elif node.args:  # the argument's default value
            args.append(node.args[0])
            given.append(node.args[0])
        else:
            raise InvalidArgument(f"meta_args is missing forward argument {name!r}; given {sorted(meta_args)}")

    # the shapes come from a copy whose weights are meta twins; a module holding no weight is run
    # on meta tensors as it is (a GraphModule's copy generates and compiles its code again: most
    # of tracing a one-op harness)
    weighted = next(graph_module.parameters(), None) is not None or next(graph_module.buffers(), None) is not None
    meta_module = copy.deepcopy(graph_module, _meta_memo(graph_module)) if weighted else graph_module
    try:
        with unprinted_tracebacks():
            _MetaShapeProp(meta_module).propagate(*args)
    except Exception:
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in given) or not meta_args:
            raise
        # an op whose output shape depends on the values (nonzero, unique, narrow at a tensor
        # offset): the real inputs given are run, on copies, so the caller's stay as they were
        meta_module = copy.deepcopy(graph_module)
        ShapeProp(meta_module).propagate(*[a.clone() if isinstance(a, torch.Tensor) else a for a in given])
    if meta_module is graph_module:
        return graph_module
    by_name = {n.name: n for n in meta_module.graph.nodes}
    for node in graph_module.graph.nodes:
        for key in ("tensor_meta", "type"):
            if key in by_name[node.name].meta:
                node.meta[key] = by_name[node.name].meta[key]
    return graph_module
