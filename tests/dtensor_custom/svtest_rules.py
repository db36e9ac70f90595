"""A user's custom op with DTensor rules of its own, for tests/test_dtensor_exec.py.

``svtest::row_normalize(x) = x / x.sum(-1, keepdim=True)``: rows are independent, the last dim
is not. Its rule is right (R, or a shard of any dim but the last). ``svtest::row_normalize_bad``
is the same op with a planted wrong rule: it also runs a shard of the last dim locally.
"""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


for _name in ("row_normalize", "row_normalize_bad"):
    torch.library.define(f"svtest::{_name}", "(Tensor x) -> Tensor")
    torch.library.impl(f"svtest::{_name}", "CompositeExplicitAutograd")(_normalize)
    torch.library.register_fake(f"svtest::{_name}")(lambda x: torch.empty_like(x))

    def _backward(ctx, grad):
        x, = ctx.saved_tensors
        s = x.sum(-1, keepdim=True)
        return grad / s - (grad * x).sum(-1, keepdim=True) / (s * s)

    def _setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    torch.library.register_autograd(f"svtest::{_name}", _backward, setup_context=_setup)


@register_sharding(torch.ops.svtest.row_normalize.default)
def _right(x):
    return [([Replicate()], [Replicate()])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim - 1)]


@register_sharding(torch.ops.svtest.row_normalize_bad.default)
def _wrong(x):
    return [([Replicate()], [Replicate()])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim)]


# ``svtest::row_normalize_bad_axis0`` / ``_axis1``: the same op with a planted wrong rule that is
# not symmetric under swapping the mesh's axes: a shard of the last dim runs locally only when
# mesh axis 0 (or 1) holds it; on the other axis the rule redistributes and is right. A check
# that keeps one layout per orbit of mesh-axis swaps runs only one of the two mirrors.
def _asymmetric(bad_axis: int):
    import itertools

    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    def strategy(op_schema):
        first = op_schema.args_schema[0]
        meta = first.strategies[0].output_spec.tensor_meta
        ndim = len(meta.shape)
        allowed = [[Replicate()] + [Shard(d) for d in range(ndim - 1)] + ([Shard(ndim - 1)] if axis == bad_axis else [])
                   for axis in range(first.mesh.ndim)]
        specs = []
        for placements in itertools.product(*allowed):
            spec = DTensorSpec(first.mesh, tuple(placements), tensor_meta=meta)
            specs.append(OpSpec(output_specs=spec, input_specs=[DTensorSpec(first.mesh, tuple(placements), tensor_meta=meta)],
                                redistribute_cost=[generate_redistribute_costs(first, spec)]))
        return OpStrategy(specs)

    return strategy


def _register_asymmetric() -> None:
    from torch.distributed.tensor._ops.utils import register_op_strategy

    for axis in (0, 1):
        name = f"row_normalize_bad_axis{axis}"
        torch.library.define(f"svtest::{name}", "(Tensor x) -> Tensor")
        torch.library.impl(f"svtest::{name}", "CompositeExplicitAutograd")(_normalize)
        torch.library.register_fake(f"svtest::{name}")(lambda x: torch.empty_like(x))
        torch.library.register_autograd(f"svtest::{name}", _backward, setup_context=_setup)
        register_op_strategy(getattr(torch.ops.svtest, name).default)(_asymmetric(axis))


_register_asymmetric()
