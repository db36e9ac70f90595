"""A user's own op and its DTensor sharding rule, with a mistake in the rule.

``mylib::row_normalize(x) = x / x.sum(-1, keepdim=True)`` divides each row by its own sum: the
rows are independent, the last dim is not. The rule below lets DTensor run a shard of *every*
dim locally, the last one included, so a rank holding a block of each row's columns divides by
its block's sum instead of the row's. `shardverify dtensor --custom examples/row_normalize.yaml --mesh 4` finds it
(exit status 1). The right rule shards every dim but the last: ``range(x.ndim - 1)``.
"""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    x, = ctx.saved_tensors
    total = x.sum(-1, keepdim=True)
    return grad / total - (grad * x).sum(-1, keepdim=True) / (total * total)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


torch.library.define("mylib::row_normalize", "(Tensor x) -> Tensor")
torch.library.impl("mylib::row_normalize", "CompositeExplicitAutograd")(_normalize)
torch.library.register_fake("mylib::row_normalize")(lambda x: torch.empty_like(x))
torch.library.register_autograd("mylib::row_normalize", _backward, setup_context=_setup)


@register_sharding(torch.ops.mylib.row_normalize.default)
def _rule(x):
    # wrong: range(x.ndim) also runs a shard of the normalised (last) dim locally
    return [([Replicate()], [Replicate()])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim)]
