"""SyncBatchNorm that also runs on CPU process groups (gloo).

`nn.SyncBatchNorm` refuses CPU inputs (its kernels are CUDA only) and DDP refuses any
`nn.SyncBatchNorm` instance in a CPU module, yet the harness must verify the SyncBatchNorm plan on
the gloo pool. `convert_sync_batchnorm` therefore converts with torch's own
`nn.SyncBatchNorm.convert_sync_batchnorm` and, on CPU only, replaces each converted layer by a
`CpuSyncBatchNorm` holding the same state, which computes the same global batch statistics with
differentiable all-reduces. On GPUs torch's layer is used unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["CpuSyncBatchNorm", "convert_sync_batchnorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward; the adjoint of a sum-all-reduce is a sum-all-reduce."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class CpuSyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics cover the whole process group, on any device.

    Same parameters and buffers (names included) as `nn.SyncBatchNorm`; deliberately not a
    subclass of it, because DDP rejects those on CPU."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        self._check_input_dim(input)
        if not self.training or not dist.is_initialized():
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        count = input.new_tensor([input.numel() // channels], dtype=input.dtype)
        totals = _AllReduceSum.apply(torch.cat([input.sum(dims), count]), group)
        n = totals[-1]
        mean = totals[:channels] / n
        centred = input - mean.reshape(shape)
        var = _AllReduceSum.apply((centred * centred).sum(dims), group) / n   # biased, as batch norm
        out = centred / torch.sqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                          else self.momentum)
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                unbiased = var.detach() * n / (n - 1)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return out


def convert_sync_batchnorm(module: nn.Module, group: dist.ProcessGroup,
                           device: torch.device) -> nn.Module:
    """Torch's conversion, then (on CPU) a `CpuSyncBatchNorm` in place of each converted layer."""
    module = nn.SyncBatchNorm.convert_sync_batchnorm(module, group)
    if device.type != "cpu":
        return module
    if isinstance(module, nn.SyncBatchNorm):
        return _cpu_layer(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.SyncBatchNorm):
                setattr(parent, name, _cpu_layer(child))
    return module


def _cpu_layer(layer: nn.SyncBatchNorm) -> CpuSyncBatchNorm:
    replacement = CpuSyncBatchNorm(layer.num_features, layer.eps, layer.momentum, layer.affine,
                                   layer.track_running_stats, layer.process_group)
    replacement.load_state_dict(layer.state_dict())
    replacement.train(layer.training)
    return replacement.to(next(iter(layer.state_dict().values()), torch.empty(0)).device)
