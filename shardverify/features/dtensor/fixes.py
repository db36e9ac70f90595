"""A candidate fix for a DTensor root cause, applied to the installed torch for one run, and
the harness re-run over the op's combinations with and without it: the evidence a page
(docs/upstream/<slug>.md) carries that the fix is right.

A :class:`Fix` swaps one entry of DTensor's dispatch tables (a sharding strategy in the
propagator's ``op_strategy_funcs``, or a runtime handler in the dispatcher's
``_custom_op_handlers``) for a corrected function, inside a context manager that puts the
original back and clears the sharding cache on both sides. Nothing of torch is written to
disk. :func:`prove` runs ``shardverify dtensor``'s executor (:func:`shardverify.features.dtensor.run.run_case`)
on every case of the op's spec, stock then patched, and compares combination by combination.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Fix", "Proof", "FIXES", "prove", "patched"]

FAILING = ("silent-wrong", "late-failure", "raises")


@dataclass(frozen=True)
class Fix:
    """``slug``: the page; ``spec``: the op spec whose combinations prove it; ``ops``: the aten
    overloads' names whose entry ``table`` ("strategy" or "handler") is replaced by
    ``make(original)``; ``diff``: the change as a unified diff against the installed source."""

    slug: str
    spec: str
    table: str
    ops: tuple[str, ...]
    make: Callable
    diff: str


@dataclass(frozen=True)
class Proof:
    """Counts per class without and with the fix, over the same combinations; ``newly_failing``:
    combinations right without the fix and failing with it."""

    slug: str
    executed: int
    stock: Counter
    fixed: Counter
    newly_failing: tuple[str, ...]
    stock_phases: Counter = dataclasses.field(default_factory=Counter)   # "silent-wrong forward": count
    fixed_phases: Counter = dataclasses.field(default_factory=Counter)

    def line(self) -> str:
        def said(counts: Counter) -> str:
            return ", ".join(f"{counts.get(k, 0)} {k}" for k in ("silent-wrong", "late-failure", "raises"))
        return (f"{self.slug}: {self.executed} combinations; stock: {said(self.stock)}; "
                f"fixed: {said(self.fixed)}; newly failing: {len(self.newly_failing)}")


def _overload(name: str):
    import torch

    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _tables(table: str) -> dict:
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    if table == "strategy":
        return dispatcher.sharding_propagator.op_strategy_funcs
    if table == "handler":
        return dispatcher._custom_op_handlers
    raise ValueError(f"table {table!r}: expected 'strategy' or 'handler'")


@contextlib.contextmanager
def patched(fix: Fix):
    """The fix in force in this process for the block; the stock functions back afterwards."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    entries = _tables(fix.table)
    saved = {name: entries[_overload(name)] for name in fix.ops}
    _clear_sharding_prop_cache()
    try:
        for name, original in saved.items():
            entries[_overload(name)] = fix.make(original)
        yield
    finally:
        for name, original in saved.items():
            entries[_overload(name)] = original
        _clear_sharding_prop_cache()


def _scan_strategy(original):
    """cumsum / cumprod / logcumsumexp: ``dim`` normalised before the reduction strategy compares
    it with each ``Shard(d).dim``."""
    def scan_strategy(op_schema):
        from torch.distributed.tensor._ops.utils import normalize_dim

        args = list(op_schema.args_schema)
        args[1] = normalize_dim(args[1], args[0].ndim)
        return original(dataclasses.replace(op_schema, args_schema=tuple(args)))
    return scan_strategy


def _select_backward_strategy(original):
    """select_backward: ``dim`` normalised against the gradient input's rank (the output's rank
    plus one) before the shard dims after it are shifted."""
    def select_backward_strategy(op_schema):
        from torch.distributed.tensor._ops.utils import normalize_dim

        args = list(op_schema.args_schema)
        args[2] = normalize_dim(args[2], len(args[1]))
        return original(dataclasses.replace(op_schema, args_schema=tuple(args)))
    return select_backward_strategy


def _convolution_handler(original):
    """convolution's runtime handler: the redistribution its own propagation asks for applied
    (as ``_dispatch.py``'s generic path does) before the local convolution."""
    def convolution_handler(op_call, args, kwargs):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._tp_conv import tp_convolution

        dispatcher = DTensor._op_dispatcher
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(op_info)
        output_sharding = op_info.output_sharding
        if output_sharding.needs_redistribute:
            dispatcher.redistribute_local_args(op_info, output_sharding.redistribute_schema,
                                               output_sharding.use_val_from_redistribute_schema)
        local = tp_convolution(op_call, tuple(op_info.local_args), op_info.local_kwargs,
                               output_sharding.output_spec.dim_map)
        return dispatcher.wrap(local, output_sharding.output_spec)
    return convolution_handler


def _nll_loss_forward_strategy(original):
    """nll_loss_forward with class weights and reduction='mean': every operand replicated (the
    output and the total weight too, so the even-sharding check of the mean has nothing to
    refuse) instead of a batch shard's weighted mean kept as ``Partial("avg")``:
    sum(w[t] * loss) / sum(w[t]) is no mean of the shards' own."""
    def nll_loss_forward_strategy(op_schema):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
        from torch.distributed.tensor._ops.utils import generate_redistribute_costs
        from torch.distributed.tensor.placement_types import Replicate

        args = op_schema.args_schema
        if args[2] is None or args[3] != 1:      # no weight, or not Reduction.MEAN
            return original(op_schema)
        mesh = op_schema.get_mesh_from_args()
        whole = (Replicate(),) * mesh.ndim
        operands = args[:3]
        found = []
        for index in range(len(operands[0].strategies)):
            inputs = [DTensorSpec(mesh, whole, tensor_meta=o.strategies[index].output_spec.tensor_meta)
                      for o in operands]
            found.append(OpSpec(output_specs=(DTensorSpec(mesh, whole), DTensorSpec(mesh, whole)), input_specs=inputs,
                                redistribute_cost=[generate_redistribute_costs(o, i) for o, i in zip(operands, inputs)]))
        return OpStrategy(found)
    return nll_loss_forward_strategy


_SCAN_DIFF = """\
--- a/torch/distributed/tensor/_ops/_math_ops.py
+++ b/torch/distributed/tensor/_ops/_math_ops.py
@@ def scan_strategy(op_schema: OpSchema) -> OpStrategy:
     dim = args_schema[1]
     if not isinstance(dim, int):
         raise AssertionError(f"Expected int, got {type(dim)}")
+    dim = normalize_dim(dim, input_strategy.ndim)
     return common_reduction_strategy(
         input_strategy, [dim], keep_dim=True, reduction_linear=False
     )
"""

_SELECT_DIFF = """\
--- a/torch/distributed/tensor/_ops/_tensor_ops.py
+++ b/torch/distributed/tensor/_ops/_tensor_ops.py
@@ def select_backward_strategy(op_schema: OpSchema) -> OpStrategy:
     if not isinstance(dim, int):
         raise AssertionError(f"Expected int, got {type(dim)}")
+    # dim indexes the gradient input, one dim more than grad_output
+    dim = normalize_dim(dim, input_strategy.ndim + 1)
     output_strategies: list[OpSpec] = []
"""

_CONV_DIFF = """\
--- a/torch/distributed/tensor/_tp_conv.py
+++ b/torch/distributed/tensor/_tp_conv.py
@@ def convolution_handler(
     output_spec = output_sharding.output_spec
     if not isinstance(output_spec, dtensor.DTensorSpec):
         raise AssertionError
+    if output_sharding.needs_redistribute:
+        dtensor.DTensor._op_dispatcher.redistribute_local_args(
+            op_info,
+            output_sharding.redistribute_schema,
+            output_sharding.use_val_from_redistribute_schema,
+        )

     # local propagation
"""

_NLL_DIFF = """\
--- a/torch/distributed/tensor/_ops/_math_ops.py
+++ b/torch/distributed/tensor/_ops/_math_ops.py
@@ def nll_loss_forward_strategy(op_schema: OpSchema) -> OpStrategy:
     input_shape = input_strategy.shape
     channel_dim = 1 if len(input_shape) >= 2 else 0
+    # a weighted mean, sum(w[t] * loss) / sum(w[t]), is no mean of the shards' weighted means:
+    # keep the batch whole, not only the channel dim
+    weighted_mean = weight_strategy is not None and reduction == Reduction.MEAN.value
+    replicated_dims = list(range(len(input_shape))) if weighted_mean else [channel_dim]

     output_strategy = OpStrategy([])
     for idx, input_placement_strategy in enumerate(input_strategy.strategies):
@@ def nll_loss_forward_strategy(op_schema: OpSchema) -> OpStrategy:
         input_expected_spec = DTensorSpec(
             mesh=mesh,
             placements=replicate_reduction_dims(
-                input_src_spec.placements, [channel_dim]
+                input_src_spec.placements, replicated_dims
             ),
             tensor_meta=input_src_spec.tensor_meta,
         )
"""

#: every root cause with a local fix
FIXES: dict[str, Fix] = {
    "cumsum-negative-dim": Fix("cumsum-negative-dim", "cumsum", "strategy",
                               ("cumsum.default", "cumprod.default", "logcumsumexp.default"), _scan_strategy, _SCAN_DIFF),
    "select-backward-negative-dim": Fix("select-backward-negative-dim", "select", "strategy",
                                        ("select_backward.default",), _select_backward_strategy, _SELECT_DIFF),
    "nll-loss-weighted-mean": Fix("nll-loss-weighted-mean", "cross_entropy_weighted", "strategy",
                                  ("nll_loss_forward.default", "nll_loss2d_forward.default"), _nll_loss_forward_strategy,
                                  _NLL_DIFF),
    "conv2d-runtime-redistribution": Fix("conv2d-runtime-redistribution", "conv2d", "handler",
                                         ("convolution.default",), _convolution_handler, _CONV_DIFF),
}


def _failing(results) -> dict[tuple, str]:
    return {(r.case, r.mesh, f.layouts): f.klass for r in results for f in r.findings if f.klass in FAILING}


def _run(spec, meshes, limit, cases) -> list:
    from shardverify.features.dtensor.run import run_case

    return [run_case(spec, case_id, case, tuple(mesh), limit=limit, budget=None)
            for mesh in meshes for case_id, case in spec.op_cases() if cases is None or case_id in cases]


def prove(fix: Fix, spec, meshes, *, limit: int | None = None, cases: set[str] | None = None) -> Proof:
    """The op's combinations (``limit`` per case and mesh, evenly spaced) run stock and with
    ``fix``; ``cases``: only these case ids (all by default)."""
    stock = _run(spec, meshes, limit, cases)
    with patched(fix):
        fixed = _run(spec, meshes, limit, cases)
    before, after = _failing(stock), _failing(fixed)
    newly = tuple(sorted(f"{case} {mesh} {dict(layouts)}: {klass}" for (case, mesh, layouts), klass in after.items()
                         if (case, mesh, layouts) not in before))
    return Proof(fix.slug, sum(r.executed for r in fixed), sum((r.counts for r in stock), Counter()),
                 sum((r.counts for r in fixed), Counter()), newly, _phases(stock), _phases(fixed))


def _phases(results) -> Counter:
    return Counter(f"{f.klass} {f.phase or '-'}" for r in results for f in r.findings if f.klass in FAILING)
