"""A captured call as a case the verifier runs: the node cut out of its graph with its inputs.

An :class:`~shardverify.spec.case.OpCase` rebuilds a call from a spec's grid point. A call met in
a user's graph can hold what no grid point says: a zero-size dim, a tensor keyword, a ``None``
inside a tensor list, a module configured in its own way. :func:`call_case` keeps the call as it
was captured: a one-op graph whose placeholders stand for the node's graph inputs (the same names,
so each strategy's operands are found), whose module and attributes are copies of the node's own
(weights redrawn by the reference like any case's), and whose node keeps its metadata. The
verifier needs only what an OpCase offers it (``build``, ``inputs``, ``seed``, tolerances,
``describe``), so one engine checks both.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from shardverify.capture.meta import tensor_meta
from shardverify.spec.fields import dtype_from_name

__all__ = ["CallInput", "CallCase", "one_op_graph", "call_case", "describe_call"]

_STRATEGY_CACHE = "shardverify_strategies"   # strategies_for_node's cache in node.meta: never copied


@dataclass(frozen=True)
class CallInput:
    """A placeholder of a captured call: as :class:`~shardverify.spec.case.InputDecl`, but any
    shape the capture saw (zero-size dims included)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    values: tuple[float, float] | None = None   # [low, high) the values are drawn from
    grad: bool = True
    data: tuple[float, ...] | None = None       # exact values (InputDecl's); a captured call has none

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class CallCase:
    """One captured call to verify: the one-op graph, its node and its placeholders' data."""

    op: str
    graph_module: fx.GraphModule
    node_name: str
    inputs: tuple[CallInput, ...]
    label: str
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None
    #: graph values the call reads from module state that take no gradient (buffers, constants)
    constant_names: tuple[str, ...] = ()
    #: check in a child process (verify/isolated.py): the spec says the op's kernel can corrupt
    #: memory or trap on a wrong layout's local shapes
    isolate: bool = False

    def build(self) -> tuple[fx.GraphModule, str]:
        return self.graph_module, self.node_name

    def describe(self) -> str:
        return self.label + (f" seed={self.seed}" if self.seed else "")


def _tensor_attr(graph_module: fx.GraphModule, target: str) -> tuple[torch.Tensor, str]:
    """The tensor a get_attr node reads and what it is: "parameter", "buffer" or "constant"."""
    owner_path, _, name = target.rpartition(".")
    owner = graph_module.get_submodule(owner_path) if owner_path else graph_module
    tensor = getattr(owner, name)
    kind = "parameter" if name in owner._parameters else "buffer" if name in owner._buffers else "constant"
    return tensor, kind


def one_op_graph(graph_module: fx.GraphModule, node: fx.Node) -> fx.GraphModule:
    """``node`` alone in a graph of its own: a placeholder per graph input (its name and
    metadata kept), a copy of each attribute it reads (parameters and buffers as empty tensors
    of their shape and dtype: the reference draws them; constants as they are), a copy of its
    module."""
    root, graph, env = torch.nn.Module(), fx.Graph(), {}
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            tensor, kind = _tensor_attr(graph_module, str(arg.target))
            if kind == "parameter":
                root.register_parameter(arg.name, torch.nn.Parameter(torch.empty_like(tensor, device="cpu"),
                                                                      requires_grad=tensor.requires_grad))
            elif kind == "buffer":
                root.register_buffer(arg.name, torch.empty_like(tensor, device="cpu"))
            else:
                setattr(root, arg.name, tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor)
            env[arg] = graph.get_attr(arg.name)
        else:
            env[arg] = graph.placeholder(arg.name)
        env[arg].meta = {k: v for k, v in arg.meta.items() if k != _STRATEGY_CACHE}
    new = graph.node_copy(node, lambda n: env[n])
    if node.op == "call_module":
        name = str(node.target).replace(".", "_")
        root.add_module(name, copy.deepcopy(graph_module.get_submodule(str(node.target))))
        new.target = name
    new.meta = {k: v for k, v in node.meta.items() if k != _STRATEGY_CACHE}
    graph.output(new)
    return fx.GraphModule(root, graph)


def _shown_arg(value: object) -> str:
    if isinstance(value, fx.Node):
        meta = tensor_meta(value)
        if meta is not None:
            return f"{str(meta.dtype).removeprefix('torch.')}{list(meta.shape)}"
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_shown_arg(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def describe_call(graph_module: fx.GraphModule, node: fx.Node) -> str:
    """A node's call as a reader writes it, tensors by dtype and shape:
    ``aten.triu.default(float64[4, 6], 1)``, ``Conv2d(8, 8, ...)(float32[2, 8, 6, 6])``."""
    args = [_shown_arg(a) for a in node.args] + [f"{k}={_shown_arg(v)}" for k, v in node.kwargs.items()]
    if node.op == "call_module":
        head = repr(graph_module.get_submodule(str(node.target))).replace("\n", " ")
    elif node.op == "call_method":
        head = f"Tensor.{node.target}"
    else:
        head = str(node.target) if hasattr(node.target, "_schema") else \
            f"{getattr(node.target, '__module__', '') or ''}.{getattr(node.target, '__name__', node.target)}".lstrip(".")
    return f"{head}({', '.join(args)})"


def call_case(op: str, graph_module: fx.GraphModule, node: fx.Node,
              drawn: Mapping[str, tuple[tuple[float, float] | None, bool]], seed: int = 0, *,
              isolate: bool = False) -> CallCase:
    """The captured ``node`` as a case; ``drawn``: placeholder name -> ([low, high) or None, takes
    a gradient), from the spec's declared data of the operand it is; ``isolate``: the spec's
    ``verify.isolate``."""
    small = one_op_graph(graph_module, node)
    inputs = []
    for arg in small.graph.nodes:
        if arg.op != "placeholder":
            continue
        meta = tensor_meta(arg)
        if meta is None:
            raise TypeError(f"input {arg.name!r} of node {node.name!r} is not a tensor with a known shape")
        values, grad = drawn.get(arg.name, (None, True))
        inputs.append(CallInput(arg.name, tuple(int(s) for s in meta.shape),
                                str(meta.dtype).removeprefix("torch."), values, grad))
    constants = tuple(arg.name for arg in node.all_input_nodes if arg.op == "get_attr"
                      and _tensor_attr(graph_module, str(arg.target))[1] != "parameter")
    return CallCase(op, small, next(n.name for n in small.graph.nodes if n.op not in ("placeholder", "get_attr",
                                                                                         "output")),
                    tuple(inputs), describe_call(graph_module, node), seed, constant_names=constants,
                    isolate=isolate)
