"""The aten ops one module runs, logged in one forward of the single device and of the parallelized
model, for blame: each op's inputs and outputs as every rank holds them, and for an op DTensor ran,
what the same op gives on the full values of its inputs (so a wrong result is told apart from right
arithmetic on wrong inputs)."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shardverify.features.parallelize.execute import FORWARD_SEED
from shardverify.features.parallelize.values import is_dtensor, per_rank

__all__ = ["OpCall", "log_module_ops", "SKIPPED"]

#: ops that move no value (aliases, detaching): never a culprit, and absent from one side or the other
SKIPPED = {"detach", "alias", "lift_fresh", "_unsafe_view", "view", "t", "clone", "_to_copy", "empty_like",
           "new_empty", "new_empty_strided", "empty_strided", "copy_", "zeros_like", "ones_like"}


@dataclass
class OpCall:
    name: str                     # "aten.mm.default"
    key: tuple[str, int]          # (name, occurrence): how the two sides' calls are paired
    outputs: list[list[torch.Tensor]] = field(default_factory=list)          # per output tensor, per rank
    inputs: list[list[torch.Tensor]] = field(default_factory=list)           # per tensor input, per rank
    dtensor: bool = False
    direct: list[list[torch.Tensor]] | None = None    # DTensor ops: the op on its inputs' full values, per rank
    raised: str = ""


#: code whose ops belong to laying tensors out (redistribute, from_local, a style's hooks), not to the model
_LAYOUT_CODE = ("torch/distributed/tensor/", "torch/distributed/_functional_collectives", "transformers/distributed/")


def _from_layout_code(depth: int = 40) -> bool:
    frame = sys._getframe(2)
    while frame is not None and depth:
        if any(part in frame.f_code.co_filename for part in _LAYOUT_CODE):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.raw: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (func.namespace == "aten" and func._opname not in SKIPPED and not _from_layout_code()):
            return func(*args, **kwargs)
        # copies, taken now: an in-place op changes its inputs, and FSDP2 frees the storage of the
        # parameters it gathered for the forward as soon as the module is done
        entry = [func, _snapshot(args), _snapshot(kwargs), None]
        self.raw.append(entry)
        out = func(*args, **kwargs)
        entry[3] = _snapshot(out)
        return out


def _snapshot(value):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _full(value):
    return value.full_tensor() if is_dtensor(value) else value


def log_module_ops(model: nn.Module, module_name: str, run, world: int) -> tuple[list[OpCall], str]:
    """Run ``run()`` (one forward) with every aten op of ``module_name``'s first call logged; returns
    the calls and, if the forward raised, its error (the op that raised is the last call, unfinished)."""
    target = dict(model.named_modules()).get("" if module_name == "(model)" else module_name)
    if target is None:
        return [], ""
    log, active = _Log(), []

    def enter(module, args):
        if not active and not log.raw:
            log.__enter__()
            active.append(True)

    def leave(module, args, output):
        if active:
            log.__exit__(None, None, None)
            active.clear()

    handles = [target.register_forward_pre_hook(enter), target.register_forward_hook(leave)]
    error = ""
    try:
        torch.manual_seed(FORWARD_SEED)
        run()
    except Exception as exc:  # noqa: BLE001 - the op that raised is the culprit of a loud failure
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    finally:
        if active:
            log.__exit__(None, None, None)
        for handle in handles:
            handle.remove()
    seen: Counter = Counter()
    calls = []
    with torch.no_grad():
        for func, args, kwargs, out in log.raw:
            name = str(func)
            seen[name] += 1
            call = OpCall(name, (name, seen[name]), dtensor=any(is_dtensor(t) for t in tree_flatten((args, kwargs))[0]))
            call.inputs = [per_rank(t, world) for t in _tensors((args, kwargs))]
            if out is None:
                call.raised = error
            else:
                call.outputs = [per_rank(t, world) for t in _tensors(out)]
                if call.dtensor:
                    with contextlib.suppress(Exception):
                        direct = func(*tree_map(_full, args), **tree_map(_full, kwargs))
                        call.direct = [per_rank(t, world) for t in _tensors(direct)]
            calls.append(call)
    return calls, error
