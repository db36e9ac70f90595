"""Which op calls draw random numbers, and running one on a fixed generator state.

A call that draws (``aten.rand``, ``bernoulli``, dropout in training mode) gives another result
under another generator state, so a rank's result and the single device's can only be compared
when both draw from the same state. :func:`call_op` runs every such call on one fixed seed, in
a forked generator state (the caller's is left as it was): every rank and the reference draw the
same numbers for the same shape, which is what ranks seeded alike do. A layout that splits the
drawn tensor then differs from the reference (a rank draws its block's count of numbers from the
start of the stream, not its block of the reference's), and the check says so; a layout where
every rank makes the whole result matches.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from shardverify.capture.schema import schema_values

__all__ = ["draws_random", "random_call", "may_draw", "drawn_alike", "generator_state", "SEED"]

#: the generator seed every drawing call runs on
SEED = 20261205

_KEY = "shardverify_draws"   # node.meta: a call_function or call_method node's answer, kept
_MAY = "shardverify_may_draw"
#: torch-level functions that draw through an ATen op of another name
_ALIASES = {"dropout1d": "feature_dropout", "dropout2d": "feature_dropout", "dropout3d": "feature_dropout"}


def draws_random(node: fx.Node, graph: fx.GraphModule) -> str:
    """How ``node`` of ``graph`` draws random numbers ("" when it does not): see :func:`random_call`."""
    module = graph.get_submodule(str(node.target)) if node.op == "call_module" else None
    return random_call(node, module)


def random_call(node: fx.Node, module: torch.nn.Module | None) -> str:
    """How ``node`` draws random numbers ("" when it does not), ``module`` the module a
    call_module node calls: ATen ops tagged nondeterministic_seeded (``aten.dropout`` with
    train=True, ``bernoulli``, ``rand``), dropout modules and functions in training mode; a
    dropout of probability 0 draws nothing that matters and is not listed."""
    if node.op == "call_module":
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            return f"{node.name} ({type(module).__name__}(p={module.p}) in training mode)"
        if isinstance(module, torch.nn.RReLU) and module.training and module.lower != module.upper:
            return f"{node.name} (RReLU in training mode)"
        return ""
    found = node.meta.get(_KEY)
    if found is None:
        found = node.meta[_KEY] = _drawing(node)
    return found


def may_draw(node: fx.Node, module: torch.nn.Module | None) -> bool:
    """Whether a call of ``node`` may draw random numbers, so that :func:`call_op` runs it on the
    fixed state: :func:`random_call`'s, and a torch-level function or method named as an ATen op
    that draws (``torch.rand_like``, ``Tensor.uniform_``, ``F.rrelu``) whatever its arguments say
    (seeding a call that draws nothing changes nothing)."""
    if node.op == "call_module":
        return bool(random_call(node, module))
    found = node.meta.get(_MAY)
    if found is None:
        found = node.meta[_MAY] = bool(random_call(node, module)) or _named_drawing(node)
    return found


def _named_drawing(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op not in ("call_function", "call_method") or isinstance(node.target, torch._ops.OpOverload) \
            or not isinstance(name, str):
        return False
    if name.startswith(("_", "empty", "new_empty")):   # uninitialised memory is tagged so, and draws nothing
        return False
    packet = getattr(torch.ops.aten, _ALIASES.get(name, name), None)
    return isinstance(packet, torch._ops.OpOverloadPacket) and \
        any(torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags for overload in packet.overloads())


def _drawing(node: fx.Node) -> str:
    target, args = node.target, list(node.args)
    if node.op == "call_function" and target in (torch.nn.functional.dropout, torch.dropout):
        p = args[1] if len(args) > 1 else node.kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
        if train and p:
            return f"{node.name} (dropout p={p}, training)"
    elif node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
            and torch.Tag.nondeterministic_seeded in target.tags \
            and not target.name().startswith(("aten::empty", "aten::new_empty")):
        given = schema_values(target, args, node.kwargs)
        p = next((given[k] for k in ("p", "dropout_p") if k in given), None)
        if given.get("train", True) is not False and p != 0:   # else: draws nothing that matters
            return f"{node.name} ({target.name()}" + (f" p={p}" if p is not None else "") + ", random)"
    return ""


@contextlib.contextmanager
def drawn_alike(args: tuple, kwargs: dict):
    """The generators a call with ``args`` and ``kwargs`` draws from seeded with :data:`SEED`,
    restored on leaving: the CPU's always, an accelerator's too where a tensor argument lives on
    one or the call names one (``device=``)."""
    found: list = []
    fx.node.map_aggregate((args, kwargs), lambda v: found.append(v.device) if isinstance(v, torch.Tensor) else None)
    if kwargs.get("device") is not None:
        found.append(torch.device(kwargs["device"]))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.default_generator.manual_seed(SEED)
        for kind, index in {(d.type, d.index) for d in found if d.type not in ("cpu", "meta")}:
            backend = getattr(torch, kind)
            index = backend.current_device() if index is None else index
            stack.enter_context(torch.random.fork_rng(devices=[index], device_type=kind))
            backend.default_generators[index].manual_seed(SEED)
        yield


def generator_state(node: fx.Node, module: torch.nn.Module | None, args: tuple, kwargs: dict):
    """:func:`drawn_alike` for a call of ``node`` that may draw (:func:`may_draw`), else a context
    that does nothing: the one way every runner of an op (a check, a plan's run, its reference)
    gives a drawing call its state."""
    return drawn_alike(args, kwargs) if may_draw(node, module) else contextlib.nullcontext()
