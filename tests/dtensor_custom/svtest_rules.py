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
