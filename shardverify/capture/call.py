"""Running one captured node: its op called with chosen values at its operands and the other
arguments as recorded. The single-device reference, every rank's local call, the plan executor,
the audit and the strategy generators' meta calls all call an op through :func:`call_op`, so
what "the op" is stays one definition."""

from __future__ import annotations

import copy
import operator
import weakref

import torch
from torch import fx

from shardverify.capture.meta import output_metas, tensor_meta
from shardverify.capture.randomness import generator_state
from shardverify.errors import VerificationError

__all__ = ["Locator", "target_name", "operand_nodes", "called_module", "module_tensors", "as_outputs", "call_parts",
           "call_op", "meta_devices", "backward_from_ones", "tuple_element", "ungraded_inputs"]

Locator = tuple[str, object]   # (OperandLocator.kind, OperandLocator.key)


def operand_nodes(node: fx.Node) -> dict:
    """Locator -> graph node for every graph value the op's call takes directly, and for each
    element of a list argument (torch.cat's tensors) as ("item", (arg index, element index))."""
    found: dict = {}
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            found[("arg", i)] = a
        elif isinstance(a, (list, tuple)):
            found.update({("item", (i, j)): e for j, e in enumerate(a) if isinstance(e, fx.Node)})
    found.update({("kwarg", k): a for k, a in node.kwargs.items() if isinstance(a, fx.Node)})
    return found


def called_module(graph_module: torch.nn.Module, node: fx.Node) -> torch.nn.Module | None:
    """The module a ``call_module`` node calls in ``graph_module``; None for any other node."""
    return graph_module.get_submodule(str(node.target)) if node.op == "call_module" else None


def module_tensors(module: torch.nn.Module | None) -> dict:
    """Locator -> tensor for every parameter and buffer of the op's module."""
    if module is None:
        return {}
    found: dict = {("param", n): p for n, p in module.named_parameters()}
    found.update({("buffer", n): b for n, b in module.named_buffers()})
    return found


def as_outputs(node: fx.Node, result: object) -> tuple[torch.Tensor, ...]:
    """The op's result as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    items = tuple(result) if isinstance(result, (list, tuple)) else (result,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise VerificationError(f"node {node.name!r} returned {type(result).__name__}; the verifier checks "
                                "ops that return a tensor or a tuple of tensors")
    return items


def meta_devices(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's device arguments moved to "meta": an op that copies to a device
    (``x.to("cpu", torch.float32)``, ``arange(8, device="cpu")``) runs on meta tensors as on real ones,
    instead of failing to copy data out of a meta tensor."""
    meta = torch.device("meta")

    def swap(value: object) -> object:
        return meta if isinstance(value, torch.device) or _device_text(value) else value

    return tuple(swap(a) for a in args), {k: meta if k == "device" and v is not None else swap(v)
                                          for k, v in kwargs.items()}


def _device_text(value: object) -> bool:
    """Is ``value`` a device spelled as text (``x.to("cpu", torch.float64, True, True)``)? Only a
    device's text parses as one: an einsum equation or a reduction's name does not."""
    if not isinstance(value, str) or len(value) > 32:
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


_LOCATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_locators(module: torch.nn.Module) -> tuple:
    """The locators of the module's parameters and buffers (remembered: walking a module's
    parameters costs more than the small op under test)."""
    found = _LOCATORS.get(module)
    if found is None:
        found = _LOCATORS[module] = tuple(module_tensors(module))
    return found


def _put_tensor(module: torch.nn.Module, dotted: str, value: torch.Tensor) -> None:
    """Make ``value`` (any tensor, not necessarily a Parameter) the module's tensor ``dotted``."""
    owner_name, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = value


def call_parts(node: fx.Node, module: torch.nn.Module | None, values: dict) -> tuple[tuple, dict, dict | None]:
    """The call :func:`call_op` makes: ``(args, kwargs, module tensors)``, the last None unless
    the node calls a module (name -> value of each parameter and buffer)."""

    def pick(loc: Locator, recorded: object) -> object:
        if loc in values:
            return values[loc]
        nested: list = []
        fx.node.map_arg(recorded, nested.append)
        if nested:
            raise VerificationError(f"node {node.name!r}: its {loc[0]} {loc[1]!r} is a tensor "
                                    f"({', '.join(n.name for n in nested)}) that the spec declares no operand for, "
                                    f"so no layout gives it to a device: declare it among the spec's operands")
        return recorded

    def pick_arg(i: int, recorded: object) -> object:
        if isinstance(recorded, (list, tuple)) and any(("item", (i, j)) in values for j in range(len(recorded))):
            return type(recorded)(pick(("item", (i, j)), e) for j, e in enumerate(recorded))
        return pick(("arg", i), recorded)

    unpacked = [key for kind, key in values if kind == "varargs"]   # a local x.view(4, 16)
    recorded = node.args[:unpacked[0]] if unpacked else node.args
    args = tuple(pick_arg(i, a) for i, a in enumerate(recorded))
    if unpacked:
        args += tuple(values[("varargs", unpacked[0])])  # type: ignore[arg-type]
    kwargs = {k: pick(("kwarg", k), a) for k, a in node.kwargs.items()}
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in values.values()):
        args, kwargs = meta_devices(args, kwargs)
    if node.op != "call_module":
        return args, kwargs, None
    assert module is not None
    tensors = {}
    for loc in _module_locators(module):
        if loc not in values:
            raise VerificationError(f"node {node.name!r}: module {loc[0]} {loc[1]!r} has no operand "
                                    "in the strategy, so its layout is undeclared")
        tensors[loc[1]] = values[loc]
    return args, kwargs, tensors


def call_op(node: fx.Node, module: torch.nn.Module | None, values: dict, *, owned: bool = False) -> object:
    """Run the node's op with ``values`` (Locator -> tensor, or a strategy's local value for a
    non-tensor argument) at its operands; other arguments are passed as recorded in the node.
    Returns what the op returns (see as_outputs). A call that draws random numbers draws them
    from one fixed generator state (:mod:`shardverify.capture.randomness`).

    ``owned``: ``module`` is the caller's private copy, so its parameters and buffers are
    replaced in place (cheap) instead of through ``functional_call`` (which restores them).
    """
    args, kwargs, tensors = call_parts(node, module, values)
    with generator_state(node, module, args, kwargs):   # every rank and the reference draw the same numbers
        return _invoke(node, module, values, args, kwargs, tensors, owned)


def _invoke(node: fx.Node, module: torch.nn.Module | None, values: dict, args: tuple, kwargs: dict,
            tensors: dict | None, owned: bool) -> object:
    if node.op == "call_module":
        assert module is not None and tensors is not None
        attrs = {key: value for (kind, key), value in values.items() if kind == "attr"}
        if attrs:     # a rank's own value of a plain attribute (groups): on a shallow copy, never the shared module
            module = copy.copy(module)
            for name, value in attrs.items():
                setattr(module, name, value)
        if owned:
            for name, tensor in tensors.items():
                _put_tensor(module, name, tensor)
            result = module(*args, **kwargs)
        else:
            result = torch.func.functional_call(module, tensors, args, kwargs)
    elif node.op == "call_function":
        result = node.target(*args, **kwargs)
    elif node.op == "call_method":
        result = getattr(args[0], node.target)(*args[1:], **kwargs)
    else:
        raise VerificationError(f"node {node.name!r} is a {node.op!r} node, not an op")
    return result


def backward_from_ones(inputs, outputs) -> None:
    """Run the backward of an op call from gradients of ones on every differentiable output, to
    the inputs that require grad: whether a kernel takes a layout in training, not just forward
    (adaptive pooling runs an empty channel block forward and refuses it backward)."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves and outs:
        torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)


def ungraded_inputs(inputs, outputs) -> list[int]:
    """The positions of the inputs requiring grad that the op's backward, from gradients of ones
    on its differentiable outputs, gives no gradient at all (None): scaled_dot_product_attention
    on an empty batch leaves its mask without one. A rank holding such a block would skip the
    backward of that input's resharding, a collective its peers wait in."""
    leaves = [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves or not outs:
        return []
    grads = torch.autograd.grad(outs, [t for _, t in leaves], [torch.ones_like(t) for t in outs], allow_unused=True)
    return [i for (i, _), g in zip(leaves, grads) if g is None]


def target_name(node: fx.Node) -> str:
    """A node's target as a user reads it: ``aten.linear.default``, ``torch.nn.Linear``, ``view``."""
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        return f"{type(module).__module__}.{type(module).__qualname__}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if not callable(target) or hasattr(target, "_schema") or isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    module, name = getattr(target, "__module__", "") or "", getattr(target, "__qualname__", repr(target))
    if name.startswith("_VariableFunctionsClass."):       # torch.cov, a builtin of torch's C namespace
        return f"torch.{name.removeprefix('_VariableFunctionsClass.')}"
    if module in _C_NAMESPACES:                           # torch._C._linalg.linalg_lstsq: torch.linalg.lstsq
        public, prefix = _C_NAMESPACES[module]
        return f"{public}.{name.removeprefix(prefix)}"
    return f"{module}.{name}".lstrip(".")


# torch's C namespaces, by the public module that exposes them and the prefix their names carry
_C_NAMESPACES = {"torch._C._nn": ("torch.nn.functional", ""), "torch._C._linalg": ("torch.linalg", "linalg_"),
                 "torch._C._special": ("torch.special", "special_"), "torch._C._fft": ("torch.fft", "fft_")}


def tuple_element(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(producer, i) for ``operator.getitem(producer, i)`` taking one tensor of a node that returns a
    tuple of them (topk's values and indices): the element is no op, it moves no data and takes its
    producer's layout of that tensor; None for any other node."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    producer, index = node.args
    if not isinstance(producer, fx.Node) or not isinstance(index, int) or isinstance(index, bool):
        return None
    metas = output_metas(producer) if tensor_meta(producer) is None else None
    if metas is None or None in metas or not -len(metas) <= index < len(metas):
        return None
    return producer, index % len(metas)
