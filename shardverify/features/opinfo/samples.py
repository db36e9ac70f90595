"""PyTorch's OpInfo samples as calls to verify: the corpus DTensor's own op tests run, written by
no one here. An op spec's targets name torch callables; the OpInfo entries whose function,
method or ATen operator is one of them give sample inputs (``entry.sample_inputs``), each turned
into a one-op module whose forward takes the sample's tensors and calls the op as the sample
does, ready for torch.fx or torch.export."""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from shardverify.errors import InvalidArgument

__all__ = ["Sample", "op_db", "entries_for", "samples_of", "OneOp", "SWEPT_DTYPES", "no_sample_reason"]


def op_db() -> list:
    """PyTorch's OpInfo database (imported when first asked for: it takes seconds)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db as found
    except ImportError as error:   # torch's test helpers need expecttest
        raise InvalidArgument(f"PyTorch's OpInfo database cannot be imported ({error}); install expecttest") from None
    return list(found)


def _packet(target: object) -> object | None:
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else None


def entries_for(targets: Sequence[object], names: Sequence[str] = ()) -> list:
    """The OpInfo entries of an op spec: those named in ``names``, and those whose function or
    method is one of ``targets`` or whose ATen operator holds one of the ATen targets."""
    packets = {p for p in map(_packet, targets) if p is not None}
    found = []
    for entry in op_db():
        aten = getattr(torch.ops.aten, entry.aten_name or "", None) if entry.aten_name else None
        if entry.name in names or any(t is entry.op or (entry.method_variant is not None and t is entry.method_variant)
                                      for t in targets) or (aten is not None and aten in packets):
            found.append(entry)
    return found


@dataclass(frozen=True)
class Sample:
    """One OpInfo sample: how to call the op, which tensors its forward takes."""

    entry: str                       # the OpInfo entry's name (variant test name too, if any)
    index: int                       # its position among the entry's samples
    call: object                     # the callable (the entry's function, or its method variant)
    tensors: tuple[torch.Tensor, ...]
    spec: object                     # pytree spec of (input, args, kwargs) with tensors as leaves
    constants: tuple                 # the non-tensor leaves, in order (None where a tensor sits)

    def arguments(self, tensors: Sequence[object]) -> tuple[tuple, dict]:
        """(args, kwargs) of the call with ``tensors`` (placeholders or real) in the tensors' places."""
        given = iter(tensors)
        leaves = [next(given) if c is _TENSOR else c for c in self.constants]
        value, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return (value, *args), kwargs

    def describe(self) -> str:
        shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in self.tensors)
        return f"{self.entry}#{self.index}({shapes})"


_TENSOR = object()


#: the dtypes a sample is drawn in, the first an entry supports on the CPU
SWEPT_DTYPES = (torch.float64, torch.float32, torch.int64, torch.bool)


def samples_of(entry, dtype: torch.dtype = torch.float64, limit: int = 0, seed: int = 0) -> Iterator[Sample]:
    """The entry's CPU samples in ``dtype`` (else the first of :data:`SWEPT_DTYPES` it supports;
    none for a CUDA function); ``limit``: at most that many, drawn with a fixed seed (0: every
    sample)."""
    if _cuda_only(entry):
        return
    supported = entry.supported_dtypes("cpu")
    if dtype not in supported:
        dtype = next((d for d in SWEPT_DTYPES if d in supported), None)
        if dtype is None:
            return
    torch.manual_seed(seed)
    samples = list(entry.sample_inputs("cpu", dtype, requires_grad=False))
    chosen = list(range(len(samples)))
    if limit and len(chosen) > limit:
        chosen = sorted(random.Random(seed).sample(chosen, limit))
    for index in chosen:
        sample = samples[index]
        leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
        tensors = tuple(leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor))
        constants = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
        name = entry.name + (f".{entry.variant_test_name}" if entry.variant_test_name else "")
        yield Sample(name, index, entry.op, tensors, spec, constants)


def no_sample_reason(entry) -> str:
    """Why :func:`samples_of` gives an entry no sample: its op is a CUDA function, no CPU dtype
    among :data:`SWEPT_DTYPES`, or none from its ``sample_inputs``."""
    if _cuda_only(entry):
        return f"its op is a CUDA function ({_qualname(entry.op)}), which no CPU runs"
    supported = entry.supported_dtypes("cpu")
    if not any(d in supported for d in SWEPT_DTYPES):
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in supported)) or "none"
        swept = ", ".join(str(d).removeprefix("torch.") for d in SWEPT_DTYPES)
        return f"no CPU sample in {swept}: its CPU dtypes are {kinds}"
    return "its sample_inputs gave no sample on the CPU"


def _cuda_only(entry) -> bool:
    """An entry whose op torch.cuda defines (the jiterator's compiled functions): its OpInfo lists
    CPU dtypes, yet every call asks for a GPU."""
    return any(str(where).startswith("torch.cuda.") for where in (type(entry.op).__module__,
                                                                   getattr(entry.op, "__module__", "")))


def _qualname(op: object) -> str:
    """Where an op comes from: its class for a callable object, else the function itself."""
    kind = type(op) if type(op).__module__ != "builtins" else op
    return f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', repr(kind))}"


class OneOp(torch.nn.Module):
    """A module whose forward takes a sample's tensors (``x0``, ``x1``, ...) and calls the op."""

    def __init__(self, sample: Sample) -> None:
        super().__init__()
        self.sample = sample

    def call(self, *tensors):
        args, kwargs = self.sample.arguments(tensors)
        if isinstance(self.sample.call, _DESCRIPTORS) and args:   # Tensor.__radd__ as a method of its first
            # argument, as a user writes it: torch.fx's proxy is no tensor a C descriptor takes
            return getattr(args[0], self.sample.call.__name__)(*args[1:], **kwargs)
        with _descriptors_by_name(self.sample.call, tensors):
            return _by_name(self.sample.call)(*args, **kwargs)


_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType)


@contextlib.contextmanager
def _descriptors_by_name(function, tensors: Sequence[object]):
    """While torch.fx traces ``function`` (a proxy among ``tensors``), each ``torch.Tensor`` C
    descriptor its code names (``lambda x: wrapper_set_seed(torch.Tensor.cauchy_, x)``) calls the
    method of that name on a proxy, as ``x.cauchy_()`` in a user's code would; a real tensor
    still reaches the descriptor. Restored on leaving."""
    code = getattr(function, "__code__", None)
    names = [] if code is None or not any(isinstance(t, torch.fx.Proxy) for t in tensors) else \
        [n for n in code.co_names if n not in vars(torch.Tensor) and isinstance(getattr(torch.Tensor, n, None),
                                                                                  _DESCRIPTORS)]
    for name in names:
        setattr(torch.Tensor, name, _by_method_name(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(torch.Tensor, name)   # the inherited descriptor shows again


def _by_method_name(name: str, descriptor):
    def call(self, *args, **kwargs):
        if isinstance(self, torch.fx.Proxy):
            return getattr(self, name)(*args, **kwargs)
        return descriptor(self, *args, **kwargs)

    return call


def _by_name(function):
    """A module's function looked up by its name when it is called, as a user's code names it
    (``torch.masked.sum``): a tracer that records a module's functions as calls sees it."""
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    found = getattr(module, getattr(function, "__name__", ""), None) if module is not None else None
    return found if found is not None and getattr(found, "__wrapped__", None) is function else function


def one_op_module(sample: Sample) -> OneOp:
    """A :class:`OneOp` whose ``forward`` names each tensor (torch.fx traces named arguments)."""
    names = ", ".join(f"x{i}" for i in range(len(sample.tensors)))
    namespace: dict = {}
    exec(f"def forward(self, {names}):\n    return self.call({names})\n", namespace)   # noqa: S102 - a fixed text
    cls = type(f"OneOp_{len(sample.tensors)}", (OneOp,), {"forward": namespace["forward"]})
    return cls(sample)
