"""What is watched in DTensor while it runs (execute.py): its logging quieted, the aten ops a
plain call dispatches, the input placement changes its runtime makes, a tracer entered for one
phase, and its sharding cache cleared between combinations."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from shardverify.features.dtensor.placements import placements_text

__all__ = ["quiet_dtensor", "AtenCalls", "watch_redistribution", "tracing", "fresh_sharding_cache",
           "counting_collectives", "entered_nodes"]


@contextlib.contextmanager
def quiet_dtensor():
    """DTensor's redistribution warns (suboptimal all-gathers) on layouts this check chooses."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.tensor",
                                                    "torch.distributed.tensor._redistribute")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def counting_collectives():
    """``CommDebugMode`` counting the collectives, without its module tracker's global module
    hooks. Its full backward pre-hook makes every ``nn.Module`` call under it pass the module's
    inputs and output through ``BackwardHookFunction``, which returns a view of each: a DTensor
    view re-reads the local tensor at the shape its placements claim. Where DTensor's runtime
    returns a local value that does not fit its metadata (conv's handler skipping its rule's
    redistribution), that view reshapes it silently: the instrument would turn the plain call's
    late failure (its ``full_tensor()`` raises) into silently wrong values, for module targets only."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        tracker = comm.advanced_module_tracker
        for name in ("_fw_pre_handle", "_fw_post_handle", "_bw_handle"):   # removed again on exit: idempotent
            handle = getattr(tracker, name, None)
            if handle is not None:
                handle.remove()
        yield comm


class watch_redistribution:
    """Records every input placement change DTensor's runtime makes before an op (a local slice
    R -> S is no collective, so counting collectives alone would miss it). The runtime also
    passes through here to rewrite a view's non-tensor arguments (the shape in local sizes) with
    every tensor's placements kept: that moves no data and is not recorded."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def __enter__(self) -> "watch_redistribution":
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.utils import _pytree as pytree

        self.dispatcher = DTensor._op_dispatcher
        original = type(self.dispatcher).redistribute_local_args
        ops = self.ops

        def watched(op_info, schema, use_val):
            wanted = (tuple(pytree.tree_leaves(schema.args_schema)) if op_info.args_tree_spec is not None
                      else schema.args_schema)
            for have, want in zip(op_info.flat_args_schema, wanted):
                if isinstance(have, DTensorSpec) and isinstance(want, DTensorSpec) and have.placements != want.placements:
                    ops.append(f"{schema.op}: {placements_text(have.placements)} -> {placements_text(want.placements)}")
            return original(op_info, schema, use_val)

        self.dispatcher.redistribute_local_args = watched
        return self

    def __exit__(self, *exc) -> None:
        del self.dispatcher.redistribute_local_args


class AtenCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a plain call dispatches (to find the one DTensor's rule is looked up for)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def tracing(tracer, phase: str, watch):
    """``tracer`` (an OpTrace, or None) entered for ``phase``, seeing the runtime's redistributions."""
    if tracer is None:
        yield
        return
    tracer.phase, tracer.redistributed = phase, watch.ops
    with tracer:
        yield


class entered_nodes:
    """The autograd node whose backward function was running when the backward raised: a pre-hook
    on every node reachable from ``roots`` records its name (the CPU engine runs one node at a
    time, each pre-hook just before its node), so the last one entered is the one that raised
    (``SelectScatterBackward0``: autograd's own backward of an op, not a DTensor rule)."""

    def __init__(self, roots) -> None:
        self.roots = roots
        self.last = ""
        self._handles: list = []

    def __enter__(self) -> "entered_nodes":
        seen: set = set()
        stack = [r.grad_fn for r in self.roots if getattr(r, "grad_fn", None) is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            self._handles.append(node.register_prehook(functools.partial(self._enter, node.name())))
            stack.extend(next_node for next_node, _ in node.next_functions)
        return self

    def _enter(self, name: str, grad_outputs):
        self.last = name

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def fresh_sharding_cache() -> None:
    """Each combination judged on its own: DTensor's sharding cache holds its placements, and
    a ``MaskPartial`` placement (an embedding's output) carries a mask buffer that a failed
    reduction leaves materialized, so the next embedding with the same table placement raises
    "MaskBuffer has been materialized with conflicting data". Cleared after a failure only (a
    clear before every combination doubles a run's time)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()   # the Python cache and the C++ fast path's


@contextlib.contextmanager
def reuse_propagation(answers: dict):
    """DTensor's dispatch computes the sharding of an op whose input placements its C++ cache has
    not seen without looking in its Python cache (the one the rule query filled): ``answers``
    (op schema -> the OutputSharding the rule query got from DTensor's own propagator for that
    very schema) is handed back instead of propagating the same schema a second time."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    real = propagator.propagate_op_sharding_non_cached

    def answered(schema):
        try:
            found = answers.get(schema)
        except TypeError:   # a schema that does not hash: DTensor's own path
            found = None
        return found if found is not None else real(schema)

    propagator.propagate_op_sharding_non_cached = answered
    try:
        yield
    finally:
        del propagator.propagate_op_sharding_non_cached
